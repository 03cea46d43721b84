"""Causal attention within each packed sequence, for megatron's local (non-Transformer-Engine) layer
spec: the CPU path's `core_attention`.

megatron's local `DotProductAttention` attends a packed row through a dense [T, T] block-diagonal
mask: its cost and the fp32 attention probabilities it keeps for backward grow with the square of
the row length (the micro-batch token budget), although a sequence only ever attends to itself.
`SequenceAttention` runs PyTorch's scaled_dot_product_attention (causal, grouped-query) on each
sequence of a row separately, so cost and memory grow with the sum of the squared sequence
lengths. The packing (which sequence sits where) arrives through the `attention_mask` argument
as a [B, K, 4] tensor of (offset, length, prefix offset, prefix length) per row (`segments_of`):
a branch of a shared prompt (hpcrl.engines.megatron.packing) attends to its prefix as well;
positions after a row's last sequence (the tail padding) get zeros. Equal to the dense-mask result within float rounding
(tests/test_megatron_engine.py). On CPU a bf16 / fp16 model attends in fp32 (faster there, and the
output is the exact result rounded once).

Context parallel (CP > 1): every sequence is padded to a multiple of 2 x CP and cut into 2 x CP
equal chunks; CP rank r holds chunks r and 2 x CP - 1 - r (Megatron's load balancing for causal
attention: every rank gets one early and one late chunk), laid out sequence after sequence
(hpcrl.engines.megatron.context_parallel). The segments then are (local offset, padded length, 0, 0).
Keys and values are all-gathered over the CP group (the backward reduce-scatters their gradients),
each sequence's keys put back in order, and the local queries attend causally at their true
positions: exact attention, the same numbers as CP = 1 up to float rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def segments_of(placement: list, rows: int) -> torch.Tensor:
    """[rows, K, 4] (offset, length, prefix offset, prefix length) of every segment of each row,
    zero-length entries as filler; from a micro-batch's placement (hpcrl.engines.megatron.packing).
    A branch of a shared prefix also attends to the prefix; a plain sequence and a prefix have
    prefix length 0."""
    per_row: list[set[tuple[int, int, int, int]]] = [set() for _ in range(rows)]
    for p in placement:
        per_row[p.row].add((p.offset, p.length, p.prefix if p.start else 0, p.start))
        if p.start:
            per_row[p.row].add((p.prefix, p.start, 0, 0))
    k = max((len(x) for x in per_row), default=0)
    out = torch.zeros(rows, max(k, 1), 4, dtype=torch.long)
    for r, segs in enumerate(per_row):
        for j, seg in enumerate(sorted(segs)):
            out[r, j] = torch.tensor(seg)
    return out


class SequenceAttention(torch.nn.Module):
    """Drop-in `core_attention` of megatron's local spec (same constructor and forward arguments
    as its DotProductAttention; no dropout: RL fine-tuning runs with attention_dropout 0)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None):
        super().__init__()
        from megatron.core import parallel_state as ps

        tp = pg_collection.tp.size() if pg_collection is not None and hasattr(pg_collection, "tp") \
            else ps.get_tensor_model_parallel_world_size()
        self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") \
            else ps.get_context_parallel_group(check_initialized=False)
        self.cp = self.cp_group.size() if self.cp_group is not None else 1
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention dropout {dropout}: SequenceAttention has none (use the dense spec)")
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor, attn_mask_type: Any = None, attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """query [T, B, heads, d], key / value [T, B, groups, d], attention_mask the segments
        [B, K, 4] -> [T, B, heads * d]."""
        t, b = query.shape[:2]
        gqa = self.heads != self.groups
        out_dtype = query.dtype
        if query.device.type == "cpu" and out_dtype in (torch.bfloat16, torch.float16):
            # PyTorch's CPU attention kernel is slower in bf16 than in fp32 at these short lengths,
            # and less exact: attend in fp32 and round the output once. Measured, one core, one
            # demo-model branch (9 heads, 45 tokens after a 65-token prompt), forward + backward:
            # 2.55 ms in bf16, 1.09 ms cast to fp32 and back; the bf16 kernel's backward was 18% of
            # a bf16 update.
            query, key, value = query.float(), key.float(), value.float()
        if self.cp > 1:
            return self._context_parallel(query, key, value, attention_mask).to(out_dtype)
        rows = []
        # A row is cut into its segments with one split per tensor, never by slicing: the backward
        # of a slice allocates a zero tensor the size of the whole row per slice (3 per segment and
        # layer), the backward of a split is one concatenation. Measured on the demo model (one
        # core, 16 samples of 4 prompts): 0.48 s of fills and 8,000 zero tensors per RL step.
        for r, (qr, kr, vr) in enumerate(zip(query.unbind(1), key.unbind(1), value.unbind(1), strict=True)):
            segs = [s for s in attention_mask[r].tolist() if s[1] > 0]
            sizes = [n for _, n, _, _ in segs]
            end = sum(sizes)
            assert [o for o, *_ in segs] == [sum(sizes[:j]) for j in range(len(segs))], \
                "sequences of a row must sit back to back from offset 0"
            qs, ks, vs = (torch.split(x, sizes + [t - end] if end < t else sizes) for x in (qr, kr, vr))
            at = {offset: j for j, (offset, *_) in enumerate(segs)}
            pieces = []
            for j, (_, n, prefix, f) in enumerate(segs):
                # [L, heads, d] -> [1, heads, L, d]
                q, k, v = (x[j].transpose(0, 1)[None] for x in (qs, ks, vs))
                if f:  # a branch: the shared prefix (a segment of its own in the row), then itself causally
                    k, v = (torch.cat([x[at[prefix]].transpose(0, 1)[None], y], dim=2) for x, y in ((ks, k), (vs, v)))
                    allowed = torch.ones(n, f + n, dtype=torch.bool, device=q.device)
                    allowed[:, f:] = allowed[:, f:].tril()
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale, enable_gqa=gqa)
                else:
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
                pieces.append(o[0].transpose(0, 1))
            if end < t:
                pieces.append(query.new_zeros(t - end, self.heads, self.head_dim))
            rows.append(torch.cat(pieces))
        return torch.stack(rows, dim=1).reshape(t, b, self.heads * self.head_dim).to(out_dtype)

    def _context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          segments: torch.Tensor) -> torch.Tensor:
        """Attention of this CP rank's chunks (module docstring): segments [B, K, 4] of (local offset,
        padded sequence length, 0, 0)."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        t, b = query.shape[:2]
        cp, rank = self.cp, self.cp_group.rank()
        gqa = self.heads != self.groups
        # [cp * T, B, groups, d]: rank j's local row at [j * T, (j + 1) * T)
        keys, values = (gather_from_sequence_parallel_region(x.contiguous(), True, self.cp_group) for x in (key, value))
        rows = []
        for r in range(b):
            pieces = []
            end = 0
            for off, padded, _, _ in segments[r].tolist():
                if padded <= 0:
                    continue
                c = padded // (2 * cp)
                # chunk i of the sequence sits on rank i (first half) or 2cp-1-i (second half), at the
                # segment's local offset (+ c for the second half)
                order = torch.cat([torch.arange(c) + (i if i < cp else 2 * cp - 1 - i) * t + off + (0 if i < cp else c)
                                   for i in range(2 * cp)])
                k, v = (x[order.to(x.device), r].transpose(0, 1)[None] for x in (keys, values))  # [1, g, L, d]
                q = query[off:off + 2 * c, r].transpose(0, 1)[None]  # [1, heads, 2c, d]
                pos = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                                 torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]).to(q.device)
                allowed = torch.arange(padded, device=q.device)[None, :] <= pos[:, None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale, enable_gqa=gqa)
                pieces.append(o[0].transpose(0, 1))
                end = off + 2 * c
            if end < t:
                pieces.append(query.new_zeros(t - end, self.heads, self.head_dim))
            rows.append(torch.cat(pieces))
        return torch.stack(rows, dim=1).reshape(t, b, self.heads * self.head_dim)
