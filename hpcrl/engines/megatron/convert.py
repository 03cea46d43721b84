"""HuggingFace <-> Megatron-core weights for Llama/Qwen2/Qwen3/Qwen3-MoE models, for any TP x PP (x EP) split.

Megatron fuses and shards differently from HF:
- QKV is one column-parallel matrix laid out per KV group: [q heads of group g, k_g, v_g] for
  g = 0..groups-1; TP rank r holds the groups r*G/TP .. (r+1)*G/TP-1 (GQA stays grouped).
- gate and up projections are one column-parallel matrix: rank r holds [gate_r; up_r].
- attention output and down projections are row-parallel (split along the input dim).
- embedding and output layer are vocab-parallel (split along the vocab, padded to a TP multiple).
- norms are replicated; pipeline stage p holds layers p*L/PP .. (p+1)*L/PP-1 as local 0..L/PP-1.
- Qwen3's per-head q/k norms are megatron's q_layernorm / k_layernorm (replicated).
- an MoE layer (Qwen3-MoE): the router `mlp.gate` is megatron's replicated `mlp.router`; expert e is
  `mlp.experts.local_experts.<e - offset>` on the EP rank holding it (experts offset .. offset+E/EP-1),
  each TP-sharded like a dense MLP (expert tensor parallel = TP). Megatron-side tensors that leave a
  rank for conversion carry the global index (`global_expert_names`), so converting back needs no
  knowledge of which EP rank sent them.
With Transformer Engine the two pre-norms live inside the following linear layer.

Conversion works on plain dicts of tensors, so it is testable without any process group, and
`hf_to_megatron` reads only the HF tensors its shard needs (safetensors is lazily indexed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from hpcrl.engines.megatron.model import ModelArch, padded_vocab_size

TensorGetter = Callable[[str], torch.Tensor]


def _norm_names(spec: str, moe: bool = False) -> tuple[str, str]:
    if spec == "te":  # (an MoE layer keeps its pre-MLP norm apart: no linear to fuse it into)
        return ("self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight")
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def layer_range(arch: ModelArch, pp_rank: int, pp_size: int) -> range:
    per = arch.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _qkv_shard(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp_rank: int,
               tp_size: int) -> torch.Tensor:
    """Interleave q/k/v per KV group (works for weights [out, in] and biases [out])."""
    g, hpg, hd = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, hpg * hd, *rest)
    k = k.reshape(g, hd, *rest)
    v = v.reshape(g, hd, *rest)
    fused = torch.cat([q, k, v], dim=1)  # [g, (hpg+2)*hd, ...]
    per = g // tp_size
    return fused[tp_rank * per:(tp_rank + 1) * per].reshape(-1, *rest).contiguous()


def _split_qkv(arch: ModelArch, fused_shards: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    g, hpg, hd = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    fused = torch.cat(fused_shards, dim=0)
    rest = fused.shape[1:]
    fused = fused.reshape(g, (hpg + 2) * hd, *rest)
    q, k, v = fused.split([hpg * hd, hd, hd], dim=1)
    return (q.reshape(g * hpg * hd, *rest).contiguous(), k.reshape(g * hd, *rest).contiguous(),
            v.reshape(g * hd, *rest).contiguous())


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank].contiguous()


def _vocab_shard(arch: ModelArch, w: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    padded = padded_vocab_size(arch.vocab_size, tp_size)
    if padded != w.shape[0]:
        w = torch.cat([w, w.new_zeros(padded - w.shape[0], w.shape[1])])
    return _chunk(w, 0, tp_rank, tp_size)


EXPERTS = "mlp.experts.local_experts."


def expert_range(arch: ModelArch, ep_rank: int, ep_size: int) -> range:
    """The global indices of the experts EP rank `ep_rank` holds."""
    per = arch.num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def global_name(name: str, offset: int) -> str:
    """A Megatron parameter's name with its local expert index (if any) made global."""
    if not offset or EXPERTS not in name:
        return name
    head, rest = name.split(EXPERTS)
    index, tail = rest.split(".", 1)
    return f"{head}{EXPERTS}{int(index) + offset}.{tail}"


