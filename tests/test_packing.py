"""Packed micro-batches as Transformer Engine's attention and context parallel take them: the sequence
boundaries of `thd_params` (the GPU path's packed-sequence description, which no CPU world runs) and each CP
rank's share of a row (`local_part`), checked against boundaries written out by hand. No world."""

from __future__ import annotations

import pytest
import torch

from hpcrl.engines.megatron.context_parallel import local_part
from hpcrl.engines.megatron.forward import thd_params
from hpcrl.engines.megatron.packing import pack


def sequences(*lengths: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 100, (n,), generator=g) for n in lengths]


def test_thd_params_restart_attention_at_every_sequence() -> None:
    """Sequences of 5, 3 and 4 tokens back to back in a row of 16 places: attention restarts at 0, 5, 8, and
    the 4 places of tail padding are a segment of their own (else they would attend to the last sequence)."""
    mb = pack(sequences(5, 3, 4), [[0, 1, 2]], 16, dense_mask=False)
    p = thd_params(mb, "cpu")
    assert p.qkv_format == "thd" and p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 5, 8, 12, 16]
    assert p.max_seqlen_q == p.max_seqlen_kv == 5
    assert p.cu_seqlens_q_padded is None  # no CP: the real boundaries are the places'
    # a row the sequences fill exactly has no tail segment
    assert thd_params(pack(sequences(5, 3), [[0, 1]], 8, dense_mask=False), "cpu").cu_seqlens_q.tolist() == [0, 5, 8]


def test_thd_params_with_context_parallel_give_real_and_padded_boundaries() -> None:
    """CP = 2: each sequence takes a multiple of 2 x CP = 4 places (5 -> 8, 3 -> 4, 4 -> 4) and the row of 20
    ends with 4 places of padding. TE's CP attention takes the real lengths (cu_seqlens) and the padded ones
    (cu_seqlens_padded) of the whole row, whatever the rank."""
    full = pack(sequences(5, 3, 4), [[0, 1, 2]], 20, dense_mask=False, align=4)
    for rank in (0, 1):
        p = thd_params(local_part(full, 2, rank), "cpu", cp=2)
        assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 5, 8, 12, 16]
        assert p.cu_seqlens_q_padded.tolist() == p.cu_seqlens_kv_padded.tolist() == [0, 8, 12, 16, 20]
        assert p.max_seqlen_q == p.max_seqlen_kv == 8
    # two rows: TE's packed format is one row
    two = pack(sequences(4, 4), [[0], [1]], 4, dense_mask=False, align=4)
    with pytest.raises(ValueError, match="actor.packing"):
        thd_params(local_part(two, 2, 0), "cpu", cp=2)


def test_each_cp_rank_holds_its_share_of_every_sequence() -> None:
    """A CP rank holds T / CP places of the row: chunks r and 2 x CP - 1 - r of every sequence (the load
    balance of causal attention), and the ranks' places together are the row's, each once. A CP that gave
    every rank the whole row (the work repeated, not split) fails the first assertion."""
    full = pack(sequences(5, 3, 4), [[0, 1, 2]], 20, dense_mask=False, align=4)
    cp = 2
    parts = [local_part(full, cp, rank) for rank in range(cp)]
    assert [p.tokens.shape for p in parts] == [torch.Size([1, 10])] * cp
    # the first sequence's 8 places in chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert parts[0].index[0, 0, :4].tolist() == [0, 1, 6, 7]
    assert parts[0].index[1, 0, :4].tolist() == [2, 3, 4, 5]
    held = sorted(i for p, rank in zip(parts, range(cp), strict=True) for i in p.index[rank, 0].tolist())
    assert held == list(range(20))
    for rank, p in enumerate(parts):
        assert torch.equal(p.tokens[0], full.tokens[0, p.index[rank, 0]])
        assert torch.equal(p.labels[0], full.labels[0, p.index[rank, 0]])
