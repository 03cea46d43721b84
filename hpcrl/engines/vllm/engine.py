"""One worker's vLLM engine for rollouts, in SPMD mode inside the workers' torch.distributed world.

Every worker constructs a `RolloutEngine`; vLLM's `external_launcher` backend reuses the existing
world, forms tensor-parallel groups of `tensor_parallel` consecutive ranks and treats the rest as
independent data-parallel replicas (rollout DP = world / rollout TP). The rollout layout is thus
independent of the trainer's TP/PP layout. Ranks of one rollout TP group must make the same calls
with the same prompts; replicas serve different prompts.

Why in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the trainer's weights are pushed into the engine
through `reload_weights` with a lazily filled iterator, which only works when the engine's model
lives in this process; it also starts in seconds instead of tens of seconds on CPU.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcrl.engines import no_compile_on_cpu

VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# KV block size on CPU: the smallest vLLM's CPU attention takes (multiples of 32). Prefix caching
# shares whole blocks only, so with its default of 128 no prompt shorter than 128 tokens shared
# anything between the samples of a prompt (see RolloutEngine.generate).
CPU_BLOCK_SIZE = 32


def _no_collection(generation: int = 2) -> int:
    return 0


@dataclass
class SamplingSettings:
    """What `generate` samples: n completions per prompt, with these limits."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k cut
    max_new_tokens: int = 256
    # no end of sequence (EOS or stop string) before this many tokens (vLLM's min_tokens): e.g. samples
    # of a known length to exercise long sequences with a model that would stop early
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    # Sample j of the prompt with global index i draws from its own random stream, seeded
    # seed + i * n + j: no two samples of one call share a stream, and the streams do not depend
    # on how prompts are split over replicas (reproducible, TP-consistent).
    seed: int | None = None

    @classmethod
    def from_rollout_config(cls, rollout: dict[str, Any], **overrides: Any) -> SamplingSettings:
        base = {k: rollout[k] for k in ("n", "temperature", "top_p", "top_k", "max_new_tokens", "stop")}
        base["min_new_tokens"] = int(rollout.get("min_new_tokens") or 0)
        base.update(overrides)
        return cls(**base)


