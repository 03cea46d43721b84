"""A model's shape from its HuggingFace config.json, and how many parameters each layout puts on one
device: Megatron's TP x PP shard of a pipeline stage, and vLLM's rollout-TP shard.

Counts follow the layers hpcrl builds (hpcrl.engines.megatron.model: Llama/Qwen2 decoders with
RMSNorm, grouped-query attention, a gated SiLU MLP, no biases except Qwen2's q/k/v biases) and how
Megatron-core and vLLM split them; docs/planner.md derives each one.
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
    """What the memory arithmetic needs of a Llama/Qwen2-family decoder."""

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

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v and output projections, the gated MLP (gate, up,
        down), two RMSNorm weights, and Qwen2's q/k/v biases."""
        h = self.hidden_size
        attention = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return attention + bias + 3 * h * self.intermediate_size + 2 * h

    def total_params(self) -> int:
        """Parameters of the HF model: embedding, layers, final norm, LM head unless tied."""
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embedding
        return embedding + self.num_layers * self.layer_params() + self.hidden_size + head

    def describe(self) -> str:
        tie = "tied" if self.tie_word_embeddings else "untied"
        return (f"{self.architecture}: {self.total_params() / 1e9:.2f} B parameters; {self.num_layers} layers, "
                f"hidden {self.hidden_size}, {self.num_heads} heads / {self.num_kv_heads} KV heads "
                f"(head dim {self.head_dim}), FFN {self.intermediate_size}, vocab {self.vocab_size}, {tie} embeddings")


def shape_from_hf_config(hf: dict[str, Any], source: str) -> ModelShape:
    """ModelShape from a parsed config.json; ModelConfigError naming a missing key."""
    missing = [k for k in REQUIRED_KEYS if not isinstance(hf.get(k), int) or hf[k] < 1]
    if missing:
        raise ModelConfigError(f"{source}: lacks {', '.join(missing)} (a positive integer each); hpcrl plan reads "
                               "the shape of a Llama/Qwen2-family config.json")
    heads = hf["num_attention_heads"]
    arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
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
    )


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


def megatron_shard_params(shape: ModelShape, tp: int, pp: int, stage: int, head: str = "lm") -> int:
    """Parameters one GPU of pipeline stage `stage` holds in a TP x PP Megatron layout.

    Linear weights (and q/k/v biases) are split over TP; RMSNorm weights are replicated on every
    TP rank. Stage 0 holds the (vocabulary-parallel) embedding, the last stage the final norm and
    the head: the LM head (with tied embeddings Megatron keeps a copy of the embedding there when
    PP > 1, and shares the one weight when PP = 1) or a critic's value head (hidden + 1 weights,
    replicated: hpcrl.engines.megatron.engine.ValueHead)."""
    h = shape.hidden_size
    per_layer_split = shape.layer_params() - 2 * h
    per_layer = per_layer_split // tp + 2 * h
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
    replicated past their number), norms replicated, embedding and LM head padded and split.
    `separate_lm_head`: a tied LM head counted again (vLLM on CPU keeps its own packed copy,
    hpcrl.engines.reshard)."""
    h = shape.hidden_size
    kv_dim = vllm_kv_heads_per_rank(shape, rollout_tp) * shape.head_dim
    q_dim = shape.q_dim // rollout_tp
    bias = (q_dim + 2 * kv_dim) if shape.qkv_bias else 0
    per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + bias + 3 * h * shape.intermediate_size // rollout_tp + 2 * h
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
