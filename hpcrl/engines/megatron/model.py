"""Build a megatron-core GPTModel from a HuggingFace config (Llama, Qwen2, Qwen3 and Qwen3-MoE families).

The HF config is read once into `ModelArch`; everything downstream (layer specs, weight
conversion, the rollout engine's name map) works from that one record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hpcrl.engines.megatron.architectures import SUPPORTED

if TYPE_CHECKING:
    from hpcrl.engines.megatron.moe import MoeSettings


@dataclass(frozen=True)
class ModelArch:
    """The shape of a Llama/Qwen2/Qwen3-family decoder, as megatron needs it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    # Llama-3.1-style frequency scaling of RoPE (factor), or None
    rope_llama3_factor: float | None = None
    # Qwen3: an RMSNorm over each head's queries and keys before RoPE (megatron's qk_layernorm)
    qk_norm: bool = False
    # Mixture of experts (Qwen3-MoE; 0: dense): every layer's MLP is num_experts experts of
    # moe_ffn_hidden_size each, top moe_topk per token, weights renormalised over the top k when
    # norm_topk_prob (softmax over the top-k logits, megatron's default) or not (softmax over all)
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def num_experts(hf: dict[str, Any]) -> int:
    """Experts per MoE layer of a parsed config.json (0: dense). The Hub's Qwen3-MoE configs say
    num_experts; transformers 5 writes num_local_experts."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def read_arch(model_path: str | Path) -> ModelArch:
    """Read config.json of a local HF folder; refuse families hpcrl does not convert."""
    with open(Path(model_path) / "config.json") as f:
        hf: dict[str, Any] = json.load(f)
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED:
        raise ValueError(f"{model_path}: architecture {arch!r} is not supported; hpcrl converts "
                         f"{', '.join(sorted(SUPPORTED))}.")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{model_path}: RoPE type {rope_type!r} is not supported (default, llama3).")
    heads = hf["num_attention_heads"]
    family = SUPPORTED[arch]
    experts = num_experts(hf) if family == "qwen3_moe" else 0
    if experts:
        dense_layers = list(hf.get("mlp_only_layers") or [])
        if dense_layers or int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(f"{model_path}: MoE layers on some layers only (mlp_only_layers={dense_layers}, "
                             f"decoder_sparse_step={hf.get('decoder_sparse_step')}); hpcrl converts models whose "
                             "every layer is MoE")
        if int(hf.get("shared_expert_intermediate_size") or 0):
            raise ValueError(f"{model_path}: shared experts are not supported")
    return ModelArch(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        rope_llama3_factor=float(rope["factor"]) if rope_type == "llama3" else None,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        num_experts=experts,
        moe_ffn_hidden_size=int(hf.get("moe_intermediate_size") or 0) if experts else 0,
        moe_topk=int(hf.get("num_experts_per_tok") or 0) if experts else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
    )


def padded_vocab_size(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron splits the vocabulary evenly over TP; pad like Megatron-LM does."""
    step = multiple * tp
    return ((vocab + step - 1) // step) * step if vocab % tp else vocab


def transformer_engine_available() -> bool:
    """TE only counts on a CUDA machine; a broken TE install must not break the CPU path."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or an OSError from a missing cuDNN
        return False
    return True


RECOMPUTE = ("none", "selective", "full")


def recompute_settings(recompute: str) -> dict[str, Any]:
    """megatron's activation-recompute settings for hpcrl's `recompute` key.

    selective: the core attention (its [heads, T, T]-sized intermediates) is recomputed in the backward
    from its q, k, v; full: each transformer layer keeps only its input and is run again in the
    backward (megatron's granularity full, method uniform, one layer per checkpoint)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: one of {', '.join(RECOMPUTE)}")
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def transformer_config(arch: ModelArch, tp: int, pp: int, dtype: torch.dtype, on_gpu: bool, cp: int = 1,
                       sequence_parallel: bool = False, recompute: str = "none", ep: int = 1,
                       moe: MoeSettings | None = None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hpcrl.engines.megatron.moe import moe_config_kwargs

    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # weights come from the checkpoint; random init would only cost time
        perform_initialization=False,
        use_cpu_initialization=not on_gpu,
        # the fused kernels and overlaps below exist only on CUDA
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # the loss function returns (sum, tokens, ...) with the global normalisation already applied
        calculate_per_token_loss=True,
        variable_seq_lengths=False,
        qk_layernorm=arch.qk_norm,
        **recompute_settings(recompute),
        **moe_config_kwargs(arch, moe, tp, ep),
    )


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """RMSNorm for megatron's local spec under sequence parallelism (its own torch-norm wrapper refuses
    SP). The norm runs on this rank's slice of the sequence; its weight is replicated over TP, so its
    gradient is a partial sum that the engine all-reduces over TP (the `sequence_parallel` mark, as
    megatron's own norms carry it)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"sequence parallel on the local spec supports RMSNorm, not {config.normalization}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = True


def build_gpt_model(arch: ModelArch, dtype: torch.dtype = torch.float32, use_te: bool | None = None,
                    attention: str = "per_sequence", sequence_parallel: bool = False, recompute: str = "none",
                    moe: MoeSettings | None = None):
    """A GPTModel for this rank's pipeline stage, tensor shard and context-parallel slice
    (parallel_state must be set up).

    attention (local spec only): per_sequence (hpcrl.engines.megatron.attention, the attention mask
    argument is then the packing's segments) or dense (megatron's DotProductAttention with a
    block-diagonal mask). sequence_parallel: megatron's SP (TP > 1). recompute: none | selective |
    full (`recompute_settings`). moe: the router's loss terms and routing replay of an MoE model
    (hpcrl.engines.megatron.moe); its expert-parallel size is megatron's (init_model_parallel)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    on_gpu = torch.cuda.is_available()
    if use_te is None:
        use_te = transformer_engine_available()
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallel needs tensor parallel > 1 (it shards the sequence over the TP ranks)")
    config = transformer_config(arch, tp, pp, dtype, on_gpu, cp, sequence_parallel, recompute, ep, moe)
    experts = arch.num_experts or None
    spec = (get_gpt_layer_with_transformer_engine_spec(experts, qk_layernorm=arch.qk_norm) if use_te
            else get_gpt_layer_local_spec(experts, qk_layernorm=arch.qk_norm, normalization="RMSNorm"))
    if not use_te:
        if cp > 1 and attention != "per_sequence":
            raise ValueError(f"context parallel {cp} needs the per_sequence attention (model.local_attention), "
                             f"not {attention!r}")
        if attention == "per_sequence":
            from hpcrl.engines.megatron.attention import SequenceAttention

            spec.submodules.self_attention.submodules.core_attention = SequenceAttention
        if sequence_parallel:
            spec.submodules.input_layernorm = SequenceParallelRMSNorm
            spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
            if arch.qk_norm:  # (per head, not per token: what the TP ranks sum is their heads' part)
                attn = spec.submodules.self_attention.submodules
                attn.q_layernorm = attn.k_layernorm = SequenceParallelRMSNorm
            # the block's final norm too: megatron would build its torch-norm wrapper there
            spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                              layer_norm=SequenceParallelRMSNorm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rope_scaling=arch.rope_llama3_factor is not None,
        rope_scaling_factor=arch.rope_llama3_factor or 8.0,
        parallel_output=True,
    )
    if tp > 1 and arch.qk_norm:
        # the q/k norms are shared by the heads, which TP splits: their gradients are partial sums
        # over TP, reduced like the sequence-parallel norms' (the engine all-reduces marked ones)
        for name, p in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                p.sequence_parallel = True
    model.hpcrl_spec = "te" if use_te else "local"
    model.hpcrl_attention = "te" if use_te else attention
    mark_tensor_parallel_params(model)
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    return model


def mark_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Tag TP-sharded parameters the way megatron's initialisers do (`tensor_model_parallel`,
    `partition_dim`): with perform_initialization=False the CPU path skips them, and the grad-norm
    and checkpoint code must tell shards from replicated tensors."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    def tag(p: torch.nn.Parameter | None, dim: int) -> None:
        if p is not None and getattr(p, "tensor_model_parallel", None) is None:
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1

    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            tag(getattr(m, "weight", None), 0)
            if isinstance(m, ColumnParallelLinear):
                tag(getattr(m, "bias", None), 0)
        elif isinstance(m, RowParallelLinear):
            tag(getattr(m, "weight", None), 1)  # its bias is added after the all-reduce: replicated
