"""A model's shape from its HuggingFace config.json, and how many parameters each layout puts on one
device: Megatron's TP x PP (x EP) shard of a pipeline stage, and vLLM's rollout-TP shard.

Counts follow the layers hpcrl builds (hpcrl.engines.megatron.model: Llama/Qwen2/Qwen3 decoders with
RMSNorm, grouped-query attention, a gated SiLU MLP, no biases except Qwen2's q/k/v biases; Qwen3's
per-head q/k RMSNorm; Qwen3-MoE's experts in place of the MLP) and how Megatron-core and vLLM split
them; docs/planner.md derives each one. What the experts add to the plan is in `moe.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the keys the plan cannot do without (the rest have Llama defaults)
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# vLLM pads its vocabulary-parallel embedding and LM head to a multiple of this (its
# DEFAULT_VOCAB_PADDING_SIZE) before splitting them over the rollout TP ranks
VLLM_VOCAB_PADDING = 64


class ModelConfigError(ValueError):
    """The model's config.json is missing, unreadable or lacks a shape key."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory arithmetic needs of a Llama/Qwen2/Qwen3-family decoder (Qwen3-MoE: with experts)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    architecture: str
    source: str  # the config.json it was read from
    # Mixture of experts (0 experts: dense): every layer's MLP is num_experts gated experts of
    # moe_intermediate_size each and a router, num_experts_per_tok of them a token (Qwen3-MoE)
    num_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    qk_norm: bool = False  # Qwen3: an RMSNorm of head_dim weights over each head's queries, one over its keys

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def split_layer_params(self) -> int:
        """Parameters of one decoder layer that Megatron splits over TP: the q/k/v and output
        projections (with Qwen2's q/k/v biases) and a dense model's gated MLP (gate, up, down)."""
        h = self.hidden_size
        attention = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return attention + bias + (0 if self.is_moe else 3 * h * self.intermediate_size)

    def replicated_layer_params(self) -> int:
        """Parameters of one decoder layer that every TP rank holds whole: the two RMSNorm weights,
        Qwen3's q and k norms (head_dim each), and an MoE layer's router [num_experts, hidden]."""
        h = self.hidden_size
        return 2 * h + (2 * self.head_dim if self.qk_norm else 0) + self.num_experts * h

    def expert_params(self) -> int:
        """Parameters of one expert: gate and up [moe_intermediate, hidden] and down [hidden,
        moe_intermediate]; 0 for a dense model."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.is_moe else 0

    def expert_shard_layer_params(self, tp: int, ep: int) -> int:
        """Expert parameters of one layer on one rank: num_experts / EP experts, each split over TP
        (expert tensor parallel = TP) as a dense MLP is."""
        return (self.num_experts // ep) * (self.expert_params() // tp)

    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v and output projections, the gated MLP (gate, up,
        down) or every expert and the router, two RMSNorm weights, Qwen2's q/k/v biases, Qwen3's q/k
        norms."""
        return self.split_layer_params() + self.replicated_layer_params() + self.num_experts * self.expert_params()

    def total_params(self) -> int:
        """Parameters of the HF model: embedding, layers, final norm, LM head unless tied (every
        expert counted)."""
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embedding
        return embedding + self.num_layers * self.layer_params() + self.hidden_size + head

    def active_params(self) -> int:
        """Parameters one token goes through: the total less the experts the router does not pick
        (num_experts - num_experts_per_tok of every layer); the total for a dense model."""
        idle = self.num_experts - self.num_experts_per_tok if self.is_moe else 0
        return self.total_params() - self.num_layers * idle * self.expert_params()

    def describe(self) -> str:
        tie = "tied" if self.tie_word_embeddings else "untied"
        params = (f"MoE: {self.num_experts} experts, top-{self.num_experts_per_tok}, {self.total_params() / 1e9:.2f} B "
                  f"total / {self.active_params() / 1e9:.2f} B active" if self.is_moe
                  else f"{self.total_params() / 1e9:.2f} B parameters")
        ffn = f"expert FFN {self.moe_intermediate_size}" if self.is_moe else f"FFN {self.intermediate_size}"
        return (f"{self.architecture}: {params}; {self.num_layers} layers, "
                f"hidden {self.hidden_size}, {self.num_heads} heads / {self.num_kv_heads} KV heads "
                f"(head dim {self.head_dim}{', q/k norm' if self.qk_norm else ''}), {ffn}, vocab {self.vocab_size}, "
                f"{tie} embeddings")


