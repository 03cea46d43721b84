"""The actor and its rollout engine in the same worker processes (colocated hybrid engine).

Each worker holds its Megatron shard (training layout TP x PP x DP) and a vLLM engine (rollout
layout: rollout TP, rollout DP = workers / rollout TP; vLLM groups consecutive ranks). The two
layouts are independent; `reshard_to_rollout` moves the trainer's weights into the engines in
place (hpcrl.engines.reshard).

Controller side::

    actor = WorkerGroup(ActorRolloutRole, init_kwargs={"cfg": cfg})
    actor.reshard_to_rollout()
    batch = generate(actor, prompt_ids, SamplingSettings(n=4, temperature=1.0, max_new_tokens=64))
    gap = logprob_gap(batch["rollout_logprob"], actor.compute_logprob(batch), batch["response_mask"])

Generation goes out with PER_RANK dispatch because the group's DP layout (the one DP_SPLIT uses)
is the trainer's, not the rollout's: `generate` cuts the prompts by rollout DP rank itself.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hpcrl.config.derived import rollout_world_size
from hpcrl.controller import Collect, Dispatch, register
from hpcrl.controller.batch import Batch, even_sizes
from hpcrl.engines.reshard import naive_reshard, reshard_to_rollout
from hpcrl.engines.vllm.engine import CPU_BLOCK_SIZE, Completion, RolloutEngine, SamplingSettings
from hpcrl.workers.megatron_roles import MegatronRole
from hpcrl.workers.memory import return_free_heap

log = logging.getLogger(__name__)


def tokens_after_prompt(rollout: dict[str, Any]) -> int:
    """The most tokens a sample holds after its prompt: max_new_tokens, or with multi-turn rollout
    the per-sample budget of model and tool tokens (rollout.multi_turn.max_total_tokens)."""
    mt = rollout.get("multi_turn") or {}
    return max(rollout["max_new_tokens"], mt["max_total_tokens"]) if mt.get("enable") else rollout["max_new_tokens"]


def cpu_kv_cache_gib_needed(arch: Any, cfg: dict[str, Any], dtype_bytes: int) -> float:
    """KV cache (GiB per worker) that holds, at full length (max_prompt_length + tokens_after_prompt,
    rounded up to whole KV blocks), every sample one rollout replica generates in a step,
    or one validation batch's share, with a quarter to spare; at least 1/16 GiB. Too small only
    costs time (vLLM queues the requests that do not fit), too big only memory."""
    r, d = cfg["rollout"], cfg["data"]
    replicas = max(rollout_world_size(cfg) // r["tensor_parallel"], 1)
    seqs = max(-(-d["train_batch_size"] * r["n"] // replicas), -(-d["val_batch_size"] // replicas))
    block = CPU_BLOCK_SIZE
    tokens = seqs * -(-(d["max_prompt_length"] + tokens_after_prompt(r)) // block) * block
    kv_heads = -(-arch.num_kv_heads // r["tensor_parallel"])
    per_token = arch.num_layers * 2 * kv_heads * arch.head_dim * dtype_bytes
    return max(1.25 * tokens * per_token / (1 << 30), 1 / 16)


def read_rollout_arch(cfg: dict[str, Any], model_path: str) -> Any:
    """The model's shape for a rollout engine of its own (split placement, rollout pools): the HF
    config's with the FSDP engine (any family transformers builds), else Megatron's reader (which
    refuses a family it does not convert)."""
    if (cfg.get("actor") or {}).get("engine") == "fsdp":
        from hpcrl.engines.fsdp.engine import read_hf_arch

        return read_hf_arch(model_path)
    from hpcrl.engines.megatron.model import read_arch

    return read_arch(model_path)


def build_rollout_engine(cfg: dict[str, Any], model_path: str, arch: Any, dtype: torch.dtype) -> RolloutEngine:
    """This worker's vLLM engine for a resolved config (rollout section; KV cache sized by
    `cpu_kv_cache_gib_needed` unless rollout.cpu_kv_cache_gib is set)."""
    r = cfg["rollout"]
    engine_kwargs = dict(r.get("engine_kwargs") or {})
    # long enough for a prompt and its completion, and for teacher-forced checks of both
    engine_kwargs.setdefault("max_model_len", min(arch.max_position_embeddings,
                                                  cfg["data"]["max_prompt_length"] + tokens_after_prompt(r)))
    kv_gib = r["cpu_kv_cache_gib"]
    if kv_gib is None:
        kv_gib = cpu_kv_cache_gib_needed(arch, cfg, dtype.itemsize)
    return RolloutEngine(model_path, tensor_parallel=r["tensor_parallel"], dtype=dtype, seed=cfg["trainer"]["seed"],
                         cpu_kv_cache_gib=kv_gib, gpu_memory_utilization=r["gpu_memory_utilization"],
                         engine_kwargs=engine_kwargs, routing_replay=bool(r.get("routing_replay", False)))


# generation spans a worker keeps between two `generation_spans` calls (a step makes a few)
MAX_GENERATION_SPANS = 256


class RolloutMethods:
    """What the controller calls on a worker's rollout engine (`self.rollout`), whether the engine
    shares the worker with the actor (ActorRolloutRole) or has it alone (hpcrl.workers.split)."""

    rollout: RolloutEngine | None

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def rollout_coords(self) -> tuple[int, int]:
        """(rollout DP rank, rollout TP rank) of this worker."""
        return (self.rollout.dp_rank, self.rollout.tp_rank)

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.ALL)
    def generate_shard(self, prompts: list[list[int]], sampling: SamplingSettings,
                       first_index: int) -> list[list[Completion]] | None:
        """Completions for this rollout replica's prompts; only rollout TP rank 0 sends them back."""
        start = time.time()
        out = self.rollout.generate(prompts, sampling, first_index) if prompts else []
        self._spans().append([round(start, 4), round(time.time(), 4)])
        return out if self.rollout.tp_rank == 0 else None

    def _spans(self) -> deque[list[float]]:
        # bounded: only the split placement's controller drains it every step; a colocated run
        # never asks, and a run of days must not grow a list by every generate call
        if not hasattr(self, "_generation_spans"):
            self._generation_spans: deque[list[float]] = deque(maxlen=MAX_GENERATION_SPANS)
        return self._generation_spans

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def generation_spans(self) -> list[list[float]]:
        """[start, end] (unix time) of each `generate_shard` on this rank since the last call (the
        last MAX_GENERATION_SPANS of them): when the engine was busy, for timelines of generation
        running beside training."""
        spans = list(self._spans())
        self._spans().clear()
        return spans

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.ALL)
    def generate_each_shard(self, requests: list[tuple[list[int], int | None, int]],
                            sampling: SamplingSettings) -> list[Completion] | None:
        """One completion per (token ids, seed, max new tokens) request of this rollout replica;
        only rollout TP rank 0 sends them back."""
        start = time.time()
        out = (self.rollout.generate_each([r[0] for r in requests], sampling, [r[1] for r in requests],
                                          [r[2] for r in requests]) if requests else [])
        self._spans().append([round(start, 4), round(time.time(), 4)])
        return out if self.rollout.tp_rank == 0 else None

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.ALL)
    def rollout_logprob_shard(self, seqs: list[list[int]]) -> list[torch.Tensor] | None:
        """Teacher-forced log-probs under the rollout engine (label-aligned, one tensor a sequence)."""
        out = self.rollout.prompt_logprobs(seqs) if seqs else []
        return out if self.rollout.tp_rank == 0 else None

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def close_rollout(self, final: bool = False) -> None:
        """Shut this group's vLLM engines down (vLLM's parallel state is per process: another
        group's engine can only be built after this). final: the run ends, no engine follows
        (RolloutEngine.close)."""
        if self.rollout is not None:
            self.rollout.close(final=final)
            self.rollout = None

    def close(self) -> None:
        self.close_rollout()


