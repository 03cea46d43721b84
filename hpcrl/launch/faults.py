"""Fault injection for the fault tests: a worker SIGKILLs itself at a chosen call of a chosen method.

    HPCRL_FAULT="RESTART:RANK:METHOD:N[,...]"   e.g. "0:2:update_actor:2,1:3:generate_shard:5"

MPI rank RANK, in the job's Slurm restart RESTART (SLURM_RESTART_COUNT, 0 off Slurm), sends itself
SIGKILL when its N-th call of a worker method named METHOD begins: on a worker rank as it starts to
run the call, on the controller (rank 0) as it starts to send it to a group. Why a self-inflicted
kill: a test that kills from outside at "some moment" cannot say whether the rank died in the
rollout or in the update, nor, for the controller, whether the run was still going (a step of the
tiny model takes under a second); this kills at a known point, and what the rest of the job sees is
exactly a kill -9 from outside (no cleanup, no message, no exit handler). The restart field keeps a
requeued job from dying again at the same place.

Unset (the normal case), `maybe_kill_self` costs one dictionary lookup per call.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

FAULT_ENV = "HPCRL_FAULT"


@dataclass(frozen=True)
class Fault:
    restart: int
    rank: int
    method: str
    call: int


def parse_faults(spec: str) -> list[Fault]:
    """`RESTART:RANK:METHOD:N[,...]` -> faults; ValueError naming the bad item."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        try:
            restart, rank, method, call = parts
            fault = Fault(int(restart), int(rank), method, int(call))
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: {item!r} is not RESTART:RANK:METHOD:N (e.g. 0:2:update_actor:2)") from None
        if fault.call < 1 or not method:
            raise ValueError(f"{FAULT_ENV}: {item!r}: N counts calls from 1 and METHOD is a name")
        faults.append(fault)
    return faults


class FaultInjector:
    """The faults of this rank in this restart, and its call counts."""

    def __init__(self, rank: int, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        self.rank = rank
        self.targets = {f.method: f.call for f in parse_faults(env.get(FAULT_ENV, ""))
                        if f.rank == rank and f.restart == restart}
        self.calls: dict[str, int] = {}

    def maybe_kill_self(self, method: str) -> None:
        if method not in self.targets:
            return
        n = self.calls[method] = self.calls.get(method, 0) + 1
        if n == self.targets[method]:
            from hpcrl.controller.stderr_log import terminal  # (a quiet terminal shows it too)

            # the test reads this line to time how fast the controller notices
            print(f"[hpcrl fault] rank {self.rank} pid {os.getpid()}: SIGKILL at call {n} of {method} "
                  f"(unix time {time.time():.3f})", file=terminal(err=True), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
