"""Weights from the Megatron training layout (TP x PP, DP replicas) into the colocated vLLM engines.

`reshard_to_rollout` streams the model, bucket by bucket, from the ranks that own it to every rank
whose rollout engine needs it, and converts each bucket to HF names and layouts on arrival:

- A bucket is a run of whole conversion units of one pipeline stage (the embedding, one decoder
  layer, the final norm with the output layer) of at most `bucket_bytes` (a unit bigger than that
  is a bucket of its own). Layers stay whole because Megatron fuses q/k/v and gate/up.
- For each bucket, each TP rank's part is broadcast once over the world from one replica of the
  owning stage (replicas take turns by bucket, spreading the sending). That is exactly the data a
  receiving rank lacks: vLLM's supported reload path takes HF tensors and slices its own TP part,
  so with any rollout TP every rank needs every full tensor; a rank never receives its own part
  from itself.
- The bucket is converted (`megatron_to_hf_partial`) and handed to vLLM's `reload_weights` through
  a lazy iterator, then dropped: one bucket (plus its converted copy) is alive at a time, and no
  rank holds the whole model in the Megatron layout beyond its own shard.
- Expert parallel (MoE): an MoE layer's experts are split over the EP ranks (carved from the DP x CP
  replicas), so a layer is several units: its attention, norms and router (held by every replica),
  and the experts of each EP rank (held by the replicas of that EP rank), each sent by a replica that
  holds it. Expert tensors travel under their global index (`global_name`).
- With tied embeddings `lm_head.weight` is pushed too (vLLM on CPU keeps a separate packed output
  layer); the last stage's copy of the embedding is not sent (it equals stage 0's).

`naive_reshard` is the baseline of the benchmark: every stage's full HF tensors are gathered on
world rank 0, broadcast as one pickled dict, and reloaded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.engines.megatron.convert import expert_of, global_name, local_name, megatron_to_hf_partial
from hpcrl.engines.megatron.engine import MegatronEngine


@dataclass
class ReshardStats:
    """What one rank did during one weight sync (bytes are tensor payload bytes)."""

    seconds: float = 0.0
    buckets: int = 0
    tensors_pushed: int = 0
    bytes_received: int = 0
    bytes_sent_as_root: int = 0  # payload of the broadcasts this rank was the root of
    min_bytes_received: int = 0  # what this rank lacks: the model minus its own shard
    peak_extra_bytes: int = 0  # largest sum of live transfer + conversion buffers
    model_bytes: int = 0
    bucket_bytes: int = 0  # the configured bound
    largest_bucket_bytes: int = 0  # above the bound only when one unit (a layer, the embedding) is
    largest_unit_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class _Live:
    """Bytes of the buffers a sync holds right now, and the most it ever held."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def drop(self, n: int) -> None:
        self.now -= n


def _unit_of(name: str, holder: int = -1) -> tuple[int, int, int]:
    """Sort key of a Megatron tensor's conversion unit: embedding, layers in order (with EP: a layer's
    shared part, then each EP rank's experts: `holder`), final."""
    if name.startswith("embedding."):
        return (0, 0, -1)
    if name.startswith("decoder.layers."):
        return (1, int(name.split(".")[2]), holder)
    return (2, 0, -1)


@dataclass(frozen=True)
class _Bucket:
    stage: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # of one TP rank's part (the same on every TP rank)
    # A bf16 model can hold fp32 tensors (megatron's torch-norm fallback keeps norms in fp32 on
    # CPU), so each dtype of a bucket travels as its own flat buffer.
    dtypes: tuple[torch.dtype, ...]
    bytes_per_tp_rank: int
    largest_unit_bytes: int  # full size (all TP parts) of its largest conversion unit
    holder: int = -1  # the EP rank whose replicas hold it (experts under expert parallel); -1: every replica

    def by_dtype(self) -> list[tuple[torch.dtype, list[int]]]:
        """(dtype, indices into names) of each flat buffer, in a fixed order."""
        groups: dict[torch.dtype, list[int]] = {}
        for i, d in enumerate(self.dtypes):
            groups.setdefault(d, []).append(i)
        return sorted(groups.items(), key=lambda kv: str(kv[0]))


