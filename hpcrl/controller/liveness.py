"""Heartbeats between the controller and every worker, in a thread of each rank.

Why a thread: a worker may compute for minutes inside one call (a training step, a long
generation). The main thread is then busy, but torch releases the GIL and Python switches
threads every few ms, so this thread keeps beating and a slow rank is never mistaken for
a dead one. A SIGKILLed rank, a lost node or a hung MPI stack stops beating, and its peers
notice after `timeout_s`, whatever the main thread is doing.

The controller watches all workers; each worker watches only the controller. What to do
on a loss is the caller's choice (`on_lost`): the controller raises in its main thread and
then aborts the job, a worker aborts at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from hpcrl.controller.stderr_log import terminal
from hpcrl.controller.transport import TAG_BEAT
from hpcrl.launch.world import CONTROLLER_RANK, World


class Liveness:
    """Send a beat to each peer every `interval_s`; report a peer silent for `timeout_s` once."""

    def __init__(
        self,
        world: World,
        interval_s: float,
        timeout_s: float,
        on_lost: Callable[[int, float], None],
    ) -> None:
        if timeout_s <= 2 * interval_s:
            raise ValueError(f"heartbeat timeout {timeout_s} s must exceed twice the interval {interval_s} s")
        self.world = world
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_lost = on_lost
        if world.is_controller:
            peers = [r for r in range(world.size) if r != CONTROLLER_RANK]
        else:
            peers = [CONTROLLER_RANK]
        now = time.monotonic()
        self._last = {p: now for p in peers}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcrl-liveness", daemon=True)
        self.lost: tuple[int, float] | None = None  # (rank, seconds silent) of the first loss
        # beats sent to / received from each rank; read only after `stop()` (see `drain`)
        self.sent = np.zeros(world.size, dtype=np.int64)
        self.received = np.zeros(world.size, dtype=np.int64)

    def start(self) -> None:
        self._thread.start()

    def retire(self, rank: int) -> None:
        """Stop watching `rank` (it shut down cleanly); beats to it also stop."""
        with self._lock:
            self._last.pop(rank, None)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        comm = self.world.beats
        beat = np.zeros(1, dtype=np.uint8)
        sink = np.zeros(1, dtype=np.uint8)
        status = MPI.Status()
        pending: list[MPI.Request] = []
        next_beat = 0.0
        tick = min(self.interval_s / 4, 0.1)
        reported_errors = 0

        def report(e: MPI.Exception) -> None:  # a failed peer may surface as an MPI error; silence decides
            nonlocal reported_errors
            if reported_errors < 3:
                print(f"[hpcrl liveness, rank {self.world.rank}] MPI error: {e}", file=terminal(err=True), flush=True)
            reported_errors += 1

        # Each send, each test and the receiving are guarded apart: one dead peer's error must not stop
        # the beats to the peers after it, nor the receiving of everyone's beats. (It did: a SIGKILLed
        # rank 3 made every Isend to it raise, rank 4 got no beat and aborted, and the controller, no
        # longer receiving, named whichever rank had gone silent longest.)
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                peers = list(self._last)
            if now >= next_beat:
                next_beat = now + self.interval_s
                for p in peers:
                    try:
                        pending.append(comm.Isend([beat, MPI.BYTE], p, TAG_BEAT))
                        self.sent[p] += 1
                    except MPI.Exception as e:
                        report(e)
            still = []
            for r in pending:
                try:
                    if not r.Test():
                        still.append(r)
                except MPI.Exception as e:
                    report(e)
            pending = still
            try:
                while comm.Iprobe(MPI.ANY_SOURCE, TAG_BEAT, status):
                    src = status.Get_source()
                    comm.Recv([sink, MPI.BYTE], src, TAG_BEAT)
                    self.received[src] += 1
                    with self._lock:
                        if src in self._last:
                            self._last[src] = time.monotonic()
            except MPI.Exception as e:
                report(e)
            now = time.monotonic()
            with self._lock:
                silent = [(p, now - t) for p, t in self._last.items() if now - t > self.timeout_s]
                for p, _ in silent:
                    del self._last[p]
            for p, s in silent:
                if self.lost is None:
                    self.lost = (p, s)
                self._on_lost(p, s)
            self._stop.wait(tick)
        for r in pending:  # the peer receives these in `drain`; nobody needs to wait for them here
            if not r.Test():
                r.Free()

    def drain(self, sent_to_me: np.ndarray, deadline: float) -> bool:
        """After `stop()` on every rank: receive the beats still addressed to this rank.

        `sent_to_me[r]` is how many beats rank r sent here (its `sent[me]`). Why: a beat that
        arrives after the receiving thread stopped would stay unmatched, and at MPI_Finalize UCX
        prints "unexpected tag-receive descriptor ... was not matched" for each one. False if
        some did not arrive by `deadline` (their receives are cancelled, never left posted).
        """
        comm = self.world.beats
        missing = np.maximum(sent_to_me - self.received, 0)
        sinks = np.zeros(int(missing.sum()), dtype=np.uint8)
        reqs: list[MPI.Request] = []
        for src, n in enumerate(missing.tolist()):
            for _ in range(n):
                reqs.append(comm.Irecv([sinks[len(reqs):len(reqs) + 1], MPI.BYTE], src, TAG_BEAT))
        while not MPI.Request.Testall(reqs):
            if time.monotonic() > deadline:
                for r in reqs:
                    if not r.Test():
                        r.Cancel()
                        r.Wait()
                return False
            time.sleep(0.001)
        self.received += missing
        return True