class ActorRolloutRole(RolloutMethods, MegatronRole):
    """A Megatron actor rank with a colocated vLLM engine built from the same model."""

    def __init__(self, cfg: dict[str, Any], role: str = "actor", model_path: str | None = None):
        super().__init__(cfg, role, model_path)
        self.rollout_cfg = cfg["rollout"]
        # actor.offload: the trainer's weights, gradients and optimizer state go to host memory while
        # vLLM generates (GPU only; on CPU there is nowhere else to put them)
        self.offload_trainer = bool(cfg["actor"]["offload"])
        self.rollout = build_rollout_engine(cfg, self.model_path, self.engine.arch, self.engine.options.dtype)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def reshard_to_rollout(self, bucket_mb: float | None = None) -> dict[str, Any]:
        """Push the actor's current weights into the rollout engines in place; per-rank statistics."""
        mb = self.rollout_cfg["weight_bucket_mb"] if bucket_mb is None else bucket_mb
        return reshard_to_rollout(self.engine, self.rollout, int(mb * (1 << 20))).as_dict()

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def enter_rollout(self, bucket_mb: float | None = None) -> dict[str, Any]:
        """Training -> rollout phase. The order matters for peak memory: wake vLLM's weight
        memory, push the actor's weights into it, move the trainer to host memory (GPU), and only
        then give vLLM its KV cache back (with actor.offload). The update's freed activations are
        handed back to the kernel first, not held beside the woken weights."""
        returned = return_free_heap()
        self.rollout.wake_up(["weights"])
        stats = ActorRolloutRole.reshard_to_rollout(self, bucket_mb)
        stats["trainer_offloaded"] = self.offload_trainer and self.engine.offload()
        self.rollout.wake_up(["kv_cache"])
        stats["heap_returned_bytes"] = returned
        return stats

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def enter_training(self) -> dict[str, bool]:
        """Rollout -> training phase: vLLM releases its memory (KV cache freed, weights to host on
        GPU, dropped on CPU: hpcrl.engines.vllm.cpu_sleep), the trainer comes back onto the GPU."""
        slept = self.rollout.sleep()
        return {"rollout_slept": slept, "trainer_onloaded": self.offload_trainer and self.engine.onload(),
                "rollout_released_gb": sum(self.rollout.released.values()) / 1e9}

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def naive_reshard(self) -> dict[str, Any]:
        """The benchmark's baseline weight sync (full state dict through rank 0)."""
        return naive_reshard(self.engine, self.rollout).as_dict()


