"""Base class of worker-side role objects (actor, critic, rollout, reference, ...).

Why `__new__` sets the placement attributes: a subclass's `__init__` already needs to
know its rank (to build a model shard) and should not have to call `super().__init__`
with runtime arguments it knows nothing about. Several role objects may live in one
process (colocated groups); each knows its own group name and rank.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hpcrl.controller.dispatch import Collect, Dispatch, register


@dataclass(frozen=True)
class Placement:
    """Where a role object runs: its group, its rank there, and its process in the MPI world."""

    group: str = "local"
    group_rank: int = 0
    group_size: int = 1
    mpi_rank: int = 0
    worker_rank: int = 0  # rank in the workers' torch.distributed world
    local_rank: int = 0  # index among workers on this host: the device index on GPUs
    host: str = ""
    coords: tuple[int, int, int] | None = None  # (dp, tp, pp) when the controller gave a layout


_creating: Placement | None = None


@contextmanager
def creating(placement: Placement) -> Iterator[None]:
    """Make `placement` visible to `Worker.__new__` while the runtime constructs one object."""
    global _creating
    _creating = placement
    try:
        yield
    finally:
        _creating = None


class Worker:
    """Subclass this for every role; decorate methods with `@register(dispatch=..., collect=...)`.

    Attributes set before `__init__` runs: `group`, `group_rank`, `group_size`, `mpi_rank`,
    `worker_rank`, `local_rank`, `host`, `coords` (this rank's (dp, tp, pp) if the group
    was given a ParallelLayout, else None). Constructed outside the runtime (e.g. in a unit
    test), the object sits alone at rank 0 of a group of 1.
    """

    group: str
    group_rank: int
    group_size: int
    mpi_rank: int
    worker_rank: int
    local_rank: int
    host: str
    coords: tuple[int, int, int] | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:
        obj = super().__new__(cls)
        placement = _creating or Placement(host=socket.gethostname())
        for name in Placement.__dataclass_fields__:
            setattr(obj, name, getattr(placement, name))
        return obj

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def parallel_coords(self) -> tuple[int, int, int]:
        """(dp_rank, tp_rank, pp_rank) of this object: the group's layout if it was given one,
        else pure data parallel.

        Megatron-based roles return parallel_state's ranks here, so DP dispatch follows the
        layout the model actually built.
        """
        return self.coords if self.coords is not None else (self.group_rank, 0, 0)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def process_info(self) -> dict[str, Any]:
        """Where this object lives (for logs, tests and placement checks)."""
        return {
            "group": self.group,
            "group_rank": self.group_rank,
            "mpi_rank": self.mpi_rank,
            "worker_rank": self.worker_rank,
            "local_rank": self.local_rank,
            "host": self.host,
            "node": os.environ.get("SLURMD_NODENAME", ""),
            "pid": os.getpid(),
        }

    def close(self) -> None:
        """Release resources at clean shutdown (called once per object, newest object first)."""
