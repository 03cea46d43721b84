"""Benchmark the colocated weight sync: bucketed `reshard_to_rollout` vs a naive full-model path.

    .venv/bin/python tools/bench_reshard.py [--model models/smollm2-135m-instruct] [--tp 1 --pp 2]
        [--rollout-tp 1] [--bucket-mb 64] [--workers 4] [--rounds 3] [--set key=value ...]

    --set passes config overrides (an MoE model: --set actor.parallel.expert_parallel=2). --rounds
    alternates the two paths (their order swapped every round) and reports the median of each.

Starts one world (1 controller + N workers, mpiexec), builds the Megatron actor and a vLLM engine
in every worker, then times, after one warm-up of each:
  * reshard_to_rollout: each TP part of each bucket broadcast once from its owning stage, converted
    on arrival and streamed into vLLM's reload (hpcrl.engines.reshard);
  * naive: every stage's HF tensors gathered on rank 0 (pickled), the full dict broadcast (pickled),
    a full reload.
Prints both times and the ratio, bytes received per rank vs the minimum the rollout layout needs,
peak extra memory per rank, and the rollout-vs-actor log-prob gap after each path. Not run by CI.
SmolLM2-135M has 3 KV heads, so Megatron TP is 1 on 4 workers (PP=2, DP=2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _steal_s() -> float:
    """Seconds of CPU time the hypervisor took from this machine since boot (/proc/stat's steal)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def controller() -> None:
    """Rank 0 of the benchmark world (run by launchers/hpcrl_entry.py)."""
    import torch
    from omegaconf import OmegaConf

    from hpcrl.config import load_config
    from hpcrl.controller import WorkerGroup
    from hpcrl.workers.actor_rollout import ActorRolloutRole, rollout_logprobs

    a = json.loads(sys.argv[1])
    cfg = OmegaConf.to_container(load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"model.path={a['model']}", f"actor.parallel.tensor_parallel={a['tp']}",
        f"actor.parallel.pipeline_parallel={a['pp']}", f"rollout.tensor_parallel={a['rollout_tp']}",
        f"rollout.weight_bucket_mb={a['bucket_mb']}", "actor.micro_batch_tokens=512", *a["set"]]), resolve=True)
    t0 = time.time()
    group = WorkerGroup(ActorRolloutRole, init_kwargs={"cfg": cfg}, name="bench")
    print(f"[bench] world up, actor + vLLM built in {time.time() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(a["model"]) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(min(100, vocab // 2), min(1000, vocab), (4, 48), generator=g)
    from hpcrl.controller import Batch

    batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": torch.ones(4, 48)})
    mask = torch.ones(4, 48)
    mask[:, 0] = 0
    actor = group.compute_logprob(batch)

    def gap() -> float:
        return float(((rollout_logprobs(group, batch) - actor.double()).abs() * mask).max())

    res: dict[str, Any] = {}
    paths = [("reshard", lambda: group.reshard_to_rollout()), ("naive", lambda: group.naive_reshard())]
    for _, call in paths:
        call()  # warm-up: first touch of buffers and code paths
    times: dict[str, list[float]] = {"reshard": [], "naive": []}
    steal = _steal_s()
    for i in range(a["rounds"]):
        for name, call in (paths if i % 2 == 0 else paths[::-1]):
            res[name] = call()
            times[name].append(max(s["seconds"] for s in res[name]))
            res[name + "_gap"] = gap()
        load, now = os.getloadavg(), _steal_s()
        print(f"[bench] round {i + 1}: reshard {times['reshard'][-1]:.3f} s, naive {times['naive'][-1]:.3f} s, "
              f"ratio {times['naive'][-1] / times['reshard'][-1]:.2f}x; load {load[0]:.2f}, steal {now - steal:.1f} s",
              flush=True)
        steal = now
    r, n = res["reshard"], res["naive"]
    t_r, t_n = statistics.median(times["reshard"]), statistics.median(times["naive"])
    res["times"] = times
    print(f"[bench] model {a['model']}  megatron TP={a['tp']} PP={a['pp']}  rollout TP={a['rollout_tp']}  "
          f"workers={len(r)}  bucket={a['bucket_mb']} MiB  model bytes={_mb(r[0]['model_bytes'])}  set {a['set']}")
    print(f"[bench] median of {a['rounds']} alternating rounds: reshard_to_rollout {t_r:.3f} s   naive {t_n:.3f} s"
          f"   ratio naive/reshard: {t_n / t_r:.2f}x")
    print("[bench] rank | reshard recv / minimum | naive recv | reshard peak extra | naive peak extra | buckets")
    for i, (x, y) in enumerate(zip(r, n, strict=True)):
        print(f"[bench] {i:4d} | {_mb(x['bytes_received']):>10} / {_mb(x['min_bytes_received']):>10} | "
              f"{_mb(y['bytes_received']):>10} | {_mb(x['peak_extra_bytes']):>10} | {_mb(y['peak_extra_bytes']):>10} | "
              f"{x['buckets']}")
    print(f"[bench] max |rollout - actor| log-prob after reshard: {res['reshard_gap']:.2e}, "
          f"after naive: {res['naive_gap']:.2e}", flush=True)
    Path(a["out"]).write_text(json.dumps(res, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two paths (median reported)")
    p.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_reshard.json"))
    ns = p.parse_args()
    sys.path.insert(0, str(REPO))
    from hpcrl.launch import entry_argv, mpiexec_command

    args = json.dumps({"model": str(Path(ns.model).resolve()), "tp": ns.tp, "pp": ns.pp, "rollout_tp": ns.rollout_tp,
                       "bucket_mb": ns.bucket_mb, "out": ns.out, "rounds": ns.rounds, "set": ns.set})
    cmd = mpiexec_command(ns.workers, entry_argv(f"{Path(__file__).resolve()}:controller", [args],
                                                 python=sys.executable))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[bench]")]
    print("\n".join(lines))
    if out.returncode != 0:
        print(out.stdout[-3000:], out.stderr[-6000:], sep="\n", file=sys.stderr)
        sys.exit(out.returncode)


if __name__ == "__main__":
    main()
