"""Context parallel (CP) on the packed micro-batches: each sequence split over the CP ranks.

A micro-batch is packed whole (hpcrl.engines.megatron.packing, every sequence padded to a multiple
of 2 x CP, `pack(..., align=2 * CP)`, no shared prompt prefixes), then each CP rank keeps its part
of every sequence: of the 2 x CP equal chunks of a sequence, rank r keeps chunks r and
2 x CP - 1 - r (Megatron's load balancing for causal attention: the work of a chunk grows with its
position, so every rank gets one early and one late chunk). A rank's row holds its chunks sequence
after sequence, so its length is the row's divided by CP, and so are its activations.

The attention (hpcrl.engines.megatron.attention) gathers keys and values over the CP group; every
other layer works token by token and needs nothing. Per-token results (log-probs, entropies,
values) are all-gathered over the CP group and put back in row order (`gather_row_values`), so a
caller sees whole sequences, in order. Loss weights are per token and normalised over the whole
mini-batch before packing, so each rank's loss is its tokens' share and gradients sum over the
DP x CP replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrl.engines.megatron.packing import PackedMicroBatch


def padded_length(length: int, cp: int) -> int:
    """A sequence's places in a CP-packed row: its length rounded up to a multiple of 2 x CP."""
    return -(-length // (2 * cp)) * (2 * cp)


@dataclass
class ContextParallelMicroBatch(PackedMicroBatch):
    """This CP rank's part of a packed micro-batch: tokens, labels and fields [B, T / CP]; the
    attention mask argument is the local segments [B, K, 4] (local offset, padded length, 0, 0);
    `placement` stays in the whole row's coordinates (of `full`)."""

    full: PackedMicroBatch | None = None
    index: torch.Tensor | None = None  # [CP, B, T / CP]: the whole row's place of each rank's tokens


def _row_segments(mb: PackedMicroBatch, row: int, cp: int) -> list[tuple[int, int]]:
    """(offset, padded length) of the sequences of a row in order, the tail padding as one more."""
    segs = sorted((p.offset, padded_length(p.length, cp)) for p in mb.placement if p.row == row)
    end = segs[-1][0] + segs[-1][1] if segs else 0
    t = mb.tokens.shape[1]
    if end < t:
        segs.append((end, t - end))
    return segs


def local_part(full: PackedMicroBatch, cp: int, rank: int) -> ContextParallelMicroBatch:
    """CP rank `rank`'s part of a micro-batch packed with align=2 x CP (module docstring)."""
    b, t = full.tokens.shape
    if t % (2 * cp):
        raise ValueError(f"a CP-packed row of {t} places is not a multiple of 2 x CP = {2 * cp}")
    index = torch.zeros(cp, b, t // cp, dtype=torch.long)
    rows_segments = []
    for r in range(b):
        segs = _row_segments(full, r, cp)
        local = []
        at = 0
        for off, padded in segs:
            if off != at or padded % (2 * cp):
                raise ValueError(f"row {r}: sequences must sit back to back, each padded to 2 x CP = {2 * cp}")
            at += padded
            c = padded // (2 * cp)
            lo = off // cp
            for j in range(cp):
                index[j, r, lo:lo + c] = torch.arange(off + j * c, off + (j + 1) * c)
                index[j, r, lo + c:lo + 2 * c] = torch.arange(off + (2 * cp - 1 - j) * c, off + (2 * cp - j) * c)
            local.append((lo, padded, 0, 0))
        rows_segments.append(local)
    k = max(len(x) for x in rows_segments)
    segments = torch.zeros(b, k, 4, dtype=torch.long)
    for r, segs in enumerate(rows_segments):
        if segs:
            segments[r, :len(segs)] = torch.tensor(segs)
    mine = index[rank]

    def take(x: torch.Tensor) -> torch.Tensor:
        return x.gather(1, mine)

    return ContextParallelMicroBatch(
        tokens=take(full.tokens), position_ids=take(full.position_ids), attention_mask=segments,
        labels=take(full.labels), label_mask=take(full.label_mask), placement=full.placement,
        extra={k: take(v) for k, v in full.extra.items()}, full=full, index=index)


def gather_row_values(values: torch.Tensor, mb: ContextParallelMicroBatch, group: object) -> torch.Tensor:
    """Per-token values [B, T / CP] of every CP rank -> [B, T] in the whole row's order (a collective
    over the CP group; no gradient)."""
    import torch.distributed as dist

    values = values.detach().contiguous()
    parts = [torch.empty_like(values) for _ in range(mb.index.shape[0])]
    dist.all_gather(parts, values, group=group)
    full = values.new_zeros(mb.full.tokens.shape)
    for j, part in enumerate(parts):
        full.scatter_(1, mb.index[j].to(values.device), part)
    return full
