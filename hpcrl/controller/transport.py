"""Point-to-point messages over MPI: one pickled header, then raw buffers; never a blocking wait.

Why non-blocking everywhere: a peer that died never answers, and MPI has no receive
timeout, so every wait here is a poll loop that also asks the liveness monitor whether the
peer is still there (see `liveness.py`). Header and buffers use separate tags; MPI keeps
messages between two ranks with the same tag in order, so the buffers of call k are
always matched before those of call k+1.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from hpcrl.controller.codec import Encoded, Spec, allocate

TAG_CALL = 11  # controller -> worker: pickled call header
TAG_CALL_DATA = 12  # controller -> worker: raw argument buffers
TAG_REPLY = 21  # worker -> controller: pickled reply header
TAG_REPLY_DATA = 22  # worker -> controller: raw result buffers
TAG_BEAT = 31  # both ways, on the `beats` communicator only


class Backoff:
    """Poll pacing: a very short hot phase, then short sleeps, then longer ones while idle.

    Why not spin: ranks often outnumber cores (5 ranks on 2 cores in CI, or a node shared
    with vLLM's threads). Spinning, even with sched_yield, keeps every waiting rank runnable
    and starves the one rank that has work; measured here it made a no-op call 20x slower
    under load. Sleeping in ~20 us steps (with a 1 us timer slack, see `tighten_timer_slack`)
    lets the busy rank run and still answers within tens of microseconds.
    """

    __slots__ = ("spin_s", "short_s", "max_sleep_s", "_t0", "_sleep")

    def __init__(self, spin_s: float = 50e-6, short_s: float = 0.005, max_sleep_s: float = 0.001) -> None:
        self.spin_s = spin_s  # yield-spin this long after the last activity
        self.short_s = short_s  # then sleep 20 us steps until this long after it
        self.max_sleep_s = max_sleep_s  # then back off to this (idle ranks cost ~nothing)
        self.reset()

    def reset(self) -> None:
        self._t0 = -1.0
        self._sleep = 2e-5

    def pause(self, hot: bool = False) -> None:
        """Wait a little; `hot` (this rank is receiving bulk data) only yields.

        Only receivers poll hot: on the shared-memory transport the receiver does the copy, and
        measured here (5 ranks, 2 cores) senders that also spun made a 64 MB gather 2x slower.
        """
        if hot:
            self.reset()
            os.sched_yield()
            return
        now = time.perf_counter()
        if self._t0 < 0:
            self._t0 = now
        idle = now - self._t0
        if idle < self.spin_s:
            os.sched_yield()
            return
        time.sleep(self._sleep)
        if idle > self.short_s:
            self._sleep = min(self._sleep * 2, self.max_sleep_s)


def tighten_timer_slack() -> None:
    """Ask Linux for 1 us timer slack (default 50 us) so short poll sleeps stay short."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, ns
    except (OSError, AttributeError):
        pass


def dumps(header: Any) -> bytes:
    return pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)


def send_message(
    comm: MPI.Comm, dest: int, tag: int, data_tag: int, header_blob: bytes, enc: Encoded
) -> list[MPI.Request]:
    """Start sending a header (already pickled) and its raw buffers; the caller keeps `enc` alive."""
    reqs = [comm.Isend([header_blob, MPI.BYTE], dest, tag)]
    for buf in enc.buffers:
        if buf.nbytes:
            reqs.append(comm.Isend([buf, MPI.BYTE], dest, data_tag))
    return reqs


def probe_header(comm: MPI.Comm, source: int, tag: int) -> Any | None:
    """Receive one pickled header from `source` if one has arrived, else None."""
    status = MPI.Status()
    msg = comm.Improbe(source, tag, status)
    if msg is None:
        return None
    blob = bytearray(status.Get_count(MPI.BYTE))
    msg.Recv([blob, MPI.BYTE])
    return pickle.loads(blob)


def post_receives(
    comm: MPI.Comm, source: int, data_tag: int, specs: list[Spec]
) -> tuple[list[Any], list[MPI.Request]]:
    """Allocate the tensors/arrays described by `specs` and post receives straight into them."""
    objs, views = allocate(specs)
    reqs = [comm.Irecv([v, MPI.BYTE], source, data_tag) for v in views if v.nbytes]
    return objs, reqs


def wait_all(
    reqs: list[MPI.Request],
    check: Callable[[], None],
    deadline: float | None = None,
    what: str = "MPI transfer",
) -> None:
    """Complete `reqs`, calling `check` (which raises if a peer is lost) while waiting."""
    backoff = Backoff()
    while not MPI.Request.Testall(reqs):
        check()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete in time")
        backoff.pause(hot=True)
