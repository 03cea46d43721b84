"""Sequence packing: variable-length sequences packed into micro-batches by a token budget.

No padding inside a micro-batch: sequences are concatenated into one row, and each one attends
only to itself (per-sequence attention, hpcrl.engines.megatron.attention, or a block-diagonal causal
mask). RoPE depends only on relative positions, so a sequence shifted inside the row scores as it
would alone. Micro-batches are padded only at the end,
to one common length, because pipeline stages exchange activations of a fixed shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `token_budget` tokens (a longer
    sequence gets a micro-batch of its own), balanced: longest first, each into the emptiest
    micro-batch it fits in, so that micro-batches padded to a common length (pipeline stages
    exchange one shape) carry little padding. Each group lists its indices in order.
    Deterministic: every rank of a pipeline computes the same plan from the same lengths."""
    groups: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        fits = [g for g in range(len(groups)) if used[g] + n <= token_budget]
        if fits:
            g = min(fits, key=lambda g: (used[g], g))
        else:
            g = len(groups)
            groups.append([])
            used.append(0)
        groups[g].append(i)
        used[g] += n
    return [sorted(g) for g in groups]


def plan_padded_micro_batches(n: int, micro_batch_size: int) -> list[list[int]]:
    """The padded baseline: fixed-size micro-batches of whole sequences, each in its own row."""
    return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]


@dataclass
class PackedMicroBatch:
    tokens: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor | None  # [B, 1, T, T] bool, True = masked out (dense_mask only)
    labels: torch.Tensor  # [B, T] next token within the same sequence (0 where none)
    label_mask: torch.Tensor  # [B, T] float: 1 where labels[t] is a real next token
    # where each input sequence sits: (sequence index, row, offset in the row, length)
    placement: list[tuple[int, int, int, int]]
    extra: dict[str, torch.Tensor]  # per-token fields laid out like labels (advantages, old log-probs, ...)


def pack(seqs: list[torch.Tensor], rows: list[list[int]], length: int,
         token_fields: dict[str, list[torch.Tensor]] | None = None, dense_mask: bool = True) -> PackedMicroBatch:
    """Lay out seqs into len(rows) rows of `length` tokens: row r holds seqs[rows[r]] back to back.
    Packing is one row with many sequences; the padded baseline is one sequence per row.

    token_fields: per-sequence tensors of length len(seq) - 1 aligned with the *predicted* tokens
    (entry t belongs to the prediction of token t+1); they are laid out like labels."""
    b = len(rows)
    tokens = torch.zeros(b, length, dtype=torch.long)
    labels = torch.zeros(b, length, dtype=torch.long)
    label_mask = torch.zeros(b, length)
    position_ids = torch.zeros(b, length, dtype=torch.long)
    mask = torch.ones(b, length, length, dtype=torch.bool) if dense_mask else None
    fields = token_fields or {}
    extra = {k: torch.zeros(b, length, dtype=v[0].dtype) for k, v in fields.items()}
    placement = []
    for r, index in enumerate(rows):
        pos = 0
        for i in index:
            s = seqs[i]
            n = s.numel()
            tokens[r, pos:pos + n] = s
            labels[r, pos:pos + n - 1] = s[1:]
            label_mask[r, pos:pos + n - 1] = 1.0
            position_ids[r, pos:pos + n] = torch.arange(n)
            if mask is not None:
                mask[r, pos:pos + n, pos:pos + n] = ~torch.ones(n, n, dtype=torch.bool).tril()
            for k, v in fields.items():
                extra[k][r, pos:pos + n - 1] = v[i]
            placement.append((i, r, pos, n))
            pos += n
        if mask is not None:  # padding attends to itself only, so no softmax row is empty
            idx = torch.arange(pos, length)
            mask[r, idx, idx] = False
    return PackedMicroBatch(tokens, position_ids, mask.unsqueeze(1) if mask is not None else None, labels,
                            label_mask, placement, extra)


def unpack_token_values(values: torch.Tensor, mb: PackedMicroBatch) -> dict[int, torch.Tensor]:
    """Per-sequence slices (len - 1 each) of a per-token [B, T] tensor laid out like labels."""
    return {i: values[r, o:o + n - 1] for i, r, o, n in mb.placement}
