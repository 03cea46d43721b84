"""Weights from the trainer's workers to rollout engines on other workers (split placement).

The colocated reshard (hpcrl.engines.reshard) moves weights inside one torch.distributed world. With
the split placement the trainer ranks and the rollout ranks are two worlds, joined by bridges that
hpcrl.workers.split builds: an MPI communicator of trainer rank 0 and every rollout rank, for small
headers, and per rollout TP rank r a torch.distributed group of trainer rank 0 and the rollout ranks
of TP rank r (`tp_bridges`: NCCL between GPUs, gloo on CPU, so CI runs the GPU's code path), for
the weights.

    trainer ranks (Megatron TP x PP x DP)             rollout ranks (vLLM, rollout TP x DP)
    owners of a bucket's TP parts --send--> rank 0 --bridge broadcast--> every rollout rank
                                      (convert to HF)                     (reload_weights, in place)

- The same buckets as the colocated reshard (`plan_buckets`: whole conversion units of one stage, at
  most `bucket_bytes`). For each bucket, the TP parts of DP replica 0 go to trainer rank 0, which
  converts them to HF names and layouts; only one bucket is alive there at a time, so no rank ever
  holds the whole model beyond its own shard.
- Rank 0 broadcasts a small header of names, shapes and TP slices over the MPI bridge, then the HF
  bucket, one flat buffer per dtype and rollout TP rank r, over the group of rank r, from device
  memory to device memory. A rollout rank receives only the part of each tensor its engine keeps
  (`vllm_tp_slice`: vLLM's own cut of the q/k/v, gate/up, o/down projections and the padded
  vocabulary), replicated tensors whole: its engine's weights once, the minimum. vLLM's reload
  takes whole HF tensors and cuts its part itself, so the receiver places each part into a tensor
  of the whole shape (allocated, never sent) just before vLLM reads it.
- With LoRA the shard merges each adapted weight when it is read (`MergedShard`), as in the
  colocated reshard.
- The FSDP engine (actor.engine=fsdp): every trainer rank all-gathers each bucket's full tensors
  (hpcrl.engines.fsdp.weights.fsdp_buckets, HF names already, LoRA merged), and rank 0 sends them on
  as above.
- GPU: the buffers stay on the devices (NCCL). Not run here: no machine of this project's CI has a
  GPU; CI runs the same code with gloo and CPU tensors.
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

# vLLM pads the vocabulary of its embedding and LM head to a multiple of this before splitting it over
# TP ranks (vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE)
VLLM_VOCAB_PADDING = 64


def vllm_tp_slice(name: str, shape: tuple[int, ...], arch: Any, tp_rank: int, tp_size: int
                  ) -> tuple[int, int, int] | None:
    """(dim, start, length) of an HF tensor that rank `tp_rank` of a vLLM engine of `tp_size` ranks
    reads in its reload, as vLLM 0.32's loaders cut it (model_executor/layers/linear.py,
    parameter.py, vocab_parallel_embedding.py); None: the whole tensor (replicated, an unknown name,
    or a shape that does not split evenly)."""
    if tp_size == 1 or not shape:
        return None
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    module, kind = leaf[0], leaf[-1]
    if module == "q_proj" or (module in ("gate_proj", "up_proj") and kind == "weight"):
        size = shape[0] // tp_size
        return (0, tp_rank * size, size) if shape[0] % tp_size == 0 else None
    if module in ("k_proj", "v_proj"):
        kv_heads, hd = arch.num_kv_heads, shape[0] // arch.num_kv_heads
        per_rank = max(kv_heads // tp_size, 1)  # heads a rank keeps; replicated once tp > kv heads
        replicas = max(tp_size // kv_heads, 1)
        if kv_heads % tp_size and tp_size % kv_heads:
            return None
        return (0, (tp_rank // replicas) * per_rank * hd, per_rank * hd)
    if module in ("o_proj", "down_proj") and kind == "weight" and len(shape) == 2:
        size = shape[1] // tp_size
        return (1, tp_rank * size, size) if shape[1] % tp_size == 0 else None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        vocab = shape[0]
        padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        if padded % tp_size:
            return None
        per_rank = padded // tp_size
        start = min(tp_rank * per_rank, vocab)
        return (0, start, min(start + per_rank, vocab) - start)
    return None


def _cut(t: torch.Tensor, cut: tuple[int, int, int] | None) -> torch.Tensor:
    return t if cut is None else t.narrow(*cut)


def send_to_rollout(engine: Any, bridge: Any, tp_bridges: list[Any], bucket_bytes: int = 64 << 20,
                    pools: Any = None) -> ReshardStats:
    """Send the trainer's current weights to the rollout ranks (collective over the trainer's
    world; trainer rank 0 is also the root of the bridge broadcasts). tp_bridges[r]: trainer rank 0
    and the rollout ranks of TP rank r (on trainer rank 0; its length is the rollout TP). `pools`
    (trainer rank 0): a hpcrl.pools.weights.PoolSender that gets every bucket too. `engine`: the
    Megatron engine, or the FSDP engine (hpcrl.engines.fsdp), whose ranks all-gather each bucket's
    full tensors (fsdp_buckets) for rank 0 to send."""
    stats = ReshardStats(bucket_bytes=bucket_bytes)
    dist.barrier()
    t0 = time.perf_counter()
    live = _Live()
    fsdp = getattr(engine, "kind", "megatron") == "fsdp"
    buckets = _fsdp_buckets(engine, bucket_bytes, stats, live) if fsdp else \
        _megatron_buckets(engine, bucket_bytes, stats, live)
    device = engine.device if fsdp else next(engine.model.parameters()).device
    for hf in buckets:  # rank 0 only: the other ranks run their collectives inside the iterator
        _broadcast(hf, engine.arch, device, bridge, tp_bridges, pools, stats, live)
    if dist.get_rank() == 0:
        bridge.bcast(None, root=0)  # the end of the stream
    dist.barrier()
    stats.seconds = time.perf_counter() - t0
    stats.peak_extra_bytes = live.peak
    return stats


def _megatron_buckets(engine: MegatronEngine, bucket_bytes: int, stats: ReshardStats, live: _Live
                      ) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket's HF tensors on trainer rank 0 (converted from the TP parts of DP replica 0, which
    their owners send it); nothing on the other ranks, which send their parts."""
    buckets = plan_buckets(engine, bucket_bytes)
    own = engine.megatron_shard()  # with LoRA: merges each adapted weight when read
    rank = dist.get_rank()
    device = next(engine.model.parameters()).device
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
        if rank == 0:
            yield megatron_to_hf_partial(engine.arch, parts, b.stage, engine.pp_size, engine.spec)
        del parts


