"""Weights from the trainer's workers to rollout engines on other workers (split placement).

The colocated reshard (hpcrl.engines.reshard) moves weights inside one torch.distributed world. With
the split placement the trainer ranks and the rollout ranks are two worlds, joined by the *bridge*:
an MPI communicator of trainer rank 0 and every rollout rank (hpcrl.workers.split builds it).

    trainer ranks (Megatron TP x PP x DP)             rollout ranks (vLLM, rollout TP x DP)
    owners of a bucket's TP parts --send--> rank 0 --bridge broadcast--> every rollout rank
                                      (convert to HF)                     (reload_weights, in place)

- The same buckets as the colocated reshard (`plan_buckets`: whole conversion units of one stage, at
  most `bucket_bytes`). For each bucket, the TP parts of DP replica 0 go to trainer rank 0, which
  converts them to HF names and layouts; only one bucket is alive there at a time, so no rank ever
  holds the whole model beyond its own shard.
- Rank 0 broadcasts the HF bucket over the bridge (one flat buffer per dtype, after a small header
  of names and shapes). Each rollout rank receives every tensor once: with rollout TP 1 exactly its
  engine's weights (the minimum). With rollout TP > 1 a rank also receives the parts its TP peers
  keep, because vLLM's reload path takes whole HF tensors and slices its own part.
- With LoRA the shard merges each adapted weight when it is read (`MergedShard`), as in the
  colocated reshard.
- On GPUs the bridge is MPI, so a bucket is staged through host memory on both ends (NCCL between
  the two worlds is not built yet).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.engines.megatron.convert import megatron_to_hf_partial
from hpcrl.engines.megatron.engine import MegatronEngine
from hpcrl.engines.reshard import ReshardStats, _Live, _owner, plan_buckets


def _byte_view(t: torch.Tensor) -> Any:
    """A flat CPU tensor as the uint8 numpy array MPI reads or fills (bf16 has no numpy dtype)."""
    from mpi4py import MPI

    return [t.view(torch.uint8).numpy(), MPI.BYTE]


def send_to_rollout(engine: MegatronEngine, bridge: Any, bucket_bytes: int = 64 << 20) -> ReshardStats:
    """Send the trainer's current weights to the rollout ranks (collective over the trainer's
    world; trainer rank 0 is also the root of the bridge broadcasts)."""
    stats = ReshardStats(bucket_bytes=bucket_bytes)
    dist.barrier()
    t0 = time.perf_counter()
    buckets = plan_buckets(engine, bucket_bytes)
    own = engine.megatron_shard()  # with LoRA: merges each adapted weight when read
    rank = dist.get_rank()
    device = next(engine.model.parameters()).device
    live = _Live()
    for b in buckets:
        stats.model_bytes += b.bytes_per_tp_rank * engine.tp_size
        stats.largest_bucket_bytes = max(stats.largest_bucket_bytes, b.bytes_per_tp_rank * engine.tp_size)
        stats.largest_unit_bytes = max(stats.largest_unit_bytes, b.largest_unit_bytes)
        parts: list[dict[str, torch.Tensor]] = []
        for tp in range(engine.tp_size):
            src = _owner(engine, tp, 0, b.stage)
            if rank == src == 0:
                parts.append({k: own[k].detach() for k in b.names})
            elif rank == src:
                for _, idx in b.by_dtype():
                    flat = torch.cat([own[b.names[i]].detach().reshape(-1) for i in idx])
                    dist.send(flat, dst=0)
                    stats.bytes_sent_as_root += flat.numel() * flat.element_size()
            elif rank == 0:
                part: dict[str, torch.Tensor] = {}
                for dtype, idx in b.by_dtype():
                    sizes = [int(torch.Size(b.shapes[i]).numel()) for i in idx]
                    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
                    live.add(flat.numel() * flat.element_size())
                    dist.recv(flat, src=src)
                    for i, v in zip(idx, flat.split(sizes), strict=True):
                        part[b.names[i]] = v.view(b.shapes[i])
                parts.append({k: part[k] for k in b.names})
        if rank != 0:
            continue
        hf = megatron_to_hf_partial(engine.arch, parts, b.stage, engine.pp_size, engine.spec)
        del parts
        # tied embeddings: vLLM on CPU keeps its own output layer, which the receiver fills from the
        # embedding it got (sent once)
        aliases = ([("lm_head.weight", "model.embed_tokens.weight")]
                   if "model.embed_tokens.weight" in hf and engine.arch.tie_word_embeddings else [])
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, t in hf.items():
            by_dtype.setdefault(t.dtype, []).append(name)
        groups = [(str(dtype).removeprefix("torch."), [(n, tuple(hf[n].shape)) for n in names])
                  for dtype, names in sorted(by_dtype.items(), key=lambda kv: str(kv[0]))]
        bridge.bcast({"groups": groups, "aliases": aliases}, root=0)
        for _, names in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            flat = torch.cat([hf[n].detach().reshape(-1) for n in names]).cpu()
            live.add(flat.numel() * flat.element_size())
            bridge.Bcast(_byte_view(flat), root=0)
            stats.bytes_sent_as_root += flat.numel() * flat.element_size()
        stats.buckets += 1
        stats.tensors_pushed += len(hf) + len(aliases)
        live.drop(live.now)
    if rank == 0:
        bridge.bcast(None, root=0)  # the end of the stream
    dist.barrier()
    stats.seconds = time.perf_counter() - t0
    stats.peak_extra_bytes = live.peak
    return stats


def receive_from_trainer(rollout: Any, bridge: Any) -> ReshardStats:
    """Receive the trainer's weights on a rollout rank and load them into its engine in place, one
    bucket alive at a time (vLLM consumes the stream inside one reload)."""
    stats = ReshardStats()
    t0 = time.perf_counter()
    live = _Live()

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            header = bridge.bcast(None, root=0)
            if header is None:
                return
            stats.buckets += 1
            received: dict[str, torch.Tensor] = {}
            for dtype_name, entries in header["groups"]:
                sizes = [int(torch.Size(shape).numel()) for _, shape in entries]
                flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype_name))
                nbytes = flat.numel() * flat.element_size()
                live.add(nbytes)
                bridge.Bcast(_byte_view(flat), root=0)
                stats.bytes_received += nbytes
                for (name, shape), v in zip(entries, flat.split(sizes), strict=True):
                    received[name] = v.view(shape)
            for alias, name in header["aliases"]:
                received[alias] = received[name]
            stats.tensors_pushed += len(received)
            for name in list(received):
                yield name, received.pop(name)
            live.drop(live.now)

    rollout.load_weights(stream())
    stats.seconds = time.perf_counter() - t0
    # what this rank's engine needs: every HF tensor once (vLLM slices its TP part from it)
    stats.min_bytes_received = stats.model_bytes = stats.bytes_received
    stats.peak_extra_bytes = live.peak
    return stats
