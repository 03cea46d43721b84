"""Single-controller runtime: MPI rank 0 runs the algorithm and drives SPMD worker groups.

Controller program::

    from hpcrl.controller import Batch, WorkerGroup, run

    def main():
        actor = WorkerGroup(ActorWorker, init_kwargs={"lr": 1e-6})
        out = actor.compute_logprob(batch)             # blocks, returns the collected result
        fut = actor.compute_logprob.future(batch)      # or compute_logprob(batch, blocking=False)
        out = fut.result()

    if __name__ == "__main__":
        run(main)

Worker side::

    class ActorWorker(Worker):
        @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
        def compute_logprob(self, batch: Batch) -> Batch: ...

See docs/controller.md for launch routes and failure semantics.
"""

from __future__ import annotations

import importlib
from typing import Any

from hpcrl.controller.batch import Batch
from hpcrl.controller.dispatch import Collect, Dispatch, ParallelLayout, register
from hpcrl.controller.errors import (
    CallTimeout,
    HpcrlRuntimeError,
    RankFailure,
    RemoteError,
    RemoteFailure,
    WorkerDiedError,
    WorkerLostError,
)
from hpcrl.controller.worker import Placement, Worker

# These import mpi4py.MPI, which initialises MPI; loaded on first use so that a plain
# process can use Batch or the dispatch helpers without starting MPI.
_LAZY = {
    "RuntimeOptions": "hpcrl.controller.app",
    "run": "hpcrl.controller.app",
    "shutdown": "hpcrl.controller.app",
    "BoundMethod": "hpcrl.controller.group",
    "WorkerGroup": "hpcrl.controller.group",
    "Future": "hpcrl.controller.runtime",
    "get_runtime": "hpcrl.controller.runtime",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpcrl.controller' has no attribute {name!r}")


__all__ = [
    "Batch",
    "CallTimeout",
    "Collect",
    "Dispatch",
    "HpcrlRuntimeError",
    "ParallelLayout",
    "Placement",
    "RankFailure",
    "RemoteError",
    "RemoteFailure",
    "Worker",
    "WorkerDiedError",
    "WorkerLostError",
    "register",
    *_LAZY,
]
