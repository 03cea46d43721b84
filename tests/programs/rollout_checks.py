"""Controller program for tests/test_rollout.py: one 1 + 4 rank world, every rollout check.

    mpiexec -disable-auto-cleanup -n 5 python launchers/hpcrl_entry.py tests/programs/rollout_checks.py OUT.json
    mpiexec ... -n 3 python launchers/hpcrl_entry.py tests/programs/rollout_checks.py OUT.json die

Actor (Megatron) and rollout (vLLM) share the worker processes. For each scenario: reshard the
actor's weights into vLLM, compare vLLM's teacher-forced log-probs with the actor's, take an
optimizer step (the rollout is now stale: the gap must grow), reshard again and compare again.
On the tiny model also: greedy vLLM generations vs HF greedy generations from the exported
weights, and sampled generations (n, top-p/top-k, stop strings) with the rollout/actor gap.

`die`: 2 workers build a rollout TP=2 engine (vLLM's CPU shared-memory communicator), record the
/dev/shm segments they map, and the whole world is SIGKILLed, leaving those segments behind for
the next world on the machine (tests/test_rollout.py starts the main world right after).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hpcrl.workers.actor_rollout import ActorRolloutRole

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "models" / "tiny-qwen2")
SMOLLM2 = str(REPO / "models" / "smollm2-135m-instruct")
MOE = str(REPO / "models" / "tiny-qwen3-moe")


def _sibling(name: str) -> Any:
    """tests/programs/megatron_checks.py by path (programs are loaded by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(f"_hpcrl_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class ShmActorRollout(ActorRolloutRole):
    def shm_segments(self) -> list[str]:
        """Names of the /dev/shm files this process maps (still linked ones only)."""
        maps = Path("/proc/self/maps").read_text().splitlines()
        return sorted({line.split("/dev/shm/", 1)[1] for line in maps
                       if "/dev/shm/" in line and not line.endswith("(deleted)")})

    def vllm_shm_name(self) -> dict[str, Any]:
        """The name vLLM gives this rank's TP group's CPU shared memory, and whether the group uses
        it (only where vLLM's CPU build has its shm ops: not in every ISA variant)."""
        from vllm.distributed import parallel_state as vps
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

        comm = vps.get_tp_group().device_communicator
        return {"name": _CPUSHMDistributed.make_group_name(comm),
                "active": isinstance(comm.dist_module, _CPUSHMDistributed)}

    def pid(self) -> int:
        return os.getpid()

    def full_collections(self) -> int:
        """Full (generation 2) garbage collections this process has run so far."""
        import gc

        return gc.get_stats()[2]["collections"]

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache tensors vLLM allocated on this rank (its model runner's kv_caches,
        each storage once), while the engine is awake."""

        def count(worker: Any) -> int:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in worker.model_runner.kv_caches if torch.is_tensor(t)}
            return sum(storages.values())

        return self.rollout.llm.collective_rpc(count)[0]

    def fill_released_kv_cache_with_nan(self) -> int:
        """Give the KV cache that `sleep` freed its memory back now, every byte 0xFF (NaN in any
        float dtype): what a recycled heap allocation may hold when `wake_up` takes it back (the
        trainer's freed tensors, -inf masks among them). `wake_up` then keeps this memory, as a
        resize to the same size does. The bytes filled on this rank."""

        def fill(worker: Any) -> int:
            filled = 0
            for t, n in worker.model_runner.__dict__["_hpcrl_released"]["kv_cache"]:
                storage = t.untyped_storage()
                storage.resize_(n)
                torch.empty(0, dtype=torch.uint8).set_(storage).fill_(255)
                filled += n
            return filled

        return self.rollout.llm.collective_rpc(fill)[0]


def collections_in_close(group: Any, final: bool = False) -> list[int]:
    """Close the group's engines; the full garbage collections each rank ran meanwhile."""
    before = group.full_collections()
    group.close_rollout(final=final)
    return [n - m for n, m in zip(group.full_collections(), before, strict=True)]


def group_segments(group: Any) -> list[str]:
    """The /dev/shm segments any worker of the group maps."""
    return sorted({n for names in group.shm_segments() for n in names})


def make_cfg(model: str, tp: int, pp: int, rollout_tp: int, lr: float, *extra: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from hpcrl.config import load_config

    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"model.path={model}", f"actor.parallel.tensor_parallel={tp}", f"actor.parallel.pipeline_parallel={pp}",
        "actor.micro_batch_tokens=400", f"actor.optim.lr={lr}", "actor.optim.clip_grad=0.0",
        "actor.ppo_mini_batch_size=8", f"rollout.tensor_parallel={rollout_tp}", "rollout.weight_bucket_mb=4",
        "rollout.max_new_tokens=24", "actor.offload=true",
        # room for the multi-turn checks' conversations (prompt + 64 tokens), not only prompt + 24
        "rollout.engine_kwargs.max_model_len=256", *extra])
    return OmegaConf.to_container(cfg, resolve=True)


def planned_terms(cfg: dict[str, Any], bucket_mb: float) -> dict[str, int]:
    """hpcrl plan's terms for a worker of this config (the reshard at bucket_mb): the KV cache of
    one engine rank, and the reshard's bucket with its converted copy."""
    from omegaconf import OmegaConf

    from hpcrl.config import validate
    from hpcrl.plan import RoleShapes, estimate, read_model_shape

    plan_cfg = OmegaConf.create(cfg)
    validate(plan_cfg)
    plan_cfg.rollout.weight_bucket_mb = bucket_mb  # after validating: the config takes >= 1 MB, the tests less
    est = estimate(plan_cfg, RoleShapes(policy=read_model_shape(cfg["model"]["path"])))
    phases = {ph.name: ph.terms for ph in est.phases}
    # (the FSDP engine's row: full tensors gathered, no conversion copy)
    bucket = next(v for k, v in phases["reshard"].items() if k.startswith("reshard bucket"))
    return {"kv_cache": phases["rollout"]["vLLM KV cache"], "reshard": bucket}


def prompt_ids(model: str, n: int) -> list[list[int]]:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = pq.read_table(REPO / "data" / "arith" / "train.parquet").slice(0, n).to_pylist()
    return [tok(tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True))["input_ids"]
            for r in rows]


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |a - b| where mask is set (a -inf outside it must not turn the product into NaN;
    a non-finite value inside it still counts, as inf or NaN)."""
    diff = (a.double() - b.double()).abs()
    return float(torch.where(mask.bool(), diff, torch.zeros_like(diff)).max())


def sync_scenario(model: str, tp: int, pp: int, rollout_tp: int, lr: float, n_seqs: int,
                  bucket_mb: float, *extra: str) -> dict[str, Any]:
    """reshard -> compare -> optimizer step -> (stale gap) -> reshard -> compare (`extra`: config overrides)."""
    from hpcrl.controller import WorkerGroup
    from hpcrl.workers.actor_rollout import rollout_logprobs
    from hpcrl.workers.batching import arrange_minibatches

    t = time.time()
    mc = _sibling("megatron_checks")
    cfg = make_cfg(model, tp, pp, rollout_tp, lr, *extra)
    group = WorkerGroup(ShmActorRollout, init_kwargs={"cfg": cfg},
                        name=f"ar-{Path(model).name}-{rollout_tp}" + ("-lora" if extra else ""))
    batch = mc.text_batch(model, n_seqs)
    mask = batch["attention_mask"].clone()
    mask[:, 0] = 0
    out: dict[str, Any] = {"layout": {"tp": tp, "pp": pp, "dp": group.layout.dp_size},
                           "rollout_coords": group.rollout_coords(), "seconds": {}}

    def lap(name: str) -> None:
        nonlocal t
        out["seconds"][name] = round(time.time() - t, 2)
        t = time.time()

    lap("build")
    out["reshard_1"] = group.reshard_to_rollout(bucket_mb)
    lap("reshard_1")
    actor = group.compute_logprob(batch)
    lap("actor_logprob")
    out["gap_after_reshard_1"] = masked_max(rollout_logprobs(group, batch), actor, mask)
    lap("rollout_logprob")
    g = torch.Generator().manual_seed(0)
    batch["old_logprob"] = actor
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=g)
    out["update"] = group.update_actor(arrange_minibatches(batch, 1, group.layout.dp_size, "token-mean"))
    lap("update")
    actor2 = group.compute_logprob(batch)
    out["actor_change"] = masked_max(actor2, actor, mask)
    out["gap_stale"] = masked_max(rollout_logprobs(group, batch), actor2, mask)
    # the memory plan's terms a rollout rank holds, measured one by one (tests/test_rollout.py)
    out["kv_cache_bytes"] = group.kv_cache_bytes()
    out["planned"] = planned_terms(cfg, bucket_mb)
    out["enter_training"] = group.enter_training()
    out["kv_cache_nan_filled_bytes"] = group.fill_released_kv_cache_with_nan()
    out["reshard_2"] = group.enter_rollout(bucket_mb)  # the phase switch an RL step makes
    out["gap_after_reshard_2"] = masked_max(rollout_logprobs(group, batch), actor2, mask)
    lap("rest")
    return {"group": group, "result": out, "batch": batch}


def sampling_z(model_dir: str, batch: Any, temperature: float) -> float:
    """How far a batch's sampled tokens are from exact draws of HF's softmax(logits / T): with x ~ p,
    log p(x) + H(p) has mean 0 and variance E[log^2 p] - H^2 at each position, so the sum over the
    response tokens, divided by the root of the summed variances, is a z-score (~N(0, 1) for exact
    sampling). A sampler at another temperature, with a hidden top-k / top-p or a repetition
    penalty, or with streams shared between samples, moves it away from 0."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = var = 0.0
    with torch.no_grad():
        for i in range(len(batch)):
            n = int(batch["attention_mask"][i].sum())
            ids = batch["input_ids"][i, :n]
            resp = batch["response_mask"][i, 1:n] > 0  # position t predicts token t + 1
            lp = torch.log_softmax(hf(ids[None]).logits[0, :-1].double() / temperature, -1)[resp]
            p, x = lp.exp(), ids[1:][resp]
            entropy = -(p * lp).sum(-1)
            total += float((lp.gather(-1, x[:, None])[:, 0] + entropy).sum())
            var += float(((p * lp * lp).sum(-1) - entropy * entropy).sum())
    return total / var ** 0.5


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                              eos_token_id=hf.generation_config.eos_token_id,
                              pad_token_id=hf.generation_config.pad_token_id)
            outs.append(gen[0, len(p):].tolist())
    return outs