@dataclass
class Completion:
    """One sampled continuation: its tokens, the log-prob of each under the distribution it was
    sampled from (vLLM's processed log-probs: after temperature, and top-k / top-p when set),
    and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    # routing replay (MoE): the experts of every position of prompt + completion [len, layers, k] int16,
    # -1 where none was computed (the last token); None unless the engine records routing
    routed_experts: torch.Tensor | None = None


SEED_SPACE = 1 << 62


def sample_seed(seed: int, prompt_index: int, sample: int, n: int) -> int:
    """Seed of sample `sample` (of n) of the prompt with global index `prompt_index`: distinct for
    every (prompt, sample) pair of one call, whatever the replica split."""
    return (seed + prompt_index * n + sample) % SEED_SPACE


def name_cpu_shm_per_engine() -> str:
    """Give vLLM's CPU shared-memory segments (TP > 1) a name unique to this engine; returns its prefix.

    vLLM names them after the distributed init method, which is always `env://` with the external
    launcher, so every job on a node used the same names (`-tp:1-[0-1]-cpushm_0`, ...). A SIGKILLed
    world leaves its segments in /dev/shm, and the next rollout world on the node then failed with
    `create shm in SHMManager failed. errno: 17`. Collective over the workers' world: rank 0 draws
    the prefix and broadcasts it, so that the ranks of a TP group agree on the name.
    """
    import torch.distributed as dist
    from vllm.distributed.device_communicators import cpu_communicator

    box = [f"hpcrl-{uuid.uuid4().hex[:12]}" if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    shm = cpu_communicator._CPUSHMDistributed
    vllm_name = getattr(shm, "_hpcrl_vllm_name", shm.make_group_name)
    shm._hpcrl_vllm_name = vllm_name
    # vLLM's own name starts with "//" (from "env://"), which shm_open skips; a "/" inside is invalid
    shm.make_group_name = staticmethod(lambda communicator: box[0] + vllm_name(communicator).lstrip("/"))
    return box[0]


class RolloutEngine:
    """A vLLM `LLM` in external-launcher (SPMD) mode on this rank."""

    def __init__(self, model_path: str, tensor_parallel: int = 1, dtype: torch.dtype = torch.float32,
                 seed: int = 0, cpu_kv_cache_gib: float = 1.0, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, engine_kwargs: dict[str, Any] | None = None,
                 routing_replay: bool = False):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("RolloutEngine needs torch.distributed initialised among the workers")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % tensor_parallel:
            raise ValueError(f"rollout TP {tensor_parallel} does not divide the {world} workers")
        # read by vLLM when the engine is built: the in-process engine. The CPU KV cache is sized in
        # bytes below (vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB only, and would override it).
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        no_compile_on_cpu()
        from vllm import LLM

        if not torch.cuda.is_available():
            name_cpu_shm_per_engine()

        kwargs: dict[str, Any] = {
            "model": model_path, "dtype": VLLM_DTYPES[dtype], "tensor_parallel_size": tensor_parallel,
            "distributed_executor_backend": "external_launcher", "seed": seed, "enforce_eager": True,
            "gpu_memory_utilization": gpu_memory_utilization,
            # log-probs of the distribution that sampled (logits / temperature), which the trainer
            # computes too: the logged rollout-vs-actor gap then compares like with like
            "logprobs_mode": "processed_logprobs",
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if not torch.cuda.is_available():
            kwargs["kv_cache_memory_bytes"] = int(cpu_kv_cache_gib * (1 << 30))
            kwargs["block_size"] = CPU_BLOCK_SIZE
            # Whole prompts only on CPU. A prompt prefilled over several engine steps (chunked
            # prefill, when a call's prompts exceed max_num_batched_tokens) has the token sampled at
            # each partial step thrown away, and vLLM rewinds the request's random generator for it
            # with Generator.set_offset, which CPU generators lack ("CPU Generator does not use
            # offset"): a seeded generate with more than 4096 prompt tokens on a replica crashed.
            kwargs["enable_chunked_prefill"] = False
        # GPU: sleep mode lets the trainer and the engine take turns with the device memory;
        # vLLM has no sleep mode on CPU, where hpcrl.engines.vllm.cpu_sleep does its part.
        if torch.cuda.is_available():
            kwargs["enable_sleep_mode"] = True
        if routing_replay:
            # every request computes its whole prompt, so every prompt token's experts are recorded: a
            # block served by the prefix cache may come from another prompt with the same opening
            # tokens (the chat template's), whose routes are not this request's to look up
            kwargs["enable_prefix_caching"] = False
        kwargs.update(engine_kwargs or {})
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        self.cpu_sleep = not torch.cuda.is_available()
        self.released: dict[str, int] = {}  # bytes the last CPU sleep freed, by kind
        self.model_path = model_path
        self.tp_size = tensor_parallel
        self.tp_rank = rank % tensor_parallel
        self.dp_rank = rank // tensor_parallel
        self.dp_size = world // tensor_parallel
        # everything alive now (torch, megatron-core, vLLM's modules, the trainer's model) is long-lived:
        # out of reach of the three full collections vLLM runs while it builds the engine (after loading
        # the weights, twice, and before freezing its own heap), ~0.7 s each on a CPU worker
        gc.freeze()
        self.llm = LLM(**kwargs)
        hf = self.llm.llm_engine.vllm_config.model_config.hf_config
        self.moe = bool(getattr(hf, "num_experts", 0) or getattr(hf, "num_local_experts", 0))
        # routing replay: every generated token's experts, recorded by hooks on the routers
        # (hpcrl.engines.vllm.routing; vLLM's own capturer needs its V2 model runner, GPU only)
        self.routing_replay = routing_replay
        if routing_replay:
            if not self.moe:
                raise ValueError(f"{model_path}: routing replay needs a mixture-of-experts model")
            from hpcrl.engines.vllm.routing import install

            self.llm.collective_rpc(install, args=(int(hf.num_experts_per_tok),))
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.prefix_caching = bool(cache.enable_prefix_caching)

    # generation --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings,
                 first_index: int = 0) -> list[list[Completion]]:
        """`sampling.n` completions for each prompt (token ids), in prompt order.

        first_index is the global index of prompts[0]: per-prompt seeds derive from it, so results
        do not depend on how prompts were split over replicas."""
        from vllm import SamplingParams

        # One request per sample, each with its own seed. (A request with n > 1 and seed s gives its
        # sample j the stream s + j, so per-prompt seeds s + i made sample j of prompt i replay
        # sample j - 1 of prompt i + 1.) The prompt's KV blocks are still shared through vLLM's
        # prefix cache, as they would be for the children of an n > 1 request.
        n = sampling.n
        if n > 1 and self.prefix_caching and any(len(p) >= self.block_size for p in prompts):
            # Each prompt once first (greedy, one token, discarded), so that its full KV blocks are
            # in the prefix cache when its n samples are scheduled: the samples then compute only
            # the prompt's last partial block. Without this, the n requests of a prompt, scheduled
            # together, each computed the whole prompt (nothing is cached before a step ends). The
            # demo (4 prompts x 4 samples of ~66 tokens, one engine alone): 18.5 -> 16.3 s.
            warm = self.llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts],
                                     SamplingParams(n=1, temperature=0.0, max_tokens=1), use_tqdm=False)
        else:
            warm = []
        requests, params = [], []
        for i, p in enumerate(prompts):
            for j in range(n):
                requests.append({"prompt_token_ids": list(map(int, p))})
                params.append(self._params(sampling, sampling.max_new_tokens,
                                           None if sampling.seed is None
                                           else sample_seed(sampling.seed, first_index + i, j, n)))
        outs = self.llm.generate(requests, params, use_tqdm=False)
        completions = self._completions(outs)
        if self.routing_replay:
            self._attach_routes(outs, completions, warm, [len(p) for p in prompts], n)
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _attach_routes(self, outs: Sequence[Any], completions: list[Completion], warm: Sequence[Any],
                       prompt_lengths: list[int], n: int) -> None:
        """Each completion's recorded experts (prompt and completion positions); a prompt's positions
        that the prefix cache served come from the other requests of that prompt (the warm-up's too)."""
        from hpcrl.engines.vllm.routing import take

        asked = [(o.request_id, i, prompt_lengths[i], prompt_lengths[i]) for i, o in enumerate(warm)]
        asked += [(o.request_id, j // n, prompt_lengths[j // n] + len(c.token_ids), prompt_lengths[j // n])
                  for j, (o, c) in enumerate(zip(outs, completions, strict=True))]
        routes = self.llm.collective_rpc(take, args=(asked,))[0]
        for o, c in zip(outs, completions, strict=True):
            c.routed_experts = routes[o.request_id]

    def generate_each(self, requests: Sequence[Sequence[int]], sampling: SamplingSettings,
                      seeds: Sequence[int | None], max_new_tokens: Sequence[int]) -> list[Completion]:
        """One completion per request (token ids), each with its own seed and token limit; the rest
        of `sampling` (temperature, top-p/top-k, stop strings) is shared and `sampling.n` is ignored.
        The multi-turn loop (hpcrl.agents.rollout) continues every conversation with this."""
        from vllm import SamplingParams

        ids = [list(map(int, r)) for r in requests]
        if self.prefix_caching:
            # requests that repeat one token sequence (a prompt's n first turns): each distinct one
            # once first, for the prefix cache, as `generate` does for its n samples
            distinct = list(dict.fromkeys(tuple(r) for r in ids if len(r) >= self.block_size))
            if distinct and len(distinct) < sum(len(r) >= self.block_size for r in ids):
                self.llm.generate([{"prompt_token_ids": list(r)} for r in distinct],
                                  SamplingParams(n=1, temperature=0.0, max_tokens=1), use_tqdm=False)
        params = [self._params(sampling, m, s) for s, m in zip(seeds, max_new_tokens, strict=True)]
        outs = self.llm.generate([{"prompt_token_ids": r} for r in ids], params, use_tqdm=False)
        return self._completions(outs)

    @staticmethod
    def _params(sampling: SamplingSettings, max_tokens: int, seed: int | None) -> Any:
        from vllm import SamplingParams

        return SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=sampling.top_k if sampling.top_k > 0 else 0, max_tokens=max_tokens,
                              min_tokens=min(sampling.min_new_tokens, max_tokens),
                              stop=list(sampling.stop) or None, logprobs=0, seed=seed)

    @staticmethod
    def _completions(outs: Sequence[Any]) -> list[Completion]:
        """vLLM's outputs (one sample each) as Completions, in request order."""
        result = []
        for o in outs:
            (c,) = o.outputs
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [], strict=True)]
            result.append(Completion(ids, lps, str(c.finish_reason)))
        return result

    def prompt_logprobs(self, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced log-probs of whole sequences: entry t = log p(seq[t+1] | seq[:t+1])."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        outs = self.llm.generate([{"prompt_token_ids": list(map(int, s))} for s in seqs], sp, use_tqdm=False)
        return [torch.tensor([float(d[t].logprob) for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:],
                                                                    strict=True)], dtype=torch.float64)
                for o in outs]

    # weights -----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place from HF-named full tensors.

        `weights` may be a lazy iterator: vLLM consumes it layer by layer inside one reload (which
        re-packs each layer for the CPU kernels once it is complete), so a producer that fills it
        bucket by bucket keeps only one bucket alive. vLLM slices each tensor for its own TP rank."""
        names: list[str] = []

        def noting(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in pairs:
                names.append(name)
                yield name, tensor

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": noting(weights)})
        if self.cpu_sleep and self.moe:  # vLLM's reload leaves the CPU MoE kernel's weights unpacked
            from hpcrl.engines.vllm.cpu_moe import reloaded_expert_prefixes, repack_experts

            self.llm.collective_rpc(repack_experts, args=(reloaded_expert_prefixes(names),))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sleep(self) -> bool:
        """Free the KV cache and move the weights to host memory while the trainer runs (GPU); on
        CPU free both (the next `load_weights` rewrites every weight: hpcrl.engines.vllm.cpu_sleep).
        False where nothing was done (sleep mode turned off through engine_kwargs on GPU)."""
        if self.sleep_mode:
            self.llm.sleep(level=1)
            return True
        if self.cpu_sleep:
            from hpcrl.engines.vllm.cpu_sleep import release

            self.released = self.llm.collective_rpc(release)[0]
            return True
        return False

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back what `sleep` released: tags ["weights"] first (to push new ones), then
        ["kv_cache"] once the trainer has left the device; None wakes both. On CPU the weights
        come back as memory only: a `load_weights` must follow before generating."""
        if self.sleep_mode:
            self.llm.wake_up(tags=tags)
            return True
        if self.cpu_sleep:
            from hpcrl.engines.vllm.cpu_sleep import wake

            self.llm.collective_rpc(wake, args=(tags,))
            return True
        return False

    def close(self, final: bool = False) -> None:
        """Shut the engine down so that another engine (another model or rollout TP) can be built
        in this process. vLLM's shutdown tears down its own model-parallel groups, and would also
        destroy torch's default process group; that group belongs to the workers (Megatron and the
        controller runtime use it), so it is kept.

        final: the process ends after this (a run's end). The shutdown then skips its full garbage
        collections: vLLM runs two (the KV cache's, and one after it unfreezes the heap) and this
        method one, to hand the engine's memory to the next engine; each walks all ~750,000 objects
        of a worker, 0.5-2.7 s on the wall in a 5-rank tiny run on 2 cores (2026-12-07, timed with
        `gc.callbacks`). An ending process gets the memory back anyway, and leaves without a
        collection (launchers/hpcrl_entry.py `_leave`)."""
        if self.llm is None:
            return
        from vllm.distributed import parallel_state as vps

        destroy_world = vps.destroy_distributed_environment
        vps.destroy_distributed_environment = lambda: None
        collect = gc.collect
        if final:  # vLLM calls gc.collect() by name: for the length of the shutdown it collects nothing
            gc.collect = _no_collection
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            vps.destroy_distributed_environment = destroy_world
            gc.collect = collect
        self.llm = None
        if not final:
            gc.collect()