def _fsdp_buckets(engine: Any, bucket_bytes: int, stats: ReshardStats, live: _Live
                  ) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket's full HF tensors on trainer rank 0 (every rank gathers them: FSDP's all-gathers)."""
    from hpcrl.engines.fsdp.weights import fsdp_buckets

    for hf in fsdp_buckets(engine, bucket_bytes, stats):
        if dist.get_rank() == 0:
            live.add(sum(t.numel() * t.element_size() for t in hf.values()))
            yield hf


def _broadcast(hf: dict[str, torch.Tensor], arch: Any, device: torch.device, bridge: Any, tp_bridges: list[Any],
               pools: Any, stats: ReshardStats, live: _Live) -> None:
    """One bucket of HF tensors from trainer rank 0 to the rollout ranks: its header over the MPI
    bridge, then per dtype and rollout TP rank r the part rank r's engine reads, as one flat buffer on
    the trainer's device, over the bridge of TP rank r; and to the rollout pools."""
    # tied embeddings: vLLM on CPU keeps its own output layer, which the receiver fills from the
    # embedding it got (sent once)
    aliases = ([("lm_head.weight", "model.embed_tokens.weight")]
               if "model.embed_tokens.weight" in hf and arch.tie_word_embeddings else [])
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in hf.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    rollout_tp = len(tp_bridges)
    cuts = {n: [vllm_tp_slice(n, tuple(t.shape), arch, r, rollout_tp) for r in range(rollout_tp)]
            for n, t in hf.items()}
    groups = [(str(dtype).removeprefix("torch."), [(n, tuple(hf[n].shape), cuts[n]) for n in names])
              for dtype, names in sorted(by_dtype.items(), key=lambda kv: str(kv[0]))]
    bridge.bcast({"groups": groups, "aliases": aliases}, root=0)
    for _, names in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        for r, tp_bridge in enumerate(tp_bridges):
            flat = torch.cat([_cut(hf[n].detach(), cuts[n][r]).reshape(-1) for n in names]).to(device)
            live.add(flat.numel() * flat.element_size())
            tp_bridge.broadcast(flat.view(torch.uint8), 0).wait()  # bytes: any dtype, any backend
            stats.bytes_sent_as_root += flat.numel() * flat.element_size()
            live.drop(flat.numel() * flat.element_size())
            del flat
    if pools is not None:
        pools.send_bucket(hf, aliases)
    stats.buckets += 1
    stats.tensors_pushed += len(hf) + len(aliases)
    live.drop(live.now)


