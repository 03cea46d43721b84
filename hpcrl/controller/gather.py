"""Receive the DP shards of a result straight into one concatenated tensor per field.

Why: gathering 4 x 16 MB shards and then `torch.cat`-ing them touches 128 MB of fresh
memory on the controller; first-touch page faults, not MPI, dominate that cost on the
machines measured (docs/controller.md). Once every output rank's reply header is known,
the sizes are known, so each field is allocated once and every rank's buffer is received
into its slice; `Batch.concat` / `concat_rows` then recognise adjacent slices and
return the whole tensor without a copy.
"""

from __future__ import annotations

from typing import Any

from hpcrl.controller.batch import mark_joinable
from hpcrl.controller.codec import Spec, allocate


def plan_merged(spec_lists: list[list[Spec]]) -> list[list[Any]] | None:
    """Per rank (in output order), the slice objects to receive into; None if shards differ in form."""
    first = spec_lists[0]
    if any(len(s) != len(first) for s in spec_lists):
        return None
    merged_specs: list[Spec] = []
    for i, (kind, dtype, shape) in enumerate(first):
        if len(shape) < 1:
            return None
        for specs in spec_lists[1:]:
            k, d, s = specs[i]
            if k != kind or d != dtype or len(s) != len(shape) or tuple(s[1:]) != tuple(shape[1:]):
                return None
        rows = sum(specs[i][2][0] for specs in spec_lists)
        merged_specs.append((kind, dtype, (rows, *shape[1:])))
    whole, _ = allocate(merged_specs)
    for buf in whole:
        mark_joinable(buf)
    per_rank: list[list[Any]] = [[] for _ in spec_lists]
    for i, buf in enumerate(whole):
        start = 0
        for r, specs in enumerate(spec_lists):
            n = specs[i][2][0]
            per_rank[r].append(buf[start : start + n])
            start += n
    return per_rank
