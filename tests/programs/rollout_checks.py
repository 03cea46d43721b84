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


def group_segments(group: Any) -> list[str]:
    """The /dev/shm segments any worker of the group maps."""
    return sorted({n for names in group.shm_segments() for n in names})


def make_cfg(model: str, tp: int, pp: int, rollout_tp: int, lr: float) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from hpcrl.config import load_config

    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"model.path={model}", f"actor.parallel.tensor_parallel={tp}", f"actor.parallel.pipeline_parallel={pp}",
        "actor.micro_batch_tokens=400", f"actor.optim.lr={lr}", "actor.optim.clip_grad=0.0",
        "actor.ppo_mini_batch_size=8", f"rollout.tensor_parallel={rollout_tp}", "rollout.weight_bucket_mb=4",
        "rollout.max_new_tokens=24", "actor.offload=true"])
    return OmegaConf.to_container(cfg, resolve=True)


def prompt_ids(model: str, n: int) -> list[list[int]]:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = pq.read_table(REPO / "data" / "arith" / "train.parquet").slice(0, n).to_pylist()
    return [tok(tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True))["input_ids"]
            for r in rows]


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a.double() - b.double()).abs() * mask).max())


def sync_scenario(model: str, tp: int, pp: int, rollout_tp: int, lr: float, n_seqs: int,
                  bucket_mb: float) -> dict[str, Any]:
    """reshard -> compare -> optimizer step -> (stale gap) -> reshard -> compare."""
    from hpcrl.controller import WorkerGroup
    from hpcrl.workers.actor_rollout import rollout_logprobs
    from hpcrl.workers.batching import arrange_minibatches

    t = time.time()
    mc = _sibling("megatron_checks")
    cfg = make_cfg(model, tp, pp, rollout_tp, lr)
    group = WorkerGroup(ShmActorRollout, init_kwargs={"cfg": cfg}, name=f"ar-{Path(model).name}-{rollout_tp}")
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
    out["enter_training"] = group.enter_training()
    out["reshard_2"] = group.enter_rollout(bucket_mb)  # the phase switch an RL step makes
    out["gap_after_reshard_2"] = masked_max(rollout_logprobs(group, batch), actor2, mask)
    lap("rest")
    return {"group": group, "result": out, "batch": batch}


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
    # random streams: two copies of one prompt and n=2. Each sample has its own stream, so no two of
    # the copies' samples agree (with per-prompt seeds s + i and vLLM's s + j for sample j, sample 1
    # of the first copy replayed sample 0 of the second)
    dup = generate(group, [prompts[0], prompts[0], prompts[1]], SamplingSettings(n=2, temperature=1.0,
                                                                               max_new_tokens=16, seed=5))
    comps = [tuple(dup["input_ids"][i, :int(dup["attention_mask"][i].sum())].tolist()) for i in range(len(dup))]
    res["streams"] = {"rows": len(comps), "distinct_of_first_prompt": len(set(comps[:4])),
                      "min_len": int(dup["response_mask"].sum(-1).min())}
    group.close_rollout()
    timed("temperature and streams", t0)

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
    s["group"].close_rollout()
    timed("tiny 2x2 -> rollout tp2", t0)

    # 3. SmolLM2-135M (3 KV heads: Megatron TP 1 on 4 workers): TP=1 PP=2 DP=2 -> rollout TP=1
    t0 = time.time()
    s = sync_scenario(SMOLLM2, 1, 2, 1, lr=1e-4, n_seqs=4, bucket_mb=16)
    res["smollm2_tp1"] = s["result"]
    s["group"].close_rollout()
    timed("smollm2 1x2 -> rollout tp1", t0)

    res["timings"]["total"] = round(time.time() - t_all, 1)
    Path(out_path).write_text(json.dumps(res, indent=1, default=str))
    shutil.rmtree(tmp, ignore_errors=True)