def _per_rank(group: Any, items: Sequence[Any], coords: list[tuple[int, int]] | None = None
              ) -> tuple[list[list[Any]], list[int], list[tuple[int, int]]]:
    """Cut items by rollout DP rank: each worker gets its replica's contiguous slice (`coords`: the
    group's rollout_coords(), asked for when not given)."""
    coords = coords or group.rollout_coords()
    dp_size = 1 + max(c[0] for c in coords)
    sizes = even_sizes(len(items), dp_size)
    starts = [sum(sizes[:d]) for d in range(dp_size)]
    shards = [list(items[starts[d]:starts[d] + sizes[d]]) for d in range(dp_size)]
    return [shards[d] for d, _ in coords], [starts[d] for d, _ in coords], coords


def _in_dp_order(results: list[Any], coords: list[tuple[int, int]]) -> list[Any]:
    """Concatenate the TP-rank-0 results of every replica, replica by replica (= input order)."""
    firsts = sorted((d, i) for i, (d, t) in enumerate(coords) if t == 0)
    return [x for _, i in firsts for x in results[i]]


def generate(group: Any, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> Batch:
    """Sample `sampling.n` completions per prompt on the rollout engines of a group with
    RolloutMethods (ActorRolloutRole, or the split placement's RolloutRole).

    Returns the wire format (hpcrl.workers.batching), sample j of prompt i in row i * n + j:
    input_ids / attention_mask / response_mask [B*n, S] right-padded prompt + completion,
    rollout_logprob [B*n, S] token-aligned (0 outside the completion), prompt_index [B*n]."""
    return start_generate(group, prompts, sampling)()


def start_generate(group: Any, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> Callable[[], Batch]:
    """`generate` without waiting: the engines start at once, and the returned function waits for
    their completions and assembles the batch (the controller meanwhile drives other groups)."""
    prompts = [list(map(int, p)) for p in prompts]
    shards, starts, coords = _per_rank(group, prompts)
    future = group.generate_shard.future(shards, [sampling] * len(shards), starts)
    return lambda: assemble_batch(prompts, _in_dp_order(future.result(), coords))


def assemble_batch(prompts: list[list[int]], per_prompt: list[list[Completion]]) -> Batch:
    """The wire-format batch (`generate`'s) of prompts and their completions, sample j of prompt i in
    row i * n + j."""
    rows = [(i, prompts[i], c) for i, samples in enumerate(per_prompt) for c in samples]
    width = max(len(p) + len(c.token_ids) for _, p, c in rows)
    n = len(rows)
    ids = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    resp = torch.zeros(n, width)
    lp = torch.zeros(n, width)
    for r, (_, p, c) in enumerate(rows):
        end = len(p) + len(c.token_ids)
        ids[r, :end] = torch.tensor(p + c.token_ids)
        attn[r, :end] = 1
        resp[r, len(p):end] = 1
        lp[r, len(p):end] = torch.tensor(c.logprobs)
    batch = Batch({"input_ids": ids, "attention_mask": attn, "response_mask": resp, "rollout_logprob": lp,
                   "prompt_index": torch.tensor([i for i, _, _ in rows])})
    if rows and rows[0][2].routed_experts is not None:  # routing replay: [B*n, S, layers, k], -1 unknown
        routes = torch.full((n, width, *rows[0][2].routed_experts.shape[1:]), -1, dtype=torch.int16)
        for r, (_, _, c) in enumerate(rows):
            routes[r, :c.routed_experts.shape[0]] = c.routed_experts
        batch["routed_experts"] = routes
    return batch


def generate_each(group: Any, requests: Sequence[Sequence[int]], sampling: SamplingSettings,
                  seeds: Sequence[int | None], max_new_tokens: Sequence[int]) -> list[Completion]:
    """One completion per request (token ids, its own seed and token limit) on the rollout engines of
    an ActorRolloutRole group, in request order: the requests are cut over the rollout replicas as
    `generate` cuts prompts (one batched vLLM call per replica). A turn of the multi-turn loop."""
    items = [(list(map(int, r)), s, int(m)) for r, s, m in zip(requests, seeds, max_new_tokens, strict=True)]
    shards, _, coords = _per_rank(group, items)
    return _in_dp_order(group.generate_each_shard(shards, [sampling] * len(shards)), coords)


class PendingCompletions:
    """`generate_each` in flight: `done()` polls without blocking, `result()` waits; completions in
    request order."""

    def __init__(self, future: Any, coords: list[tuple[int, int]]):
        self._future, self._coords = future, coords

    def done(self) -> bool:
        return bool(self._future.done())

    def result(self) -> list[Completion]:
        return _in_dp_order(self._future.result(), self._coords)


def start_generate_each(group: Any, requests: Sequence[Sequence[int]], sampling: SamplingSettings,
                        seeds: Sequence[int | None], max_new_tokens: Sequence[int],
                        coords: list[tuple[int, int]] | None = None) -> PendingCompletions:
    """`generate_each` without waiting (the fully asynchronous rollout's segments, hpcrl.trainer.stream);
    `coords` as for `_per_rank`."""
    items = [(list(map(int, r)), s, int(m)) for r, s, m in zip(requests, seeds, max_new_tokens, strict=True)]
    shards, _, coords = _per_rank(group, items, coords)
    return PendingCompletions(group.generate_each_shard.future(shards, [sampling] * len(shards)), coords)


def rollout_logprobs(group: Any, batch: Batch) -> torch.Tensor:
    """Teacher-forced token-aligned log-probs [B, S] of a wire-format batch under the rollout engines."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    seqs = [batch["input_ids"][i, :int(n)].tolist() for i, n in enumerate(lengths)]
    shards, _, coords = _per_rank(group, seqs)
    per_seq = _in_dp_order(group.rollout_logprob_shard(shards), coords)
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    for i, v in enumerate(per_seq):
        out[i, 1:1 + v.numel()] = v
    return out


def logprob_gap(rollout_lp: torch.Tensor, actor_lp: torch.Tensor, mask: torch.Tensor,
                step: int | None = None) -> dict[str, float]:
    """Mean and max |rollout - actor| log-prob over the masked tokens, logged (every step calls it:
    a growing gap means the rollout engine runs stale or differently computed weights)."""
    m = mask.bool()
    d = (rollout_lp.double() - actor_lp.double()).abs()[m]
    gap = {"rollout_actor_logprob_gap_mean": float(d.mean()) if d.numel() else 0.0,
           "rollout_actor_logprob_gap_max": float(d.max()) if d.numel() else 0.0}
    log.info("step %s: rollout vs actor log-prob |delta| mean %.3e max %.3e", step,
             gap["rollout_actor_logprob_gap_mean"], gap["rollout_actor_logprob_gap_max"])
    return gap
