"""Controller side of the runtime: sends calls to worker ranks and collects their replies.

Why futures over a single-threaded progress loop: the controller may have calls in flight
on several groups at once (e.g. rollout generating on some ranks while the reference model
scores on others). Every wait advances all of them; no thread is needed on the controller
except the liveness monitor. Replies from one rank arrive in call order, which is how a
reply is matched to its call.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from hpcrl.controller.codec import Encoded, byte_views, decode
from hpcrl.controller.errors import CallTimeout, RemoteError, RemoteFailure, WorkerLostError
from hpcrl.controller.gather import plan_merged
from hpcrl.controller.liveness import Liveness
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
        if call.failures:
            raise RemoteError(call.failures[0], others=len(call.failures) - 1)
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
                 abort_grace_s: float) -> None:
        self.world = world
        self.comm = world.control
        self._ids = itertools.count(1)
        self._pending: dict[int, deque[_Part]] = {}
        self._lost: WorkerLostError | None = None
        self._abort_grace_s = abort_grace_s
        self.liveness = Liveness(world, heartbeat_interval_s, heartbeat_timeout_s, self._on_lost)
        self.closed = False

    # -- liveness -------------------------------------------------------------------------
    def _on_lost(self, rank: int, silent_s: float) -> None:
        """Runs in the liveness thread: record, tell the user now, and make sure the job ends."""
        err = WorkerLostError(rank, self.world.describe(rank), silent_s, self.liveness.timeout_s)
        if self._lost is None:
            self._lost = err
        print(f"[hpcrl controller] ERROR: {err}", file=sys.stderr, flush=True)

        def last_resort() -> None:
            print(f"[hpcrl controller] aborting the job: {err}", file=sys.stderr, flush=True)
            abort(2)

        timer = threading.Timer(self._abort_grace_s, last_resort)
        timer.daemon = True
        timer.start()

    def check(self) -> None:
        """Raise in the main thread if a worker was lost (called by every wait)."""
        if self._lost is not None:
            raise self._lost

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
                if not header["ok"]:
                    call.failures.append(header["failure"])
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
            if self.progress():
                backoff.reset()
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise CallTimeout(f"{call.what} (call {call.id}) not done after {timeout} s")
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
