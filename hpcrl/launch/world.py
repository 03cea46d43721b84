"""The one MPI world of an hpcrl job: rank 0 is the controller, ranks 1..N are workers.

Why a single world: the controller must be able to reach every worker with raw-buffer
point-to-point messages and to abort the whole job with one call. Whether the world was
started by `mpiexec` (hydra) or by `srun --mpi=pmi2 --het-group=0,1` does not matter here;
this module only looks at MPI, never at the launcher.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import mpi4py

# Must be set before the first `from mpi4py import MPI`: the liveness thread talks MPI
# concurrently with the main thread.
mpi4py.rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402

CONTROLLER_RANK = 0


@dataclass(frozen=True)
class ProcessInfo:
    """Where one rank runs; used to name ranks in every error message."""

    rank: int
    host: str
    node: str
    pid: int

    def describe(self) -> str:
        where = self.host if self.node in ("", self.host) else f"{self.host}, slurm node {self.node}"
        return f"rank {self.rank} (host {where}, pid {self.pid})"


@dataclass
class World:
    """MPI communicators and placement of this process; built once by `init_world`.

    `control` carries calls and results, `beats` carries heartbeats only, so that a
    liveness message can never be matched by a data receive (and vice versa).
    """

    comm: MPI.Intracomm
    control: MPI.Intracomm
    beats: MPI.Intracomm
    rank: int
    size: int
    workers: MPI.Intracomm | None  # ranks 1..N only; None on the controller
    worker_rank: int  # -1 on the controller
    local_rank: int  # index among the workers on this host
    local_size: int
    processes: list[ProcessInfo]

    @property
    def is_controller(self) -> bool:
        return self.rank == CONTROLLER_RANK

    @property
    def num_workers(self) -> int:
        return self.size - 1

    def info(self, rank: int) -> ProcessInfo:
        return self.processes[rank]

    def describe(self, rank: int) -> str:
        return self.processes[rank].describe()


_WORLD: World | None = None


def _hostname() -> str:
    return socket.gethostname()


def _local_rank(workers: MPI.Intracomm, host: str) -> tuple[int, int]:
    """(index, count) of the workers on this host, in worker-rank order.

    Why host names and not MPI_COMM_TYPE_SHARED: the single-machine launch route starts
    every rank under its own hydra proxy (see hpcrl.launch.commands), so MPI sees one node
    per rank; the host name is what decides which device a rank may use.
    """
    hosts = workers.allgather(host)
    mine = [r for r, h in enumerate(hosts) if h == host]
    return mine.index(workers.Get_rank()), len(mine)


def init_world() -> World:
    """Create (once) the controller/worker split of COMM_WORLD.

    The local rank comes from the workers' host names, not from launcher variables, so it
    is right under mpiexec and srun alike.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    comm = MPI.COMM_WORLD
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("hpcrl needs MPI_THREAD_MULTIPLE (heartbeats run in a thread)")
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        raise RuntimeError(
            f"hpcrl needs at least 2 MPI ranks (1 controller + workers); this world has {size}. "
            "Start it with `mpiexec -n N+1 ...` or `srun --mpi=pmi2 --het-group=0,1 ...`."
        )
    me = ProcessInfo(rank, _hostname(), os.environ.get("SLURMD_NODENAME", ""), os.getpid())
    processes = [ProcessInfo(*p) for p in comm.allgather((me.rank, me.host, me.node, me.pid))]
    control = comm.Dup()
    beats = comm.Dup()
    is_worker = rank != CONTROLLER_RANK
    workers = comm.Split(1 if is_worker else MPI.UNDEFINED, rank)
    if is_worker:
        worker_rank = workers.Get_rank()
        local_rank, local_size = _local_rank(workers, me.host)
    else:
        workers = None
        local_rank, local_size, worker_rank = 0, 1, -1
    _WORLD = World(
        comm=comm,
        control=control,
        beats=beats,
        rank=rank,
        size=size,
        workers=workers,
        worker_rank=worker_rank,
        local_rank=local_rank,
        local_size=local_size,
        processes=processes,
    )
    return _WORLD


def current_world() -> World:
    """The world created by `init_world`; raises if the runtime is not running."""
    if _WORLD is None:
        raise RuntimeError("the hpcrl MPI world is not initialised (call init_world or run under hpcrl)")
    return _WORLD


def abort(code: int = 1) -> None:
    """End every rank of the job now; the launcher (hydra or srun) then exits non-zero."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    capture = sys.modules.get("hpcrl.controller.stderr_log")  # loaded if this rank's output is captured
    if capture is not None:
        capture.flush_terminal()  # hpcrl's error lines, on their way to a quiet terminal
    MPI.COMM_WORLD.Abort(code)
