"""Where the rollout engines run, as the RL loop sees it (trainer.placement).

    placement = make_placement(cfg)
    placement.actor            # the Megatron actor group: log-probs, updates, checkpoints
    placement.rollout          # the group `generate` runs on
    placement.trainer_ranks    # where the reference, critic and reward model go (None: every worker)
    placement.to_rollout(step) # the weights after `step` into the engines (returns what moved)
    placement.to_training()    # the engines give the devices back to the trainer

Colocated (the default): every worker holds an actor shard and a vLLM engine that take turns on its
device; `to_rollout` reshards in place (hpcrl.engines.reshard) and `to_training` puts the engine to
sleep. Split: the engines have workers of their own (hpcrl.workers.split), `to_rollout` sends the
weights across (hpcrl.engines.transfer), and nothing needs to sleep, so generation can run while
the trainer updates (hpcrl.trainer.ahead).
"""

from __future__ import annotations

import logging
from typing import Any

from hpcrl.config.derived import is_split, rollout_world_size
from hpcrl.controller import WorkerGroup

log = logging.getLogger("hpcrl.trainer")


class Colocated:
    """Trainer and engine on every worker, taking turns."""

    sync_phase = "reshard"  # the name of `to_rollout`'s time in the step metrics

    def __init__(self, cfg: dict[str, Any]):
        from hpcrl.workers.actor_rollout import ActorRolloutRole

        self.actor = WorkerGroup(ActorRolloutRole, init_kwargs={"cfg": cfg}, name="actor")
        self.rollout = self.actor
        self.trainer_ranks: list[int] | None = None

    def to_rollout(self, step: int) -> dict[str, float]:
        stats = self.actor.enter_rollout()
        return {"weights/received_mb_max": max(s["bytes_received"] for s in stats) / 1e6,
                "memory/heap_returned_gb_max": max(s["heap_returned_bytes"] for s in stats) / 1e9}

    def to_training(self) -> None:
        self.actor.enter_training()

    def peak_memory(self) -> tuple[list[dict[str, float]], list[int]]:
        """Every worker's peak memory since the last call, and their MPI ranks."""
        return self.actor.peak_memory(), self.actor.ranks

    def close(self) -> None:
        """The run's end: the workers exit after this, no engine follows (RolloutEngine.close)."""
        self.actor.close_rollout(final=True)


class Split:
    """The first workers train, the last trainer.rollout_workers generate."""

    sync_phase = "transfer"

    def __init__(self, cfg: dict[str, Any]):
        from hpcrl.workers.split import RolloutRole, SideWorld, SplitActorRole

        t = cfg["trainer"]
        workers = t["nnodes"] * t["workers_per_node"]
        rollout = rollout_world_size(cfg)
        self.trainer_ranks = list(range(1, workers - rollout + 1))
        self.rollout_ranks = list(range(workers - rollout + 1, workers + 1))
        # one torch.distributed world per side, and the bridge between them
        self.sides = WorkerGroup(SideWorld, init_kwargs={"trainer_workers": len(self.trainer_ranks),
                                                         "rollout_tp": int(cfg["rollout"]["tensor_parallel"]),
                                                         "timeout_s": float(t["timeout_s"])}, name="placement")
        self.actor = WorkerGroup(SplitActorRole, ranks=self.trainer_ranks, init_kwargs={"cfg": cfg}, name="actor")
        # no vLLM engine seeds the trainer's processes here: their Python and NumPy generators must not
        # stay at an OS-entropy start (the RNG files of a checkpoint would differ between identical runs)
        self.actor.seed_host_rngs(int(t["seed"]))
        self.rollout = WorkerGroup(RolloutRole, ranks=self.rollout_ranks, init_kwargs={"cfg": cfg}, name="rollout")
        # the step whose weights the engines run (None: the model file's, which after a resume are
        # not the trainer's)
        self.weights_step: int | None = None
        # rollout pools of other jobs (hpcrl.pools.registry; fully_async runs): they get the weights too
        self.pools: Any = None

    def to_rollout(self, step: int) -> dict[str, float]:
        """Send the trainer's weights (those after `step`) to every engine, unless they have them."""
        if self.weights_step == step:
            return {}
        targets, gone = self.pools.weight_targets(step) if self.pools is not None else ([], [])
        sending = self.actor.send_weights.future(pools=targets, gone=gone)
        received = self.rollout.receive_weights()
        sent = sending.result()
        self.weights_step = step
        out = {"weights/received_mb_max": max(r["bytes_received"] for r in received) / 1e6,
               "weights/sent_mb": sent["bytes_sent_as_root"] / 1e6,
               "weights/model_mb": received[0]["model_bytes"] / 1e6}
        if self.pools is not None:
            out.update(self.pools.weights_done(step, targets, sent))
        return out

    def to_training(self) -> None:
        """Nothing to give back: the engines keep their own workers."""

    def peak_memory(self) -> tuple[list[dict[str, float]], list[int]]:
        return self.actor.peak_memory() + self.rollout.peak_memory(), self.actor.ranks + self.rollout.ranks

    def close(self) -> None:
        """The run's end: the workers exit after this, no engine follows (RolloutEngine.close)."""
        self.rollout.close_rollout(final=True)


def make_placement(cfg: dict[str, Any]) -> Colocated | Split:
    """The placement of a resolved config (its plain-dict form, as it travels to the workers)."""
    return Split(cfg) if is_split(cfg) else Colocated(cfg)
