"""The token and activation arithmetic of the memory plan: how many tokens one micro-batch holds,
what one decoder layer keeps for its backward and holds while it runs (Megatron's trainer roles), and
vLLM's side of it (the activation reserve of one scheduler step, the CPU KV cache's default size).

What feeds what:

- `plan_device`, `plan_dtype`: the device and dtype a config is planned for (trainer.device,
  model.dtype); memory.py's plan and report.py's command use them too.
- `sequence_tokens` (the longest sequence, vLLM's max_model_len) -> `micro_batch_token_count` (one
  micro-batch's row, packed or padded, for CP and TP) -> `micro_batches_per_minibatch` (what a DP rank
  runs a mini-batch in: memory.py caps the micro-batches in flight under 1F1B with it).
- per token of one layer, in elements: `norm_region_elements_per_token`,
  `attention_elements_per_token`, `mlp_elements_per_token` (an MoE layer's are
  `moe.kept_elements_per_token`), summed by `stored_activation_elements_per_token`;
  `working_elements_per_token` (alive inside one layer's forward or backward); the attention kernel's
  own state, `core_attention_bytes` (`dense_attention_elements` for the dense CPU attention).
- `layer_activations`: those terms over the tokens of one rank, in bytes, region by region
  (`LayerActivations`, whose `kept` applies actor.recompute / critic.recompute: `RECOMPUTE_MODES`)
  -> `kept_activation_bytes`: a pipeline stage's micro-batches in flight over its layers, the
  "activations kept for backward" of memory.py's update phases.
- `role_layer_activations`: `layer_activations` of one role of a validated config, as the plan
  counts them (re-exported by hpcrl.plan; tests/test_plan.py checks it).
- `logits_bytes`: the log-prob logits of the last pipeline stage (forward and update phases).
- vLLM: `vllm_batch_limits` (max_num_batched_tokens, max_num_seqs) -> `vllm_activation_bytes` (its
  activation reserve, kept out of the KV cache); `cpu_kv_cache_bytes_default` (the KV cache of a CPU
  run with rollout.cpu_kv_cache_gib=null). memory.py's rollout phase and KV cache use them.

memory.py turns these into the terms of each phase (its `_Run` resolves the tokens and layouts of a
config once); moe.py adds an MoE layer's dispatcher and experts. The plan's units, GIB and GB, are
defined here (the lowest module that needs them). Arithmetic only, no torch nor vLLM; the formulas
and their sources are in docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from hpcrl.config import role_layouts
from hpcrl.config.derived import Layout, cp_padded_length, rollout_world_size
from hpcrl.plan import moe
from hpcrl.plan.shape import ModelShape

GIB = 1 << 30
GB = 10**9
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
    """model.dtype, with auto resolved as hpcrl.workers.role_engines.resolve_dtype does."""
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
