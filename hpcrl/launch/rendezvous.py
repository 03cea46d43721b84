"""torch.distributed among the worker ranks, with the rendezvous address carried over MPI.

Why over MPI: the workers already share an MPI communicator, so there is no need for a
file system, a hostname convention or an etcd; worker-rank 0 opens a free port and tells
the others. The controller never joins this process group: it only drives calls.
The standard env variables are set too, because libraries started later inside the
workers (vLLM's external_launcher, Megatron) read them.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from mpi4py import MPI

from hpcrl.launch.world import World


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _routable_address(my_host: str, other_hosts: set[str]) -> str:
    """The address other hosts can reach worker-rank 0 at (loopback when all share a host)."""
    override = os.environ.get("HPCRL_MASTER_ADDR")
    if override:
        return override
    if not other_hosts - {my_host}:
        return "127.0.0.1"
    addr = socket.gethostbyname(my_host)
    if addr.startswith("127."):
        # Debian maps the hostname to 127.0.1.1; ask the kernel which interface routes to a peer.
        peer = socket.gethostbyname(sorted(other_hosts - {my_host})[0])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            addr = s.getsockname()[0]
    return addr


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_torch_distributed(
    world: World,
    backend: str | None = None,
    timeout_s: float = 300.0,
    comm: MPI.Intracomm | None = None,
) -> str:
    """Initialise the default torch.distributed group over `comm` (default: all workers).

    Returns the backend used. The device is the local rank (modulo visible devices, so a
    launcher that gives each task one GPU also works).
    """
    import torch
    import torch.distributed as dist

    comm = comm if comm is not None else world.workers
    if comm is None:
        raise RuntimeError("the controller does not join torch.distributed")
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(world.info(world.rank).host)
    addr_port = None
    if rank == 0:
        addr_port = (_routable_address(hosts[0], set(hosts)), _free_port())
    addr, port = comm.bcast(addr_port, root=0)
    os.environ.update(
        MASTER_ADDR=str(addr),
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(world.local_rank),
        LOCAL_WORLD_SIZE=str(world.local_size),
    )
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return backend


def process_group_over(comm: MPI.Intracomm, world: World, timeout_s: float = 300.0) -> Any:
    """A torch.distributed process group of the ranks of an MPI communicator, beside the default
    world (which it neither needs nor joins): NCCL on GPU, gloo on CPU, rank = the rank in `comm`.
    Its collectives are called on the object (`group.broadcast(tensor, root)`)."""
    import torch
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(world.info(world.rank).host)
    addr_port = (_routable_address(hosts[0], set(hosts)), _free_port()) if rank == 0 else None
    addr, port = comm.bcast(addr_port, root=0)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(str(addr), int(port), size, rank == 0, timeout=timeout)
    if default_backend() == "nccl":
        torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def destroy_torch_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
