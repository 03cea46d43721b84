"""FSDP2 shards in and out of their full tensors: the one place that knows how FSDP2 cuts a parameter
(dim 0, as torch.chunk cuts it)."""

from __future__ import annotations

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def gather_full(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A DTensor's full value (a collective over its mesh), in `dtype`; a plain tensor as it is.

    FSDP2 cuts dim 0 as torch.chunk does (ceil(n / DP) rows per rank, the last ranks fewer or none):
    each rank pads its rows to ceil(n / DP), one synchronous all_gather_into_tensor puts them side by
    side, and the first n rows are the tensor. Why not DTensor.full_tensor(): its functional
    collectives corrupted the heap on CPU/gloo here once in ~15 demo steps (malloc: unaligned tcache
    chunk, inside its wait_tensor), in the weight push to vLLM."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    if not hasattr(t, "to_local"):
        return t if dtype is None else t.to(dtype)
    if tuple(t.placements) != (Shard(0),):
        raise ValueError(f"FSDP parameter with placements {t.placements}: expected Shard(0)")
    local = t.to_local().detach()
    if dtype is not None:
        local = local.to(dtype)
    group = t.device_mesh.get_group()
    world = dist.get_world_size(group)
    n = t.shape[0]
    rows = -(-n // world)
    padded = local.new_zeros((rows, *t.shape[1:]))
    padded[:local.shape[0]] = local
    out = local.new_empty((rows * world, *t.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return out[:n]
