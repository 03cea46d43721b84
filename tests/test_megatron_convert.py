"""HF <-> Megatron weight conversion, on plain tensors (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from conftest import SMOLLM2, TINY_MODEL

from hpcrl.engines.megatron.convert import SafetensorsReader, hf_to_megatron, megatron_to_hf
from hpcrl.engines.megatron.model import read_arch


@pytest.mark.parametrize("model", [TINY_MODEL, SMOLLM2], ids=["tiny-qwen2", "smollm2"])
def test_round_trip_is_bit_exact_for_every_layout(model) -> None:
    arch = read_arch(model)
    reader = SafetensorsReader(model)
    original = {k: reader(k) for k in reader.keys()}
    tps = [t for t in (1, 2, 3, 4) if arch.num_kv_heads % t == 0 and arch.num_heads % t == 0]
    pps = [p for p in (1, 2, 3) if arch.num_layers % p == 0]
    for tp in tps:
        for pp in pps:
            back: dict[str, torch.Tensor] = {}
            for stage in range(pp):
                shards = [hf_to_megatron(arch, reader, r, tp, stage, pp) for r in range(tp)]
                back.update(megatron_to_hf(arch, shards, stage, pp))
            assert back.keys() == original.keys(), (tp, pp, original.keys() ^ back.keys())
            for k, v in original.items():
                assert back[k].dtype == v.dtype and torch.equal(back[k], v), (tp, pp, k)


def test_qkv_layout_is_grouped_per_kv_head() -> None:
    # tiny: 4 query heads, 2 KV groups, head_dim 32 -> per group [q0 q1 k v] blocks of 32 rows
    arch = read_arch(TINY_MODEL)
    reader = SafetensorsReader(TINY_MODEL)
    shard = hf_to_megatron(arch, reader, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)
    qkv = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
    hd = arch.head_dim
    q = reader("model.layers.0.self_attn.q_proj.weight")
    k = reader("model.layers.0.self_attn.k_proj.weight")
    v = reader("model.layers.0.self_attn.v_proj.weight")
    # TP rank 1 holds KV group 1: query heads 2 and 3, then k and v of group 1
    assert torch.equal(qkv[:2 * hd], q[2 * hd:4 * hd])
    assert torch.equal(qkv[2 * hd:3 * hd], k[hd:2 * hd])
    assert torch.equal(qkv[3 * hd:], v[hd:2 * hd])
    fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
    half = arch.ffn_hidden_size // 2
    assert torch.equal(fc1[:half], reader("model.layers.0.mlp.gate_proj.weight")[half:])
    assert torch.equal(fc1[half:], reader("model.layers.0.mlp.up_proj.weight")[half:])


def test_tied_embedding_copy_lives_on_the_last_stage_only() -> None:
    arch = read_arch(TINY_MODEL)
    reader = SafetensorsReader(TINY_MODEL)
    one = hf_to_megatron(arch, reader, 0, 1, 0, 1)
    assert "output_layer.weight" not in one  # PP=1: the output layer uses the embedding itself
    first, last = (hf_to_megatron(arch, reader, 0, 1, s, 2) for s in (0, 1))
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    assert [k for k in last if k.startswith("decoder.layers.")][0].startswith("decoder.layers.0.")


def test_unsupported_architecture_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        read_arch(tmp_path)
