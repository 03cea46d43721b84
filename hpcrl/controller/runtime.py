"""Controller side of the runtime: sends calls to worker ranks and collects their replies.

Why futures over a single-threaded progress loop: the controller may have calls in flight
on several groups at once (e.g. rollout generating on some ranks while the reference model
scores on others). Every wait advances all of them; no thread is needed on the controller
except the liveness monitor. Replies from one rank arrive in call order, which is how a
reply is matched to its call.

When a call fails, the error raised names the rank that failed first, not the first reply to
arrive: see `ControllerRuntime.failure_error` and `hpcrl.controller.postmortem`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from hpcrl.controller import postmortem
from hpcrl.controller.codec import Encoded, byte_views, decode
from hpcrl.controller.errors import (
    CallTimeout,
    HpcrlRuntimeError,
    RankFailure,
    RemoteError,
    RemoteFailure,
    WorkerDiedError,
    WorkerLostError,
)
from hpcrl.controller.gather import plan_merged
from hpcrl.controller.liveness import Liveness
from hpcrl.controller.stderr_log import exit_time, read_section, terminal
from hpcrl.controller.transport import (
    TAG_CALL,
    TAG_CALL_DATA,
    TAG_REPLY,
    TAG_REPLY_DATA,
    Backoff,
    dumps,
    post_receives,
    probe_header,
    send_message,
)
from hpcrl.launch.faults import FaultInjector
from hpcrl.launch.world import World, abort


@dataclass
class _Part:
    """One rank's share of a call: what we sent it and what it has sent back so far."""

    call: Call
    rank: int
    sends: list[MPI.Request]
    keep: Encoded  # buffers must live until the sends complete
    header: dict | None = None  # the worker's reply header, once it arrived
    recv_objs: list[Any] | None = None
    recvs: list[MPI.Request] | None = None


@dataclass
class Call:
    """A call on a set of ranks; done when every rank replied or one rank failed."""

    id: int
    what: str
    ranks: list[int]
    combine: Callable[[dict[int, Any]], Any]
    results: dict[int, Any] = field(default_factory=dict)
    failures: list[RemoteFailure] = field(default_factory=list)
    remaining: int = 0
    merge_ranks: list[int] = field(default_factory=list)  # DP output ranks, received side by side
    held: dict[int, _Part] = field(default_factory=dict)  # their parts whose header is in
    replied: set[int] = field(default_factory=set)  # ranks whose reply header arrived (ok or not)
    first_failure_at: float | None = None  # time.monotonic() when the first failure arrived
    error: HpcrlRuntimeError | None = None  # the report, once made (result() raises it again)

    @property
    def done(self) -> bool:
        return self.remaining == 0 or bool(self.failures)


class Future:
    """Result of a call that is in flight; `result()` waits for it and combines the ranks' outputs."""

    def __init__(self, runtime: ControllerRuntime, call: Call) -> None:
        self._runtime = runtime
        self._call = call
        self._value: Any = None
        self._combined = False

    def done(self) -> bool:
        """True once the result (or a failure) is available; advances all calls in flight."""
        self._runtime.progress()
        return self._call.done

    def result(self, timeout: float | None = None) -> Any:
        """Wait (at most `timeout` s) and return the collected result, or raise the remote error."""
        self._runtime.wait(self._call, timeout)
        call = self._call
        if call.failures or not call.done:  # not done: a worker was lost
            raise self._runtime.failure_error(call)
        if not self._combined:
            self._value = call.combine(call.results)
            call.results = {}
            self._combined = True
        return self._value

    def __repr__(self) -> str:
        state = "done" if self._call.done else "pending"
        return f"<Future {self._call.what} #{self._call.id} {state}>"


