"""A Megatron role's bytes on one worker: the per-role terms memory.py adds up phase by phase
(fsdp.py is the FSDP engine's counterpart, `FsdpRole`, with the same interface).

- `MegatronRoleShard` / `megatron_role_shard`: a role's parameters on one GPU of a pipeline stage
  (moe.py's expert shard apart), in the compute dtype, and when it trains the fp32 masters and main_grad buffers of a
  bf16 model or the per-step fp32 .grad of an fp32 one, and Adam's two moments (cut over DP with
  optim.shard_over_dp; the LoRA adapters only when set).
- `add_role`: a role's resident rows in a phase (either engine).
- `add_update`: the rows of a trained role's forward and backward in its update phase (either engine):
  for Megatron the activations kept for the backward under 1F1B, the MoE dispatch's share, the working
  set of one layer.
- `lora_shard_params`: the adapters' parameters on one GPU (hpcrl.engines.megatron.lora).

Arithmetic only (no torch). `run` is memory.py's `_Run` and `phase` its `Phase` (as in fsdp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcrl.config.derived import Layout
from hpcrl.plan import fsdp, moe
from hpcrl.plan.shape import ModelShape


@dataclass
class MegatronRoleShard:
    """One Megatron role's bytes on one GPU of one stage."""

    name: str
    params: int
    dtype_bytes: int
    trains: bool
    low_precision: bool  # bf16 weights: fp32 masters and fp32 main_grad buffers
    # parameters the optimizer steps when not all of them (LoRA: the adapters, held besides `params`)
    adapter_params: int | None = None
    # DP ranks the masters and Adam moments are cut over (optim.shard_over_dp; whole tensors, so a
    # rank may keep a little more than its even share)
    optim_shards: int = 1
    # an MoE model's experts on this GPU, their own rows, cut over the expert-DP ranks (moe.py)
    experts: MegatronRoleShard | None = None

    @property
    def trained(self) -> int:
        return self.params if self.adapter_params is None else self.adapter_params

    @property
    def weights(self) -> int:
        return (self.params + (self.adapter_params or 0)) * self.dtype_bytes

    @property
    def masters(self) -> int:
        return -(-self.trained // self.optim_shards) * 4 if self.trains and self.low_precision else 0

    @property
    def kept_grads(self) -> int:
        """fp32 main_grad buffers: allocated once, zeroed, never freed (engine._add_fp32_grad_buffers)."""
        return self.trained * 4 if self.trains and self.low_precision else 0

    @property
    def step_grads(self) -> int:
        """fp32 .grad of an fp32 model: built by the backward, dropped after each optimizer step."""
        return self.trained * 4 if self.trains and not self.low_precision else 0

    @property
    def adam(self) -> int:
        return -(-self.trained // self.optim_shards) * 8 if self.trains else 0

    @property
    def resident(self) -> int:
        experts = self.experts.resident if self.experts else 0
        return self.weights + self.masters + self.kept_grads + self.adam + experts

    @property
    def at_build(self) -> int:
        """What it holds once built, before the first optimizer step allocates Adam's moments."""
        return (self.weights + self.masters + self.kept_grads) + (self.experts.at_build if self.experts else 0)


def megatron_role_shard(name: str, shape: ModelShape, lay: Layout, stage: int, run: Any, trains: bool,
                        head: str = "lm", ep: int = 1, shard_over_dp: bool = False,
                        adapters: int | None = None) -> MegatronRoleShard:
    """A Megatron role's bytes on one GPU of `stage`: its parameters, and an MoE model's experts apart."""
    params, experts = moe.role_shard_params(shape, lay.tp, lay.pp, stage, head, ep)
    # as the engine: no ZeRO-1 with expert parallel (the EP ranks of one DP x CP group step other experts)
    shard_over_dp = shard_over_dp and ep == 1
    low = run.dtype_bytes < 4
    expert_shard = MegatronRoleShard(f"{name} expert", experts, run.dtype_bytes, trains and adapters is None, low,
                                     optim_shards=moe.expert_data_parallel(lay, ep) if shard_over_dp else 1)
    return MegatronRoleShard(name, params, run.dtype_bytes, trains, low, adapters,
                             optim_shards=max(lay.dp * lay.cp, 1) if shard_over_dp else 1,
                             experts=expert_shard if experts else None)


def add_role(phase: Any, role: MegatronRoleShard | fsdp.FsdpRole, dtype: str, offloaded: bool = False,
              with_step_grads: bool = False) -> None:
    """The role's resident rows: weights, and when it trains its gradients, masters and moments."""
    if isinstance(role, fsdp.FsdpRole):
        role.add_to(phase, with_step_grads)
        return
    if offloaded:
        return
    phase.add(f"{role.name} weights ({dtype})", role.weights)
    if role.trains:
        phase.add(f"{role.name} gradients (fp32 main_grad)", role.kept_grads)
        if with_step_grads:
            phase.add(f"{role.name} gradients (fp32 .grad)", role.step_grads)
        phase.add(f"{role.name} master weights (fp32)", role.masters)
        phase.add(f"{role.name} Adam moments (2 x fp32)", role.adam)
    if role.experts is not None:
        add_role(phase, role.experts, dtype, with_step_grads=with_step_grads)

def add_update(phase: Any, role: MegatronRoleShard | fsdp.FsdpRole, run: Any, shape: ModelShape, stage: int) -> int:
    """The rows of a trained role's forward and backward in its update phase; returns the
    micro-batches in flight on this stage (1F1B; 1 on the FSDP engine)."""
    if isinstance(role, fsdp.FsdpRole):
        role.add_update(phase, run)
        return 1
    kept, in_flight = run.stored_activations(role.name, shape, stage)
    routed = run.kept_dispatch(role.name, shape, in_flight)
    phase.add("activations kept for backward", kept - routed)
    phase.add(moe.DISPATCH_LABEL, routed)
    phase.add("working set of one layer", run.working(role.name, shape))
    return in_flight


def lora_shard_params(shape: ModelShape, rank: int, targets: tuple[str, ...], tp: int, pp: int) -> int:
    """LoRA adapter parameters on one GPU of a stage (hpcrl.engines.megatron.lora): per layer,
    column-parallel layers hold the whole A [r, in] and 1/TP of B, row-parallel ones 1/TP of A and
    the whole B [out, r]."""
    h, ffn = shape.hidden_size, shape.intermediate_size
    per_layer = {"linear_qkv": rank * h + (shape.q_dim + 2 * shape.kv_dim) // tp * rank,
                 "linear_fc1": rank * h + 2 * ffn // tp * rank,
                 "linear_proj": rank * (shape.q_dim // tp) + h * rank,
                 "linear_fc2": rank * (ffn // tp) + h * rank}
    return (shape.num_layers // pp) * sum(per_layer[t] for t in targets)