def shape_from_hf_config(hf: dict[str, Any], source: str) -> ModelShape:
    """ModelShape from a parsed config.json; ModelConfigError naming a missing key."""
    missing = [k for k in REQUIRED_KEYS if not isinstance(hf.get(k), int) or hf[k] < 1]
    if missing:
        raise ModelConfigError(f"{source}: lacks {', '.join(missing)} (a positive integer each); hpcrl plan reads "
                               "the shape of a Llama/Qwen2/Qwen3-family config.json")
    heads = hf["num_attention_heads"]
    arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
    experts = _moe_keys(hf, source)
    return ModelShape(
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # as hpcrl.engines.megatron.model.read_arch: Qwen2 always has q/k/v biases
        qkv_bias=str(arch).startswith("Qwen2") or hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias")),
        max_position_embeddings=hf.get("max_position_embeddings") or 4096,
        architecture=str(arch),
        source=source,
        num_experts=experts[0],
        moe_intermediate_size=experts[1],
        num_experts_per_tok=experts[2],
        # as hpcrl.engines.megatron.model.read_arch: Qwen3 (dense and MoE) normalises each head's q and k
        qk_norm=str(arch).startswith("Qwen3") or hf.get("model_type") in ("qwen3", "qwen3_moe"),
    )


def _moe_keys(hf: dict[str, Any], source: str) -> tuple[int, int, int]:
    """(num_experts, moe_intermediate_size, num_experts_per_tok) of a config.json; zeros for a dense
    model (no num_experts, or 0; transformers 5 writes num_local_experts). ModelConfigError for what
    hpcrl does not build: MoE on some layers only (mlp_only_layers, decoder_sparse_step), shared
    experts (hpcrl.engines.megatron.model)."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if not isinstance(experts, int) or experts < 0:
        raise ModelConfigError(f"{source}: num_experts={experts!r} is not a whole number >= 0")
    if not experts:
        return 0, 0, 0
    bad = [k for k in ("moe_intermediate_size", "num_experts_per_tok") if not isinstance(hf.get(k), int) or hf[k] < 1]
    if bad:
        raise ModelConfigError(f"{source}: num_experts={experts} but lacks {', '.join(bad)} (a positive integer each)")
    if hf["num_experts_per_tok"] > experts:
        raise ModelConfigError(f"{source}: num_experts_per_tok={hf['num_experts_per_tok']} > num_experts={experts}")
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step") or 1) != 1:
        raise ModelConfigError(f"{source}: MoE on some layers only (mlp_only_layers={hf.get('mlp_only_layers')}, "
                               f"decoder_sparse_step={hf.get('decoder_sparse_step')}); hpcrl builds models whose every "
                               "layer is MoE")
    if hf.get("shared_expert_intermediate_size"):
        raise ModelConfigError(f"{source}: shared experts (shared_expert_intermediate_size) are not supported")
    return experts, hf["moe_intermediate_size"], hf["num_experts_per_tok"]


def read_model_shape(path: str | Path) -> ModelShape:
    """The shape in `path` (a config.json, or a model folder holding one)."""
    p = Path(path)
    if p.is_dir() or p.suffix != ".json":  # a model folder (here or not)
        p = p / "config.json"
    try:
        with open(p) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ModelConfigError(f"{p}: no such file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{p}: unreadable: {e}") from None
    if not isinstance(hf, dict):
        raise ModelConfigError(f"{p}: not a JSON object")
    return shape_from_hf_config(hf, str(p))


def megatron_padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron splits the vocabulary evenly over TP, padding it as Megatron-LM does
    (hpcrl.engines.megatron.model.padded_vocab_size)."""
    step = multiple * tp
    return ((vocab + step - 1) // step) * step if vocab % tp else vocab


def megatron_shard_params(shape: ModelShape, tp: int, pp: int, stage: int, head: str = "lm", ep: int = 1) -> int:
    """Parameters one GPU of pipeline stage `stage` holds in a TP x PP Megatron layout (with expert
    parallel `ep` for an MoE model).

    Linear weights (and q/k/v biases) are split over TP; RMSNorm weights (and Qwen3's q/k norms, an
    MoE router) are replicated on every TP rank; an MoE layer's experts are split over EP (whole
    experts) and each over TP (`ModelShape.expert_shard_layer_params`). Stage 0 holds the
    (vocabulary-parallel) embedding, the last stage the final norm and the head: the LM head (with
    tied embeddings Megatron keeps a copy of the embedding there when PP > 1, and shares the one
    weight when PP = 1) or a critic's value head (hidden + 1 weights, replicated:
    hpcrl.engines.megatron.engine.ValueHead)."""
    h = shape.hidden_size
    per_layer = (shape.split_layer_params() // tp + shape.replicated_layer_params()
                 + shape.expert_shard_layer_params(tp, ep))
    n = (shape.num_layers // pp) * per_layer
    vocab_shard = megatron_padded_vocab(shape.vocab_size, tp) // tp * h
    if stage == 0:
        n += vocab_shard
    if stage == pp - 1:
        n += h
        if head == "value":
            n += h + 1
        elif not shape.tie_word_embeddings or pp > 1:
            n += vocab_shard
    return n


def vllm_kv_heads_per_rank(shape: ModelShape, rollout_tp: int) -> int:
    """KV heads one rollout rank holds: vLLM splits them over TP, and replicates them when TP
    exceeds their number (one per rank then)."""
    return shape.num_kv_heads // rollout_tp if shape.num_kv_heads >= rollout_tp else 1


def vllm_shard_params(shape: ModelShape, rollout_tp: int, separate_lm_head: bool) -> int:
    """Parameters one rollout rank holds in vLLM: linear layers split over the rollout TP (KV heads
    replicated past their number), norms (and Qwen3's q/k norms, an MoE router) replicated, every
    expert split over the rollout TP (vLLM's FusedMoE without expert parallel), embedding and LM head
    padded and split. `separate_lm_head`: a tied LM head counted again (vLLM on CPU keeps its own
    packed copy, hpcrl.engines.reshard)."""
    h = shape.hidden_size
    kv_dim = vllm_kv_heads_per_rank(shape, rollout_tp) * shape.head_dim
    q_dim = shape.q_dim // rollout_tp
    bias = (q_dim + 2 * kv_dim) if shape.qkv_bias else 0
    mlp = (shape.expert_shard_layer_params(rollout_tp, 1) if shape.is_moe
           else 3 * h * shape.intermediate_size // rollout_tp)
    per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + bias + mlp + shape.replicated_layer_params()
    heads = 1 if shape.tie_word_embeddings and not separate_lm_head else 2
    return shape.num_layers * per_layer + h + heads * vllm_vocab_shard_params(shape, rollout_tp)


def vllm_vocab_shard_params(shape: ModelShape, rollout_tp: int) -> int:
    """Parameters of one rollout rank's embedding (or LM head) shard: the vocabulary padded, then
    split over the rollout TP."""
    vocab = math.ceil(shape.vocab_size / VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    return math.ceil(vocab / rollout_tp) * shape.hidden_size


def largest_reshard_unit_params(shape: ModelShape) -> int:
    """The largest conversion unit the reshard moves whole (hpcrl.engines.reshard): the embedding,
    one decoder layer, or the final norm with the LM head."""
    embedding = shape.vocab_size * shape.hidden_size
    return max(embedding, shape.layer_params(), shape.hidden_size + embedding)