def receive_from_trainer(rollout: Any, bridge: Any, tp_bridge: Any) -> ReshardStats:
    """Receive the trainer's weights on a rollout rank and load them into its engine in place, one
    bucket alive at a time (vLLM consumes the stream inside one reload). tp_bridge: trainer rank 0
    and the rollout ranks of this rank's TP rank."""
    stats = ReshardStats()
    t0 = time.perf_counter()
    live = _Live()
    r = rollout.tp_rank
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def whole(part: torch.Tensor, shape: tuple[int, ...], cut: tuple[int, int, int] | None) -> torch.Tensor:
        """The whole-shaped tensor vLLM's loader takes, holding this rank's part where vLLM reads it."""
        if cut is None:
            return part
        t = torch.empty(shape, dtype=part.dtype, device=part.device)
        t.narrow(*cut).copy_(part)
        return t

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            header = bridge.bcast(None, root=0)
            if header is None:
                return
            stats.buckets += 1
            received: dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, int, int] | None]] = {}
            for dtype_name, entries in header["groups"]:
                dtype = getattr(torch, dtype_name)
                part_shapes = []
                for _, shape, cuts in entries:
                    part = list(shape)
                    if cuts[r] is not None:
                        part[cuts[r][0]] = cuts[r][2]
                    part_shapes.append(tuple(part))
                    stats.model_bytes += int(torch.Size(shape).numel()) * dtype.itemsize
                sizes = [int(torch.Size(p).numel()) for p in part_shapes]
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
                nbytes = flat.numel() * flat.element_size()
                live.add(nbytes)
                tp_bridge.broadcast(flat.view(torch.uint8), 0).wait()  # bytes: any dtype, any backend
                stats.bytes_received += nbytes
                for (name, shape, cuts), part_shape, v in zip(entries, part_shapes, flat.split(sizes), strict=True):
                    received[name] = (v.view(part_shape), shape, cuts[r])
            for alias, name in header["aliases"]:
                received[alias] = received[name]
            stats.tensors_pushed += len(received)
            for name in list(received):
                yield name, whole(*received.pop(name))
            live.drop(live.now)

    rollout.load_weights(stream())
    stats.seconds = time.perf_counter() - t0
    # what this rank's engine needs: its part of every HF tensor once (the tied LM head comes as the
    # embedding's alias), which is what it received
    stats.min_bytes_received = stats.bytes_received
    stats.peak_extra_bytes = live.peak
    return stats
