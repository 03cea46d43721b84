"""Weights from the FSDP engine into the vLLM engines: colocated (`stream_fsdp_weights`), or through
trainer rank 0 to the split placement's rollout workers (`fsdp_buckets`, hpcrl.engines.transfer).

vLLM's reload path takes full HF tensors and cuts its own tensor-parallel part, so every rank's engine
needs every full tensor: each FSDP rank holds 1/DP of each one and all-gathers the rest, bucket by
bucket (at most `bucket_bytes` of full tensors alive at a time, plus the one being gathered), in the
rollout's dtype. What a rank receives is exactly what it lacks: (DP - 1)/DP of the model. With LoRA each
adapted weight goes out merged with its adapters (W + (alpha / r) B A: vLLM gets plain weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hpcrl.engines.fsdp.shards import local_shard
from hpcrl.engines.reshard import bucket_tensors


def fsdp_buckets(engine: Any, bucket_bytes: int, stats: Any) -> Iterator[dict[str, torch.Tensor]]:
    """The whole model's HF-named full tensors, one bucket (a dict, in host memory) at a time (a
    collective: every rank of the engine's group consumes the iterator to its end, in the same order);
    `stats` is a hpcrl.engines.reshard.ReshardStats. The split placement's transfer sends them on from
    rank 0 (hpcrl.engines.transfer)."""
    named = list(engine.megatron_shard().items())
    dtype = engine.options.dtype
    stats.bucket_bytes = bucket_bytes
    full_bytes = {k: p.numel() * dtype.itemsize for k, p in named}
    stats.model_bytes = sum(full_bytes.values())
    stats.min_bytes_received = sum(n - local_shard(p).numel() * dtype.itemsize for (_, p), n in
                                   zip(named, full_bytes.values(), strict=True))
    stats.largest_unit_bytes = max(full_bytes.values(), default=0)
    buckets: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for k, p in named:
        if buckets[-1] and size + full_bytes[k] > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((k, p))
        size += full_bytes[k]
    peak = 0
    for bucket in buckets:
        hf = {}
        for k, p in bucket:
            full = engine.full_weight(k, p, dtype)  # with LoRA: merged with its adapters
            stats.bytes_received += (full.numel() - local_shard(p).numel()) * full.element_size()
            hf[k] = full.cpu()
        live = sum(t.numel() * t.element_size() for t in hf.values())
        peak = max(peak, live)
        stats.largest_bucket_bytes = max(stats.largest_bucket_bytes, live)
        yield hf
    stats.peak_extra_bytes = peak


def stream_fsdp_weights(engine: Any, bucket_bytes: int, stats: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of the whole model for the colocated vLLM engines (`fsdp_buckets`, tensor
    by tensor; a collective)."""
    for hf in fsdp_buckets(engine, bucket_bytes, stats):
        yield from bucket_tensors(hf, stats, engine.arch.tie_word_embeddings)