class ControllerRuntime:
    """Sends calls and advances replies; one instance lives on rank 0 while `run` is active."""

    def __init__(self, world: World, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 abort_grace_s: float, failure_grace_s: float = 1.0, stderr_files: list[str] | None = None) -> None:
        self.world = world
        self.comm = world.control
        self._ids = itertools.count(1)
        self._pending: dict[int, deque[_Part]] = {}
        # rank -> (seconds silent, time.monotonic(), time.time()) when the liveness thread lost it
        self._lost: dict[int, tuple[float, float, float]] = {}
        self._lost_error: HpcrlRuntimeError | None = None
        self._abort_grace_s = abort_grace_s
        self.failure_grace_s = failure_grace_s
        self.stderr_files = stderr_files or [""] * world.size  # per rank, see hpcrl.controller.stderr_log
        self.liveness = Liveness(world, heartbeat_interval_s, heartbeat_timeout_s, self._on_lost)
        self.closed = False
        self.faults = FaultInjector(world.rank)  # HPCRL_FAULT, for the fault tests (hpcrl/launch/faults.py)
        # called while a blocking call waits and no message moved: keeps other work going meanwhile (the
        # fully asynchronous rollout starts the engines' next segment here while the trainer computes,
        # hpcrl.trainer.stream). It must not block; it may start calls and poll futures.
        self.idle: Callable[[], None] | None = None
        self._in_idle = False

    # -- liveness -------------------------------------------------------------------------
    def _on_lost(self, rank: int, silent_s: float) -> None:
        """Runs in the liveness thread: record, tell the user now, and make sure the job ends."""
        err = WorkerLostError(rank, self.world.describe(rank), silent_s, self.liveness.timeout_s)
        self._lost.setdefault(rank, (silent_s, time.monotonic(), time.time()))
        print(f"[hpcrl controller] ERROR: {err}", file=terminal(err=True), flush=True)

        def last_resort() -> None:
            print(f"[hpcrl controller] aborting the job: {err}", file=terminal(err=True), flush=True)
            abort(2)

        timer = threading.Timer(self._abort_grace_s, last_resort)
        timer.daemon = True
        timer.start()

    def check(self) -> None:
        """Raise in the main thread if a worker was lost (called by every wait)."""
        if self._lost:
            if self._lost_error is None:
                self._lost_error = self._make_error(None, self._collect(None, {}))
            raise self._lost_error

    # -- failure reports --------------------------------------------------------------------
    def failure_error(self, call: Call) -> HpcrlRuntimeError:
        """The error a failed call raises: the rank that failed first, then the others.

        Why wait before raising: the first reply that reports a failure is often a consequence
        (a peer's collective saw `Connection closed by peer` because another rank died inside
        C++); the dead rank itself never replies. So the controller keeps advancing the call for
        a bounded time (`_settle`), reads which ranks have exited from their stderr files, and
        orders what it has (`postmortem.order`).
        """
        if call.error is None:
            deaths = self._settle(call)
            call.error = self._make_error(call, self._collect(call, deaths))
        return call.error

    def _lost_now(self) -> dict[int, tuple[float, float, float]]:
        return dict(self._lost)  # a copy: the liveness thread may add a rank while we iterate

    def _stderr(self, rank: int) -> tuple[str, int]:
        return self.stderr_files[rank], self.world.info(rank).pid

    def _open_ranks(self, call: Call, deaths: dict[int, float]) -> list[int]:
        return [r for r in call.ranks if r not in call.replied and r not in self._lost and r not in deaths]

    def _settle(self, call: Call) -> dict[int, float]:
        """Advance `call` until each of its ranks replied, exited or was lost, or the grace is over.

        Bounds: `failure_grace_s` after the first failure once a cause is known (a rank exited or
        was lost, or raised an error that is not a consequence); while every failure is a
        consequence, up to the heartbeat bound, by when a dead rank that left no readable stderr
        is declared lost; and never past half the abort grace after a loss (then the job ends).
        Returns {rank: exit time} of the ranks whose stderr file says they exited.
        """
        lost_since = [mono - silent for silent, mono, _ in self._lost_now().values()]
        first = min([t for t in (call.first_failure_at, *lost_since) if t is not None], default=time.monotonic())
        long_bound = self.liveness.timeout_s + 2 * self.liveness.interval_s
        deaths: dict[int, float] = {}
        next_look = 0.0
        backoff = Backoff(max_sleep_s=0.01)
        while True:
            if self._progress():
                backoff.reset()
            now = time.monotonic()
            if now >= next_look:  # a few hundred bytes per open rank, 10 times a second
                for r in self._open_ranks(call, deaths):
                    t = exit_time(*self._stderr(r))
                    if t is not None:
                        deaths[r] = t
                next_look = now + 0.1
            if not self._open_ranks(call, deaths):
                break
            cause_known = bool(deaths or self._lost) or any(
                not postmortem.is_consequence(f"{f.exc_type}: {f.exc_message}") for f in call.failures)
            limit = first + (self.failure_grace_s if cause_known else long_bound)
            lost = self._lost_now()
            if lost:
                limit = min(limit, min(mono for _, mono, _ in lost.values()) + self._abort_grace_s / 2)
            if now >= limit:
                break
            backoff.pause()
        return deaths

    def _collect(self, call: Call | None, deaths: dict[int, float]) -> list[RankFailure]:
        """Every failure known now (of `call`, and every lost rank), first failure first."""
        found: list[RankFailure] = []
        raised_ranks: set[int] = set()
        now = time.time()
        for f in call.failures if call else []:
            found.append(postmortem.raised(f.rank, self.world.describe(f.rank), f, now))
            raised_ranks.add(f.rank)
        for r, at in deaths.items():
            found.append(postmortem.died(r, self.world.describe(r), read_section(*self._stderr(r)), at))
        bound = self.liveness.timeout_s
        for r, (silent, _, wall) in self._lost_now().items():
            if r in deaths or r in raised_ranks:
                continue
            section = read_section(*self._stderr(r))
            at = section.exited_at if section.exited_at is not None else wall - silent
            found.append(postmortem.died(r, self.world.describe(r), section, at,
                                         lost=f"no heartbeat for {silent:.1f} s (bound {bound:g} s)"))
        if call is not None and call.first_failure_at is not None:
            waited = time.monotonic() - call.first_failure_at
            for r in self._open_ranks(call, deaths):
                found.append(RankFailure(r, self.world.describe(r), "no reply",
                                         f"no reply {waited:.1f} s after the first failure (still in the call)"))
        return postmortem.order(found)

    def _make_error(self, call: Call | None, failures: list[RankFailure]) -> HpcrlRuntimeError:
        context = f"{call.what} (call {call.id}) failed: " if call is not None else ""
        first = failures[0] if failures else None
        if first is None or first.kind == "no reply":  # cannot happen: a call fails with a failure or a loss
            return HpcrlRuntimeError(f"{context}no failure recorded")
        if first.kind == "raised":
            assert first.remote is not None
            return RemoteError(first.remote, failures=failures)
        if first.kind == "died":
            return WorkerDiedError(first, failures, context)
        silent = self._lost[first.rank][0]
        return WorkerLostError(first.rank, first.where, silent, self.liveness.timeout_s, failures, context)

    # -- sending --------------------------------------------------------------------------
    def submit(
        self,
        what: str,
        messages: dict[int, tuple[dict, Encoded]],
        combine: Callable[[dict[int, Any]], Any],
        merge_ranks: list[int] | None = None,
    ) -> Future:
        """Send one header (+ buffers) to each rank in `messages`; returns the call's future.

        Headers are pickled once per distinct (header, payload) object, so ONE_TO_ALL does
        not pay the pickling per rank. `merge_ranks` (MPI ranks in DP order) asks for their
        results to be received into one buffer per field, ready to be concatenated for free.
        """
        if self.closed:
            raise RuntimeError("the hpcrl runtime is shut down")
        self.check()
        call = Call(next(self._ids), what, sorted(messages), combine, remaining=len(messages),
                    merge_ranks=list(merge_ranks or []))
        blobs: dict[tuple[int, int], bytes] = {}
        for rank in call.ranks:
            header, enc = messages[rank]
            key = (id(header), id(enc))
            if key not in blobs:
                blobs[key] = dumps({**header, "id": call.id, "skel": enc.skeleton, "specs": enc.specs})
            sends = send_message(self.comm, rank, TAG_CALL, TAG_CALL_DATA, blobs[key], enc)
            self._pending.setdefault(rank, deque()).append(_Part(call, rank, sends, enc))
        return Future(self, call)

    # -- receiving ------------------------------------------------------------------------
    def _post(self, part: _Part, objs: list[Any] | None = None) -> None:
        """Post the receives of a part's result buffers (into `objs` if given, else fresh ones)."""
        specs = part.header["specs"]
        if objs is None:
            part.recv_objs, part.recvs = post_receives(self.comm, part.rank, TAG_REPLY_DATA, specs)
        else:
            part.recv_objs = objs
            part.recvs = [self.comm.Irecv([v, MPI.BYTE], part.rank, TAG_REPLY_DATA)
                          for v in byte_views(objs) if v.nbytes]

    def _post_merged(self, call: Call) -> None:
        """All output ranks' headers are in: receive their shards side by side (see gather.py)."""
        parts = [call.held[r] for r in call.merge_ranks]
        plan = None if call.failures else plan_merged([p.header["specs"] for p in parts])
        for i, part in enumerate(parts):
            self._post(part, None if plan is None else plan[i])
        call.held.clear()

    def _advance(self, rank: int, queue: deque[_Part]) -> bool:
        """Move the oldest parts of `rank` forward; True if anything happened."""
        moved = False
        while queue:
            part = queue[0]
            call = part.call
            if part.header is None:
                header = probe_header(self.comm, rank, TAG_REPLY)
                if header is None:
                    return moved
                moved = True
                if header["id"] != call.id:
                    raise RuntimeError(f"rank {rank} replied to call {header['id']}, expected {call.id}")
                part.header = header
                call.replied.add(rank)
                if not header["ok"]:
                    call.failures.append(header["failure"])
                    if call.first_failure_at is None:
                        call.first_failure_at = time.monotonic()
                    part.recvs, part.recv_objs = [], []
                elif rank in call.merge_ranks:
                    call.held[rank] = part
                    if len(call.held) == len(call.merge_ranks) or call.failures:
                        self._post_merged(call)
                else:
                    self._post(part)
            if part.recvs is None:  # a merged receive waits for the other output ranks' headers
                if not call.failures:
                    return moved
                self._post_merged(call)
                moved = True
            if part.recvs and not MPI.Request.Testall(part.recvs):
                return moved
            moved = True
            MPI.Request.Waitall(part.sends)  # the worker has replied, so it received everything
            queue.popleft()
            if part.header["ok"]:
                call.results[rank] = decode(part.header["skel"], part.recv_objs or [])
            call.remaining -= 1
        return moved

    def progress(self) -> bool:
        """Advance every call in flight once; True if any message moved."""
        self.check()
        return self._progress()

    def _progress(self) -> bool:
        moved = False
        for rank in list(self._pending):
            queue = self._pending[rank]
            moved |= self._advance(rank, queue)
            if not queue:
                del self._pending[rank]
        return moved

    def _hot(self) -> bool:
        """True while result buffers are arriving (then polling only yields; see Backoff)."""
        return any(q[0].recvs for q in self._pending.values() if q)

    def wait(self, call: Call, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = Backoff()
        while not call.done:
            if self._lost:  # the caller raises the report (`failure_error`)
                return
            if self._progress():
                backoff.reset()
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise CallTimeout(f"{call.what} (call {call.id}) not done after {timeout} s")
            if self.idle is not None and not self._in_idle:
                self._in_idle = True
                try:
                    self.idle()
                finally:
                    self._in_idle = False
            backoff.pause(self._hot())

    def drain(self) -> None:
        """Wait for every call in flight (results stay in their futures)."""
        backoff = Backoff()
        while self._pending:
            if not self.progress():
                backoff.pause(self._hot())


_RUNTIME: ControllerRuntime | None = None


def set_runtime(rt: ControllerRuntime | None) -> None:
    global _RUNTIME
    _RUNTIME = rt


def get_runtime() -> ControllerRuntime:
    """The controller runtime of this process; only rank 0 inside `hpcrl.controller.run` has one."""
    if _RUNTIME is None:
        raise RuntimeError(
            "no hpcrl controller runtime here: worker groups are created by the controller program "
            "(rank 0) running inside hpcrl.controller.run(main)"
        )
    return _RUNTIME
