"""Sequence packing: variable-length sequences packed into micro-batches by a token budget.

No padding inside a micro-batch: sequences are concatenated into one row, and each one attends
only to itself (per-sequence attention, hpcrl.engines.megatron.attention, or a block-diagonal causal
mask). RoPE depends only on relative positions, so a sequence shifted inside the row scores as it
would alone. Micro-batches are padded only at the end,
to one common length, because pipeline stages exchange activations of a fixed shape.

Shared prompts: the samples of one prompt (GRPO's n per prompt) begin with the same tokens, and
none of those tokens carries a loss or a needed log-prob. `shared_prefix_units` groups such
sequences, and `pack` lays their common prefix out once, followed by each sequence's own part (a
"branch", starting at the last prompt token, whose output predicts the first response token).
Each branch attends to the prefix and causally to itself; every token keeps its own position
(`position_ids`, which then drive RoPE: hpcrl.engines.megatron.engine), so a branch computes what
the whole sequence would alone, and the prefix's gradient collects every branch's share. With n=4
samples of a 65-token prompt and ~55-token answers that removes ~40% of the tokens a forward and
backward process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# One item of a packed row: a sequence index, or (prefix length, sequence indices) for sequences
# that share their first `prefix length` tokens (laid out once).
Unit = int | tuple[int, tuple[int, ...]]


class Placement(NamedTuple):
    """Where (part of) one input sequence sits in a micro-batch: tokens seq[start:] at `offset` of
    `row`, `length` of them; start > 0 for a branch, whose tokens seq[:start] sit once at
    `prefix` (the shared prefix's offset in the same row; -1: none)."""
    seq: int
    row: int
    offset: int
    length: int
    start: int = 0
    prefix: int = -1


def unit_length(unit: Unit, lengths: list[int]) -> int:
    """Tokens a unit occupies in a row."""
    if isinstance(unit, int):
        return lengths[unit]
    f, members = unit
    return f + sum(lengths[i] - f for i in members)


def shared_prefix_units(seqs: list[torch.Tensor], first_needed: list[int], token_budget: int) -> list[Unit]:
    """Group sequences whose tokens before their first needed position (`first_needed[i]`: the
    first label-aligned position with a loss or a requested output) are equal: their common
    prefix is then laid out once (see the module docstring). A group is cut into units that fit
    the token budget (each repeats the prefix); single sequences stay plain. Deterministic (the
    same on every rank of a pipeline)."""
    groups: dict[tuple[int, bytes], list[int]] = {}
    order: list[int | tuple[int, bytes]] = []  # plain sequences and groups, by first appearance
    for i, s in enumerate(seqs):
        f = first_needed[i]
        if f < 1:
            order.append(i)
            continue
        key = (f, s[:f].numpy().tobytes())
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(i)

    def unit(f: int, members: list[int]) -> Unit:
        return (f, tuple(members)) if len(members) > 1 else members[0]

    units: list[Unit] = []
    for item in order:
        if isinstance(item, int):
            units.append(item)
            continue
        f = item[0]
        chunk: list[int] = []
        used = f
        for i in groups[item]:
            m = seqs[i].numel() - f
            if chunk and used + m > token_budget:
                units.append(unit(f, chunk))
                chunk, used = [], f
            chunk.append(i)
            used += m
        units.append(unit(f, chunk))
    return units


def packing_units(seqs: list[torch.Tensor], token_fields: dict[str, list[torch.Tensor]] | None, token_budget: int,
                  share: bool) -> list[Unit]:
    """What packed rows hold: the sequences, with the samples of one prompt sharing it (`share`) when
    only later positions carry a loss (`loss_weight`) or a requested output (`positions`)."""
    fields = token_fields or {}
    needed = fields.get("loss_weight", fields.get("positions"))
    if not share or needed is None:
        return list(range(len(seqs)))
    first = []
    for v in needed:
        nz = torch.nonzero(v).flatten()
        first.append(int(nz[0]) if nz.numel() else 0)
    return shared_prefix_units(seqs, first, token_budget)


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sequence (or unit) indices into micro-batches of at most `token_budget` tokens (a longer
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
    # where each input sequence sits (with a shared prefix: its own part, see Placement)
    placement: list[Placement]
    extra: dict[str, torch.Tensor]  # per-token fields laid out like labels (advantages, old log-probs, ...)


def pack(seqs: list[torch.Tensor], rows: list[list[Unit]], length: int,
         token_fields: dict[str, list[torch.Tensor]] | None = None, dense_mask: bool = True,
         align: int = 1) -> PackedMicroBatch:
    """Lay out seqs into len(rows) rows of `length` tokens: row r holds the units rows[r] back to
    back (a sequence index, or sequences sharing a prefix: see the module docstring). Packing is
    one row with many sequences; the padded baseline is one sequence per row. align > 1: each
    sequence takes a multiple of `align` places, padding after it (context parallel cuts every
    sequence into 2 x CP equal chunks; plain sequences only).

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
    placement: list[Placement] = []
    for r, units in enumerate(rows):
        pos = 0
        for unit in units:
            f, members = (0, (unit,)) if isinstance(unit, int) else unit
            prefix = -1
            if f:  # the shared prefix, once: it carries no label
                tokens[r, pos:pos + f] = seqs[members[0]][:f]
                position_ids[r, pos:pos + f] = torch.arange(f)
                if mask is not None:
                    mask[r, pos:pos + f, pos:pos + f] = ~torch.ones(f, f, dtype=torch.bool).tril()
                prefix, pos = pos, pos + f
            for i in members:
                s = seqs[i]
                n = s.numel() - f  # the tokens laid out here: s[f:]
                tokens[r, pos:pos + n] = s[f:]
                labels[r, pos:pos + n - 1] = s[f + 1:]
                label_mask[r, pos:pos + n - 1] = 1.0
                position_ids[r, pos:pos + n] = torch.arange(f, f + n)
                if mask is not None:
                    mask[r, pos:pos + n, pos:pos + n] = ~torch.ones(n, n, dtype=torch.bool).tril()
                    if f:
                        mask[r, pos:pos + n, prefix:prefix + f] = False
                for k, v in fields.items():
                    extra[k][r, pos:pos + n - 1] = v[i][f:]
                placement.append(Placement(i, r, pos, n, f, prefix))
                pos += n
                if align > 1:
                    assert not f, "aligned sequences cannot share a prefix"
                    pad = -pos % align
                    if mask is not None:  # padding attends to itself only
                        mask[r, torch.arange(pos, pos + pad), torch.arange(pos, pos + pad)] = False
                    pos += pad
        if mask is not None:  # padding attends to itself only, so no softmax row is empty
            idx = torch.arange(pos, length)
            mask[r, idx, idx] = False
    return PackedMicroBatch(tokens, position_ids, mask.unsqueeze(1) if mask is not None else None, labels,
                            label_mask, placement, extra)


def unpack_token_values(values: torch.Tensor, mb: PackedMicroBatch) -> dict[int, torch.Tensor]:
    """Per-sequence slices (len - 1 each) of a per-token [B, T] tensor laid out like labels (zeros at
    the positions of a shared prefix, which carry no label)."""
    out = {}
    for p in mb.placement:
        v = values[p.row, p.offset:p.offset + p.length - 1]
        out[p.seq] = torch.cat([v.new_zeros(p.start), v]) if p.start else v
    return out


def shares_prefixes(mb: PackedMicroBatch) -> bool:
    """Whether some sequences of the micro-batch share a prefix (their positions then drive RoPE)."""
    return any(p.start for p in mb.placement)