def multi_turn_checks(group: Any, tok: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """The multi-turn loop (hpcrl.agents.rollout) on these vLLM engines, with the toy marker format
    and counting tool (hpcrl.agents.toy; the tiny model writes no Hermes calls): every row checked
    position by position against what vLLM was asked and answered, turn by turn; the limits; the
    rollout-vs-actor log-prob gap on the model's tokens; the actor's log-probs with the tool holes in
    the response, with and without the shared-prompt packing; max_turns=1 against generate()."""
    from dataclasses import replace
    from functools import partial

    from hpcrl.agents import ToolSet
    from hpcrl.agents.rollout import MultiTurnRollout, turn_seed
    from hpcrl.agents.toy import MarkerFormat, TextStatsTool
    from hpcrl.engines.vllm import SamplingSettings
    from hpcrl.workers.actor_rollout import generate, generate_each, logprob_gap

    max_turns, budget, max_new, seed, n = 3, 64, 12, 21, 4
    served: dict[tuple[int, int], dict[str, Any]] = {}  # (row, turn) -> request, limit, completion
    stops: list[list[str]] = []
    rows_of_seed = {turn_seed(seed, r, t): (r, t) for r in range(len(prompts) * n) for t in range(max_turns)}

    def recording(requests: Any, sampling: Any, seeds: Any, limits: Any) -> Any:
        outs = generate_each(group, requests, sampling, seeds, limits)
        stops.append(list(sampling.stop))
        for req, s, m, c in zip(requests, seeds, limits, outs, strict=True):
            served[rows_of_seed[s]] = {"request": list(req), "limit": m, "completion": c}
        return outs

    def make_loop(turns: int) -> MultiTurnRollout:
        tool = TextStatsTool(fail_every=3, hang_every=5, hang_s=0.5, timeout_s=0.2)
        return MultiTurnRollout(tok, ToolSet([tool]), MarkerFormat("e"), max_turns=turns, max_total_tokens=budget)

    sampling = SamplingSettings(n=n, temperature=1.0, max_new_tokens=max_new, seed=seed)
    loop = make_loop(max_turns)
    t = time.time()
    out = loop.generate(recording, prompts, sampling)
    seconds = time.time() - t
    b = out.batch
    bad_rows: list[Any] = []
    tool_turns = tool_turns_ok = own_ends = 0
    mismatches: list[dict[str, str]] = []
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for row, conv in enumerate(out.conversations):
        length = int(b["attention_mask"][row].sum())
        ids = b["input_ids"][row, :length].tolist()
        mask = b["response_mask"][row, :length].tolist()
        lp = b["rollout_logprob"][row, :length].tolist()
        want_mask = [0.0] * length
        want_lp = [0.0] * length
        p = prompts[row // n]
        problems = [] if ids[:len(p)] == p else ["prompt"]
        turns = sorted(tt for r, tt in served if r == row)
        results = iter(conv.tool_results)
        for k, tt in enumerate(turns):
            s = served[(row, tt)]
            req, c = s["request"], s["completion"]
            a, z = len(req), len(req) + len(c.token_ids)
            if ids[:a] != req:
                problems.append(f"turn {tt}: vLLM was fed something else than the row")
            if ids[a:z] != c.token_ids:
                problems.append(f"turn {tt}: the row holds other tokens than vLLM returned")
            if s["limit"] > min(max_new, budget - (a - len(p))):
                problems.append(f"turn {tt}: limit {s['limit']}")
            want_mask[a:z] = [1.0] * len(c.token_ids)
            want_lp[a:z] = c.logprobs
            if k + 1 < len(turns):  # between this turn's end and the next request: the tool turn
                tool_turns += 1
                text = tok.decode(ids[z:len(served[(row, turns[k + 1])]["request"])], skip_special_tokens=False)
                answer = next(results).content
                # the marker (a stop string) ended the turn, so the template's <|im_end|> is context;
                # a turn the model ended itself with <|im_end|> (in whose text the toy format also finds
                # its marker) gets only the rest of the template's turn end, "\n"
                own_end = ids[z - 1] == im_end
                own_ends += own_end
                head = "\n" if own_end else "<|im_end|>\n"
                want = f"{head}<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n"
                tool_turns_ok += text == want
                if text != want and len(mismatches) < 3:
                    mismatches.append({"got": text, "want": want})
        if mask != want_mask:
            problems.append("response_mask is not the model's tokens exactly")
        if any(abs(x - y) > 0 for x, y in zip(lp, want_lp)):
            problems.append("rollout_logprob is not vLLM's on the model's tokens and 0 elsewhere")
        if length - len(p) > budget or len(turns) > max_turns or len(turns) != conv.turns:
            problems.append(f"limits: {length - len(p)} tokens, {len(turns)} turns")
        if problems:
            bad_rows.append((row, problems))

    actor = group.compute_logprob(b, response_only=True)
    full = group.compute_logprob(b)  # every position, no prompt sharing (no positions field)
    group.set_packing(True, 4, False)
    unshared = group.compute_logprob(b, response_only=True)
    group.set_packing(True, 4, True)
    mask = b["response_mask"]
    tool_mask = b["attention_mask"].float() - mask
    for row in range(len(b)):
        tool_mask[row, :len(prompts[row // n])] = 0

    one = make_loop(1).generate(partial(generate_each, group), prompts, sampling)
    single = generate(group, prompts, replace(sampling, stop=["e"]))
    m = out.metrics
    return {
        "rows": len(b), "seconds": round(seconds, 2), "bad_rows": bad_rows, "turns_served": len(served),
        "tool_turns": tool_turns, "tool_turns_ok": tool_turns_ok,
        "tool_turns_after_own_turn_end": own_ends, "tool_turn_mismatches": mismatches, "stops": stops,
        "ends": [c.end for c in out.conversations], "turns": [c.turns for c in out.conversations],
        "used": [c.used for c in out.conversations], "metrics": m,
        "errors_counted": sum(r.error for c in out.conversations for r in c.tool_results),
        "timeouts_counted": sum(r.error_kind == "timeout" for c in out.conversations for r in c.tool_results),
        "model_tokens": int(mask.sum()), "tool_tokens": int(tool_mask.sum()),
        "gap": logprob_gap(b["rollout_logprob"], actor, mask, step=0),
        "actor_lp_outside_mask": float((actor * (1 - mask)).abs().max()),
        "response_only_vs_full": masked_max(actor, full, mask),
        "shared_vs_unshared": masked_max(actor, unshared, mask),
        "one_turn_equals_generate": torch.equal(one.batch["input_ids"], single["input_ids"])
        and torch.equal(one.batch["response_mask"], single["response_mask"]),
        "one_turn_logprob_diff": masked_max(one.batch["rollout_logprob"], single["rollout_logprob"],
                                            single["response_mask"]),
    }


def routing_replay_checks(group: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Sampled rollouts of the MoE model with their recorded experts: the actor's routers replay them
    exactly, route the same on their own (fp32: the same logits), and replay changed experts too (the
    control: replay is not the free routing by coincidence)."""
    from hpcrl.engines.vllm import SamplingSettings
    from hpcrl.workers.actor_rollout import generate, logprob_gap

    b = generate(group, prompts, SamplingSettings(n=2, temperature=1.0, max_new_tokens=16, seed=5))
    routes = b["routed_experts"].long()
    lengths = b["attention_mask"].sum(-1)
    inside = torch.arange(routes.shape[1])[None, :] < lengths[:, None]
    known = inside & (routes[..., 0, 0] >= 0)
    last = torch.zeros_like(inside)
    last[torch.arange(len(b)), lengths - 1] = True

    def differ(used: torch.Tensor, want: torch.Tensor) -> int:
        """Tokens (x MoE layers) where the experts used are not the wanted ones."""
        return int((used.long() != want.sort(-1).values).any(-1)[known].sum())

    replayed, free = group.routed_experts(b, True), group.routed_experts(b, False)
    lp = group.compute_logprob(b)
    # the control: 30% of the known tokens get another first expert in every layer
    g = torch.Generator().manual_seed(3)
    changed = routes.clone()
    pick = known & (torch.rand(known.shape, generator=g) < 0.3)
    experts = 8
    first = changed[..., 0]
    other = (first + 1) % experts
    other = torch.where(other == changed[..., 1], (first + 2) % experts, other)
    changed[..., 0] = torch.where(pick[..., None], other, first)
    c = b.select(range(len(b)))
    c["routed_experts"] = changed.to(torch.int16)
    replayed_changed = group.routed_experts(c, True)
    lp_changed = group.compute_logprob(c)
    mask = b["response_mask"]
    return {"rows": len(b), "tokens": int(inside.sum()), "known": int(known.sum()),
            "unknown_are_last_tokens": bool(((inside & ~known) == last).all()),
            "layers": int(routes.shape[2]), "k": int(routes.shape[3]),
            "replayed_differ": differ(replayed, routes), "free_differ": differ(free, routes),
            "changed_tokens": int(pick.sum()), "replayed_changed_differ": differ(replayed_changed, changed),
            "replayed_changed_vs_original": differ(replayed_changed, routes),
            "gap_replay": logprob_gap(b["rollout_logprob"], lp, mask, step=0),
            "gap_changed": logprob_gap(b["rollout_logprob"], lp_changed, mask, step=0)}


def die(out_path: str) -> None:
    """Build a TP=2 rollout on 2 workers, record their shm segments, SIGKILL the whole world."""
    from hpcrl.controller import WorkerGroup

    group = WorkerGroup(ShmActorRollout, init_kwargs={"cfg": make_cfg(TINY, 1, 1, 2, 1e-3)}, name="die")
    group.reshard_to_rollout(1.0)
    out = {"segments": group_segments(group), "pids": group.pid(),
           "vllm_shm_names": group.vllm_shm_name()}
    Path(out_path).write_text(json.dumps(out))
    for pid in out["pids"]:
        os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    from hpcrl.engines.vllm import SamplingSettings
    from hpcrl.workers.actor_rollout import generate, logprob_gap

    out_path = sys.argv[1]
    if sys.argv[2:] == ["die"]:
        die(out_path)
    res: dict[str, Any] = {"timings": {}}
    tmp = Path(tempfile.mkdtemp(prefix="hpcrl-rollout-"))
    t_all = time.time()

    def timed(name: str, t0: float) -> None:
        res["timings"][name] = round(time.time() - t0, 1)
        print(f"[rollout_checks] {name}: {res['timings'][name]} s", flush=True)

    # 1. tiny: Megatron TP=2 PP=2 -> rollout TP=1 (4 vLLM replicas)
    t0 = time.time()
    s = sync_scenario(TINY, 2, 2, 1, lr=1e-3, n_seqs=8, bucket_mb=0.25)
    group = s["group"]
    res["tiny_tp1"] = s["result"]
    timed("tiny 2x2 -> rollout tp1", t0)

    # greedy: vLLM (temperature 0) vs HF generate(do_sample=False) on the same (updated) weights
    t0 = time.time()
    prompts = prompt_ids(TINY, 16)
    greedy = generate(group, prompts, SamplingSettings(n=1, temperature=0.0, max_new_tokens=24))
    group.export_hf(str(tmp / "tiny-updated"))
    hf = hf_greedy(str(tmp / "tiny-updated"), prompts, 24)
    vl = [greedy["input_ids"][i, len(p):int(greedy["attention_mask"][i].sum())].tolist()
          for i, p in enumerate(prompts)]
    res["greedy"] = {"prompts": len(prompts), "equal": sum(a == b for a, b in zip(vl, hf, strict=True)),
                     "prompt_order": greedy["prompt_index"].tolist() == list(range(16)),
                     "lengths": [len(x) for x in vl]}
    timed("greedy vs hf", t0)

    # sampling: n=3, temperature/top-p/top-k, stop strings; rollout vs actor log-prob gap
    t0 = time.time()
    sampling = SamplingSettings(n=3, temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=16, seed=7)
    sampled = generate(group, prompts[:6], sampling)
    actor_lp = group.compute_logprob(sampled)
    again = generate(group, prompts[:6], sampling)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    def completion(b: Any, i: int) -> list[int]:
        return b["input_ids"][i, len(prompts[i // 3]):int(b["attention_mask"][i].sum())].tolist()

    texts = [tok.decode(completion(sampled, i)) for i in range(len(sampled))]
    # a printable ASCII character that the unstopped samples produce often
    counts = {c: sum(c in t for t in texts) for c in {c for t in texts for c in t if c.isascii() and c.isalnum()}}
    stop = max(sorted(counts), key=counts.get)
    stopped = generate(group, prompts[:6], SamplingSettings(n=3, temperature=1.0, top_p=0.9, top_k=50,
                                                            max_new_tokens=16, seed=7, stop=[stop]))
    ended_at_stop = unchanged = 0
    for i in range(len(stopped)):
        ids = completion(stopped, i)
        if stop in tok.decode(ids) and stop not in tok.decode(ids[:-1]):
            ended_at_stop += 1  # the completion ends with the token that completed the stop string
        elif stop not in tok.decode(ids) and ids == completion(sampled, i):
            unchanged += 1  # never met the stop string: the same (seeded) sample as without it
    res["sampling"] = {
        "rows": len(sampled), "prompt_index": sampled["prompt_index"].tolist(),
        "prompt_prefix_ok": all(sampled["input_ids"][i, :len(prompts[i // 3])].tolist() == prompts[i // 3]
                                for i in range(len(sampled))),
        "max_response_len": int(sampled["response_mask"].sum(-1).max()),
        "distinct_completions": len({tuple(sampled["input_ids"][i].tolist()) for i in range(len(sampled))}),
        "reproducible": torch.equal(sampled["input_ids"], again["input_ids"]),
        "gap": logprob_gap(sampled["rollout_logprob"], actor_lp, sampled["response_mask"], step=0),
        "stop": stop, "stop_hits_before": sum(stop in t for t in texts), "ended_at_stop": ended_at_stop,
        "unchanged_without_stop": unchanged, "rows_stopped_run": len(stopped),
        "stopped_shorter": int(stopped["response_mask"].sum()) < int(sampled["response_mask"].sum()),
    }
    # temperature 0.7: vLLM's processed log-probs (of the distribution that sampled) against the
    # actor's at the same T, and against the actor's raw T=1 log-probs (what hpcrl compared before)
    t0 = time.time()
    warm = SamplingSettings(n=4, temperature=0.7, max_new_tokens=16, seed=11)
    sampled = generate(group, prompts[:8], warm)
    group.set_temperature(0.7)
    lp_t = group.compute_logprob(sampled)
    group.set_temperature(1.0)
    lp_1 = group.compute_logprob(sampled)
    res["temperature"] = {"t": 0.7, "tokens": int(sampled["response_mask"].sum()),
                          "gap": logprob_gap(sampled["rollout_logprob"], lp_t, sampled["response_mask"], step=0),
                          "gap_actor_at_t1": logprob_gap(sampled["rollout_logprob"], lp_1, sampled["response_mask"],
                                                         step=0)}
    # exact sampling at T=0.7: the z-score of vLLM's draws (16 prompts x 8 samples, ~3000 tokens)
    # under HF's p_0.7 from the exported weights, and under p_1 (the power of the check)
    many = generate(group, prompts, SamplingSettings(n=8, temperature=0.7, max_new_tokens=24, seed=13))
    res["temperature"]["exact"] = {"tokens": int(many["response_mask"].sum()),
                                   "z": sampling_z(str(tmp / "tiny-updated"), many, 0.7),
                                   "z_under_t1": sampling_z(str(tmp / "tiny-updated"), many, 1.0)}
    # random streams: two copies of one prompt and n=2. Each sample has its own stream, so no two of
    # the copies' samples agree (with per-prompt seeds s + i and vLLM's s + j for sample j, sample 1
    # of the first copy replayed sample 0 of the second)
    dup = generate(group, [prompts[0], prompts[0], prompts[1]], SamplingSettings(n=2, temperature=1.0,
                                                                               max_new_tokens=16, seed=5))
    comps = [tuple(dup["input_ids"][i, :int(dup["attention_mask"][i].sum())].tolist()) for i in range(len(dup))]
    res["streams"] = {"rows": len(comps), "distinct_of_first_prompt": len(set(comps[:4])),
                      "min_len": int(dup["response_mask"].sum(-1).min())}
    timed("temperature and streams", t0)

    # more prompt tokens in one seeded call than vLLM's max_num_batched_tokens (4096) on each of the
    # 4 replicas: with chunked prefill vLLM rewound the random generator of a partly prefilled request,
    # which a CPU generator cannot do, and the call crashed (RolloutEngine turns chunked prefill off)
    t0 = time.time()
    many = prompt_ids(TINY, 320)
    big = generate(group, many, SamplingSettings(n=1, temperature=1.0, max_new_tokens=2, seed=3))
    res["over_token_budget"] = {"prompt_tokens": sum(len(p) for p in many), "replicas": 4, "rows": len(big),
                                "prompt_order": big["prompt_index"].tolist() == list(range(len(many))),
                                "min_response_len": int(big["response_mask"].sum(-1).min())}
    timed("prompts over the token budget", t0)

    # multi-turn rollout with a tool, on the same 4 replicas
    t0 = time.time()
    res["multi_turn"] = multi_turn_checks(group, tok, prompts[:6])
    group.close_rollout()
    timed("multi-turn", t0)

    # 2. tiny: Megatron TP=2 PP=2 -> rollout TP=2 (2 vLLM replicas of 2 ranks)
    t0 = time.time()
    s = sync_scenario(TINY, 2, 2, 2, lr=1e-3, n_seqs=8, bucket_mb=0.25)
    res["tiny_tp2"] = s["result"]
    tp2 = generate(s["group"], prompts, SamplingSettings(n=1, temperature=0.0, max_new_tokens=24))
    s["group"].export_hf(str(tmp / "tiny-tp2"))
    hf2 = hf_greedy(str(tmp / "tiny-tp2"), prompts, 24)
    vl2 = [tp2["input_ids"][i, len(p):int(tp2["attention_mask"][i].sum())].tolist() for i, p in enumerate(prompts)]
    res["tiny_tp2"]["greedy_equal_hf_after_export"] = sum(a == b for a, b in zip(vl2, hf2, strict=True))
    res["tiny_tp2"]["shm_segments"] = group_segments(s["group"])
    res["tiny_tp2"]["vllm_shm_names"] = s["group"].vllm_shm_name()
    # another engine follows in these processes: the memory is collected
    res["tiny_tp2"]["full_collections_in_close"] = collections_in_close(s["group"])
    timed("tiny 2x2 -> rollout tp2", t0)

    # 3. SmolLM2-135M (3 KV heads: Megatron TP 1 on 4 workers): TP=1 PP=2 DP=2 -> rollout TP=1
    t0 = time.time()
    s = sync_scenario(SMOLLM2, 1, 2, 1, lr=1e-4, n_seqs=4, bucket_mb=16)
    res["smollm2_tp1"] = s["result"]
    s["group"].close_rollout()
    timed("smollm2 1x2 -> rollout tp1", t0)

    # 4. tiny with LoRA adapters (actor.lora): TP=1 PP=1 DP=4 -> rollout TP=1. The adapters start at
    # B = 0, so the first reshard pushes the base; after the update B != 0 and the second pushes the
    # merged W + alpha/r B A (tests/test_train.py's LoRA run checks the 2x2 layout into rollout TP=2)
    t0 = time.time()
    s = sync_scenario(TINY, 1, 1, 1, 1e-2, 8, 0.25, "actor.lora.rank=8", "actor.lora.alpha=16")
    res["tiny_lora_tp1"] = s["result"]
    s["group"].close_rollout()
    timed("tiny lora 1x1 -> rollout tp1", t0)

    # 4b. the same LoRA run on the FSDP engine (PEFT's adapters, DP=4) -> rollout TP=2: every rank gathers
    # each full base weight and its adapters and pushes W + alpha/r B A; vLLM cuts its TP half
    t0 = time.time()
    s = sync_scenario(TINY, 1, 1, 2, 1e-2, 8, 0.25, "actor.engine=fsdp", "actor.lora.rank=8", "actor.lora.alpha=16")
    res["tiny_fsdp_lora_tp2"] = s["result"]
    s["group"].close_rollout()
    timed("tiny fsdp lora -> rollout tp2", t0)

    # 5. the tiny Qwen3-MoE: Megatron TP=2 with SP (DP=2) -> rollout TP=1, then TP=1 (DP=4) -> rollout
    # TP=2 with routing replay: vLLM's experts for every token, replayed by the actor's routers
    t0 = time.time()
    s = sync_scenario(MOE, 2, 1, 1, 1e-3, 8, 0.25, "actor.parallel.sequence_parallel=true")
    res["moe_tp1"] = s["result"]
    s["group"].close_rollout()
    timed("tiny moe 2x1 sp -> rollout tp1", t0)
    t0 = time.time()
    s = sync_scenario(MOE, 1, 1, 2, 1e-3, 8, 0.25, "rollout.routing_replay=true")
    res["moe_tp2"] = s["result"]
    res["routing_replay"] = routing_replay_checks(s["group"], prompt_ids(MOE, 6))
    # the last engine of this world, closed as a run's end closes its engines (final: no collection)
    res["final_close"] = {"shm_segments": group_segments(s["group"]), "vllm_shm_names": s["group"].vllm_shm_name()}
    res["final_close"]["full_collections_in_close"] = collections_in_close(s["group"], final=True)
    timed("tiny moe 1x1 -> rollout tp2, routing replay", t0)

    res["timings"]["total"] = round(time.time() - t_all, 1)
    Path(out_path).write_text(json.dumps(res, indent=1, default=str))
    shutil.rmtree(tmp, ignore_errors=True)
