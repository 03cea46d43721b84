"""Split placement: the trainer roles on some workers, the rollout engines on the others.

    MPI rank 0          the controller
    workers 0..T-1      trainer side: actor (SplitActorRole), reference, critic, reward model;
                        torch.distributed world of T ranks (Megatron's TP x PP x DP, or the FSDP
                        engine's DP)
    workers T..T+R-1    rollout side: one vLLM engine each (RolloutRole); torch.distributed world
                        of R ranks (rollout TP groups of consecutive ranks, the rest rollout DP)

The runtime starts one torch.distributed world over all workers. `SideWorld`, built once on every
worker before any role, replaces it with one world per side, and opens the bridge: an MPI
communicator of trainer worker 0 and every rollout worker, over which the weights travel after
each update (hpcrl.engines.transfer); with rollout TP > 1 also one bridge per rollout TP rank
(trainer worker 0 and the rollout workers of that TP rank), which carry each rank its part only.
Neither side ever waits for the other's collectives, so the controller can run generation on one
side while the other trains (hpcrl.trainer.placement).
"""

from __future__ import annotations

from typing import Any

import torch

from hpcrl.controller import Collect, Dispatch, Worker, register
from hpcrl.engines.transfer import receive_from_trainer, send_to_rollout
from hpcrl.workers.actor_rollout import RolloutMethods, build_rollout_engine, read_rollout_arch
from hpcrl.workers.megatron_roles import MegatronRole
from hpcrl.workers.memory import peak_memory
from hpcrl.workers.role_engines import resolve_dtype

# this process's end of the bridge (None on trainer workers other than worker 0), and of the bridges
# per rollout TP rank: on worker 0 all of them (index r: worker 0 and the rollout workers of TP rank
# r), on a rollout worker its own TP rank's only
_bridge: Any = None
_tp_bridges: dict[int, Any] = {}


class SideWorld(Worker):
    """On every worker: leave the all-worker torch.distributed world for this side's own, and join
    the bridge if this worker is on it. Must be built before any other role."""

    def __init__(self, trainer_workers: int, rollout_tp: int = 1, timeout_s: float = 300.0):
        global _bridge
        from mpi4py import MPI

        from hpcrl.launch.rendezvous import destroy_torch_distributed, init_torch_distributed, process_group_over
        from hpcrl.launch.world import current_world

        world = current_world()
        w = world.worker_rank
        self.side = "trainer" if w < trainer_workers else "rollout"
        side_comm = world.workers.Split(0 if self.side == "trainer" else 1, w)
        on_bridge = w == 0 or self.side == "rollout"
        bridge = world.workers.Split(0 if on_bridge else MPI.UNDEFINED, w)
        # vLLM's TP groups are consecutive rollout ranks: rollout worker j has TP rank j % rollout_tp
        tp_rank = (w - trainer_workers) % rollout_tp if self.side == "rollout" else None
        destroy_torch_distributed()
        init_torch_distributed(world, timeout_s=timeout_s, comm=side_comm)
        _bridge = bridge if on_bridge else None
        # the weights travel over torch.distributed groups beside the two worlds (NCCL between the
        # GPUs, gloo on CPU), one per rollout TP rank; the small headers over the MPI bridge
        _tp_bridges.clear()
        for r in range(rollout_tp):
            member = on_bridge and (w == 0 or tp_rank == r)
            comm = world.workers.Split(0 if member else MPI.UNDEFINED, w)
            if member:
                _tp_bridges[r] = process_group_over(comm, world, timeout_s)
                comm.Free()

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def side_of(self) -> tuple[str, int, int]:
        """(side, rank in the side's torch world, its size) of this worker."""
        import torch.distributed as dist

        return (self.side, dist.get_rank(), dist.get_world_size())


class SplitActorRole(MegatronRole):
    """The actor of the split placement (either engine, actor.engine): it trains, and sends its weights
    to the engines."""

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def send_weights(self, bucket_mb: float | None = None, pools: list[dict[str, Any]] | None = None,
                     gone: list[str] | None = None) -> dict[str, Any]:
        """The trainer's current weights to every rollout worker (with RolloutRole.receive_weights,
        called on the other side at the same time), and to the rollout pool workers `pools` (the
        controller's specs, hpcrl.pools.weights; `gone`: pool workers whose links to drop first);
        trainer rank 0's statistics, with what reached which pool worker."""
        from hpcrl.pools.weights import PoolSender, forget_links

        mb = self.cfg["rollout"]["weight_bucket_mb"] if bucket_mb is None else bucket_mb
        tp_bridges = [_tp_bridges[r] for r in sorted(_tp_bridges)] if _bridge is not None else []
        sender = None
        if _bridge is not None:  # trainer worker 0
            forget_links(gone or [])
            sender = PoolSender(pools or []) if pools else None
        stats = send_to_rollout(self.engine, _bridge, tp_bridges, int(mb * (1 << 20)), sender).as_dict()
        return {**stats, **(sender.finish() if sender is not None else {})}


class RolloutRole(RolloutMethods, Worker):
    """A vLLM engine alone on its worker (the split placement's rollout side). It keeps its weights
    and KV cache between steps: nobody else uses its device."""

    def __init__(self, cfg: dict[str, Any]):
        path = cfg["model"]["path"]
        dtype: torch.dtype = resolve_dtype(cfg["model"]["dtype"])
        self.rollout = build_rollout_engine(cfg, path, read_rollout_arch(cfg, path), dtype)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def receive_weights(self) -> dict[str, Any]:
        """Load the weights trainer rank 0 sends (SplitActorRole.send_weights); this rank's statistics."""
        return receive_from_trainer(self.rollout, _bridge, _tp_bridges[self.rollout.tp_rank]).as_dict()

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def peak_memory(self, reset: bool = True) -> dict[str, float]:
        """This worker process's peak memory (GB) since the last call: hpcrl.workers.memory."""
        return peak_memory(reset)