def local_name(name: str, offset: int) -> str:
    """The inverse of `global_name` on the EP rank whose experts start at `offset`."""
    return global_name(name, -offset) if offset else name


def expert_of(name: str) -> int | None:
    """The (global) expert index a Megatron parameter belongs to, or None."""
    if EXPERTS not in name:
        return None
    return int(name.split(EXPERTS)[1].split(".", 1)[0])


def global_expert_names(shard: dict[str, torch.Tensor], offset: int) -> dict[str, torch.Tensor]:
    """`shard` with local expert indices renamed to global ones (offset: the first expert this EP rank holds)."""
    if not offset:
        return shard
    return {global_name(k, offset): v for k, v in shard.items()}


def _mlp_to_megatron(get: TensorGetter, hf: str, mg: str, tp_rank: int, tp_size: int,
                     out: dict[str, torch.Tensor]) -> None:
    """gate/up -> linear_fc1 (this rank's [gate_r; up_r]), down -> linear_fc2 (row-parallel)."""
    gate, up = get(hf + "gate_proj.weight"), get(hf + "up_proj.weight")
    out[mg + "linear_fc1.weight"] = torch.cat([_chunk(gate, 0, tp_rank, tp_size), _chunk(up, 0, tp_rank, tp_size)])
    out[mg + "linear_fc2.weight"] = _chunk(get(hf + "down_proj.weight"), 1, tp_rank, tp_size)


def _mlp_to_hf(tp_shards: list[dict[str, torch.Tensor]], mg: str, hf: str, out: dict[str, torch.Tensor]) -> None:
    gates, ups = zip(*(s[mg + "linear_fc1.weight"].chunk(2, dim=0) for s in tp_shards), strict=False)
    out[hf + "gate_proj.weight"] = torch.cat(gates)
    out[hf + "up_proj.weight"] = torch.cat(ups)
    out[hf + "down_proj.weight"] = torch.cat([s[mg + "linear_fc2.weight"] for s in tp_shards], dim=1)