def plan_buckets(engine: MegatronEngine, bucket_bytes: int) -> list[_Bucket]:
    """The same bucket list on every rank, from every stage's shard metadata (one small exchange)."""
    mine = {global_name(k, engine.experts_offset): v for k, v in engine.shard_layout().items()}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (engine.pp_rank, engine.tp_rank, mine))
    meta: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    for pp, tp, m in per_rank:
        if tp == 0:  # (with EP the replicas of a stage hold other experts: the union)
            meta.setdefault(pp, {}).update(m)
    tp_size = engine.tp_size
    per_ep = engine.arch.num_experts // engine.ep_size if engine.ep_size > 1 else 0

    def holder(name: str) -> int:
        e = expert_of(name)
        return -1 if e is None or not per_ep else e // per_ep
    buckets: list[_Bucket] = []
    for stage in range(engine.pp_size):
        names = [k for k in meta[stage] if not (engine.arch.tie_word_embeddings and k == "output_layer.weight")]
        units: dict[tuple[int, int, int], list[str]] = {}
        for k in names:
            units.setdefault(_unit_of(k, holder(k)), []).append(k)
        groups: list[list[str]] = []
        unit_max: list[int] = []
        holders: list[int] = []
        cur_bytes = 0
        for key in sorted(units):
            unit = sorted(units[key])
            ub = sum(int(torch.Size(meta[stage][k][0]).numel()) * meta[stage][k][1].itemsize
                     for k in unit) * tp_size
            # a bucket's parts come from one set of replicas: a new one where the holder changes
            if not groups or cur_bytes + ub > bucket_bytes or holders[-1] != key[2]:
                groups.append([])
                unit_max.append(0)
                holders.append(key[2])
                cur_bytes = 0
            groups[-1].extend(unit)
            unit_max[-1] = max(unit_max[-1], ub)
            cur_bytes += ub
        for group, umax, held_by in zip(groups, unit_max, holders, strict=True):
            shapes = tuple(meta[stage][k][0] for k in group)
            dtypes = tuple(meta[stage][k][1] for k in group)
            nbytes = sum(int(torch.Size(s).numel()) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
            buckets.append(_Bucket(stage, tuple(group), shapes, dtypes, nbytes, umax, held_by))
    return buckets


def _owner(engine: MegatronEngine, tp: int, dp: int, pp: int) -> int:
    """World rank of (tp, replica, pp) in megatron's order (TP fastest, then CP, DP, PP): `dp` counts
    the DP x CP replicas of a stage (CP ranks hold the same weights as their DP rank's)."""
    return tp + engine.tp_size * (dp + engine.replicas * pp)


_GROUPS: dict[tuple[int, int, int, int], dict[tuple[int, int, int, bool], Any]] = {}


def _holders(engine: MegatronEngine, holder: int) -> list[int]:
    """The replicas (DP x CP indices) of a stage that hold a bucket: all, or those of EP rank `holder`
    (megatron's expert ranks: TP fastest, then EP, so replica q is EP rank q % EP)."""
    if holder < 0:
        return list(range(engine.replicas))
    return [q for q in range(engine.replicas) if q % engine.ep_size == holder]


def _receiver_groups(engine: MegatronEngine) -> dict[tuple[int, int, int, bool], Any]:
    """For each owner (tp, replica, pp) and kind of part (experts or the rest): a process group of the
    owner and every rank that lacks the part. The other replicas holding it stay out of the broadcast
    (each rank then receives exactly what it lacks). Built once per layout; collective on first use."""
    key = (engine.tp_size, engine.pp_size, engine.replicas, engine.ep_size)
    if key not in _GROUPS:
        groups: dict[tuple[int, int, int, bool], Any] = {}
        world = dist.get_world_size()
        made: dict[tuple[int, ...], Any] = {}
        for experts in ((False, True) if engine.ep_size > 1 else (False,)):
            for pp in range(engine.pp_size):
                for dp in range(engine.replicas):
                    holders = _holders(engine, dp % engine.ep_size if experts else -1)
                    for tp in range(engine.tp_size):
                        owner = _owner(engine, tp, dp, pp)
                        twins = {_owner(engine, tp, d, pp) for d in holders} - {owner}
                        ranks = tuple(r for r in range(world) if r not in twins)
                        # every rank takes part in creating every group (torch.distributed's rule)
                        if twins and ranks not in made:
                            made[ranks] = dist.new_group(list(ranks))
                        groups[(tp, dp, pp, experts)] = made[ranks] if twins else dist.group.WORLD
        _GROUPS[key] = groups
    return _GROUPS[key]


def stream_hf_weights(engine: MegatronEngine, bucket_bytes: int, stats: ReshardStats,
                      buckets: list[_Bucket] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of the whole model, produced bucket by bucket (a collective: every
    rank must consume the iterator to its end, in the same order)."""
    buckets = buckets if buckets is not None else plan_buckets(engine, bucket_bytes)
    groups = _receiver_groups(engine)
    # with LoRA a mapping that merges each adapted weight when read: a bucket's worth at a time
    own = engine.megatron_shard()
    offset = engine.experts_offset  # this rank's experts under their global names
    live = _Live()
    rank = dist.get_rank()
    stats.bucket_bytes = bucket_bytes
    for b in buckets:
        stats.model_bytes += b.bytes_per_tp_rank * engine.tp_size
        stats.largest_bucket_bytes = max(stats.largest_bucket_bytes, b.bytes_per_tp_rank * engine.tp_size)
        stats.largest_unit_bytes = max(stats.largest_unit_bytes, b.largest_unit_bytes)
        if b.stage != engine.pp_rank or b.holder not in (-1, engine.ep_rank):
            stats.min_bytes_received += b.bytes_per_tp_rank * engine.tp_size
        else:
            stats.min_bytes_received += b.bytes_per_tp_rank * (engine.tp_size - 1)
    for i, b in enumerate(buckets):
        holders = _holders(engine, b.holder)
        src_dp = holders[i % len(holders)]  # the replicas holding the bucket take turns as the sender
        parts: list[dict[str, torch.Tensor]] = []
        for tp in range(engine.tp_size):
            src = _owner(engine, tp, src_dp, b.stage)
            group = groups[(tp, src_dp, b.stage, b.holder >= 0)]
            if b.stage == engine.pp_rank and tp == engine.tp_rank and b.holder in (-1, engine.ep_rank):
                # this rank holds the part (as the sender or as a replica of it): no copy needed
                mine = {k: own[local_name(k, offset)].detach() for k in b.names}
                if rank == src:
                    for _, idx in b.by_dtype():
                        flat = torch.cat([mine[b.names[i]].reshape(-1) for i in idx])
                        live.add(flat.numel() * flat.element_size())
                        dist.broadcast(flat, src=src, group=group)
                        stats.bytes_sent_as_root += flat.numel() * flat.element_size()
                parts.append(mine)
                continue
            part: dict[str, torch.Tensor] = {}
            for dtype, idx in b.by_dtype():
                sizes = [int(torch.Size(b.shapes[i]).numel()) for i in idx]
                flat = torch.empty(sum(sizes), dtype=dtype)
                live.add(flat.numel() * flat.element_size())
                dist.broadcast(flat, src=src, group=group)
                stats.bytes_received += flat.numel() * flat.element_size()
                for i, v in zip(idx, flat.split(sizes), strict=True):
                    part[b.names[i]] = v.view(b.shapes[i])
            parts.append({k: part[k] for k in b.names})
        hf = megatron_to_hf_partial(engine.arch, parts, b.stage, engine.pp_size, engine.spec)
        # conversion copies what it concatenates or splits; views of the inputs cost nothing
        inputs = {t.untyped_storage().data_ptr() for p in parts for t in p.values()}
        converted = sum(t.numel() * t.element_size() for t in hf.values()
                        if t.untyped_storage().data_ptr() not in inputs)
        live.add(converted)
        del parts
        yield from bucket_tensors(hf, stats, engine.arch.tie_word_embeddings)
        live.drop(live.now)
    stats.peak_extra_bytes = live.peak


def bucket_tensors(hf: dict[str, torch.Tensor], stats: ReshardStats, tied: bool
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """One bucket's HF tensors, each dropped from `hf` as it is handed over; a tied embedding also as
    lm_head.weight (vLLM on CPU keeps a separate packed output layer: it takes the tied copy too)."""
    if tied and "model.embed_tokens.weight" in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    stats.buckets += 1
    stats.tensors_pushed += len(hf)
    for name in list(hf):
        yield name, hf.pop(name)


def timed(tensors: Iterator[tuple[str, torch.Tensor]], stats: ReshardStats) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, with the time spent producing them (gathers, broadcasts, conversion; not the
    rollout engine's loading) added up in stats.extra["transfer_convert_s"]."""
    spent = 0.0
    try:
        while True:
            t0 = time.perf_counter()
            try:
                item = next(tensors)
            except StopIteration:
                return
            finally:
                spent += time.perf_counter() - t0
            yield item
    finally:
        stats.extra["transfer_convert_s"] = stats.extra.get("transfer_convert_s", 0.0) + spent


def reshard_to_rollout(engine: MegatronEngine, rollout: Any, bucket_bytes: int = 64 << 20) -> ReshardStats:
    """Push the trainer's current weights into this rank's rollout engine, in place (collective).
    The FSDP engine's weights come through its `stream_rollout_weights` (hpcrl.engines.fsdp.weights)."""
    stats = ReshardStats()
    dist.barrier()  # time the sync, not the wait for the slowest rank's previous work
    t0 = time.perf_counter()
    # the FSDP engine streams its own (hpcrl.engines.fsdp.weights)
    stream = getattr(engine, "stream_rollout_weights", None) or (lambda *a: stream_hf_weights(engine, *a))
    rollout.load_weights(timed(stream(bucket_bytes, stats), stats))
    dist.barrier()
    stats.seconds = time.perf_counter() - t0
    return stats


def naive_reshard(engine: MegatronEngine, rollout: Any) -> ReshardStats:
    """Baseline: gather the full HF state dict on world rank 0, broadcast it whole, reload it all."""
    if getattr(engine, "kind", "megatron") == "fsdp":
        raise ValueError("naive_reshard is the Megatron engine's benchmark baseline; the FSDP engine has none")
    stats = ReshardStats()
    dist.barrier()
    t0 = time.perf_counter()
    stage = engine.export_hf_stage()  # TP rank 0 of each stage gets the stage's HF tensors
    rank = dist.get_rank()
    sender = engine.tp_rank == 0 and engine.replica_rank == 0
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(stage if sender else None, gathered, dst=0)
    full: dict[str, torch.Tensor] = {}
    if rank == 0:
        for part in gathered or []:
            if part:
                full.update(part)
        stats.bytes_received = sum(t.numel() * t.element_size() for part in (gathered or [])[1:] if part
                                   for t in part.values())
    holder = [full]
    dist.broadcast_object_list(holder, src=0)
    full = holder[0]
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    stats.model_bytes = nbytes
    if rank != 0:
        stats.bytes_received = nbytes
    # the stage dict, the gathered dicts (rank 0) and the broadcast dict are alive together
    stats.peak_extra_bytes = nbytes * (2 if rank == 0 else 1) + sum(
        t.numel() * t.element_size() for t in (stage or {}).values())
    if engine.arch.tie_word_embeddings:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    stats.tensors_pushed = len(full)
    rollout.load_weights(list(full.items()))
    dist.barrier()
    stats.seconds = time.perf_counter() - t0
    return stats