def hf_to_megatron(arch: ModelArch, get: TensorGetter, tp_rank: int, tp_size: int, pp_rank: int,
                   pp_size: int, spec: str = "local", lm_head: bool = True, ep_rank: int = 0,
                   ep_size: int = 1) -> dict[str, torch.Tensor]:
    """The Megatron state dict of one (TP rank, PP stage, EP rank) shard, read from HF tensors.
    lm_head=False leaves the output layer out (a critic puts a value head there)."""
    out: dict[str, torch.Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    in_norm, mlp_norm = _norm_names(spec, arch.is_moe)
    if first:
        out["embedding.word_embeddings.weight"] = _vocab_shard(arch, get("model.embed_tokens.weight"), tp_rank,
                                                               tp_size)
    for local, i in enumerate(layer_range(arch, pp_rank, pp_size)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[m + in_norm] = get(h + "input_layernorm.weight")
        out[m + mlp_norm] = get(h + "post_attention_layernorm.weight")
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _qkv_shard(
            arch, get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"), tp_rank, tp_size)
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _qkv_shard(
                arch, get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"), tp_rank, tp_size)
        out[m + "self_attention.linear_proj.weight"] = _chunk(get(a + "o_proj.weight"), 1, tp_rank, tp_size)
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = get(a + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = get(a + "k_norm.weight")
        if arch.is_moe:
            out[m + "mlp.router.weight"] = get(h + "mlp.gate.weight")
            experts = expert_range(arch, ep_rank, ep_size)
            for e in experts:
                _mlp_to_megatron(get, f"{h}mlp.experts.{e}.", f"{m}{EXPERTS}{e - experts.start}.", tp_rank, tp_size,
                                 out)
        else:
            _mlp_to_megatron(get, h + "mlp.", m + "mlp.", tp_rank, tp_size, out)
    if last:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight")
        head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        # with tied embeddings and PP > 1 the last stage keeps its own copy of the embedding
        if lm_head and (not arch.tie_word_embeddings or not first):
            out["output_layer.weight"] = _vocab_shard(arch, get(head), tp_rank, tp_size)
    return out


def megatron_to_hf(arch: ModelArch, tp_shards: list[dict[str, torch.Tensor]], pp_rank: int, pp_size: int,
                   spec: str = "local") -> dict[str, torch.Tensor]:
    """HF tensors of one pipeline stage from the state dicts of all its TP ranks (in TP order)."""
    return megatron_to_hf_partial(arch, tp_shards, pp_rank, pp_size, spec)


def megatron_to_hf_partial(arch: ModelArch, tp_shards: list[dict[str, torch.Tensor]], pp_rank: int, pp_size: int,
                           spec: str = "local") -> dict[str, torch.Tensor]:
    """HF tensors of whatever part of one pipeline stage the TP shards hold: the embedding, whole
    layers (by their local index), the final norm and output layer; of an MoE layer, the experts
    present (globally named: `global_expert_names`), with or without the rest of the layer.
    Resharding converts a stage bucket by bucket with it, so no rank holds a whole stage in both
    layouts at once."""
    out: dict[str, torch.Tensor] = {}
    in_norm, mlp_norm = _norm_names(spec, arch.is_moe)
    s0 = tp_shards[0]

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in tp_shards], dim=dim)

    if "embedding.word_embeddings.weight" in s0:
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[:arch.vocab_size].clone()
    first = layer_range(arch, pp_rank, pp_size).start
    present = sorted({int(k.split(".")[2]) for k in s0 if k.startswith("decoder.layers.")})
    for local in present:
        h, m = f"model.layers.{first + local}.", f"decoder.layers.{local}."
        if arch.is_moe:
            for e in sorted({int(k[len(m + EXPERTS):].split(".")[0]) for k in s0 if k.startswith(m + EXPERTS)}):
                _mlp_to_hf(tp_shards, f"{m}{EXPERTS}{e}.", f"{h}mlp.experts.{e}.", out)
            if m + "mlp.router.weight" not in s0:
                continue  # experts only (another EP rank's part of the layer)
            out[h + "mlp.gate.weight"] = s0[m + "mlp.router.weight"]
        out[h + "input_layernorm.weight"] = s0[m + in_norm]
        out[h + "post_attention_layernorm.weight"] = s0[m + mlp_norm]
        a = h + "self_attn."
        q, k, v = _split_qkv(arch, [s[m + "self_attention.linear_qkv.weight"] for s in tp_shards])
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if arch.qkv_bias:
            q, k, v = _split_qkv(arch, [s[m + "self_attention.linear_qkv.bias"] for s in tp_shards])
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        out[a + "o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        if arch.qk_norm:
            out[a + "q_norm.weight"] = s0[m + "self_attention.q_layernorm.weight"]
            out[a + "k_norm.weight"] = s0[m + "self_attention.k_layernorm.weight"]
        if not arch.is_moe:
            _mlp_to_hf(tp_shards, m + "mlp.", h + "mlp.", out)
    if "decoder.final_layernorm.weight" in s0:
        out["model.norm.weight"] = s0["decoder.final_layernorm.weight"]
    if "output_layer.weight" in s0 and not arch.tie_word_embeddings:
        out["lm_head.weight"] = cat("output_layer.weight", 0)[:arch.vocab_size].clone()
    return out


class SafetensorsReader:
    """Lazy reader over a HF folder's *.safetensors files (sharded or not)."""

    def __init__(self, model_path: str | Path):
        from safetensors import safe_open

        path = Path(model_path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        self._handles = [safe_open(str(path / f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def __call__(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].get_tensor(name)
        except KeyError:
            raise KeyError(f"tensor {name!r} not found in the checkpoint") from None
