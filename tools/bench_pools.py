"""Rollout pools (hpcrl.pools) on the local Slurm cluster: seconds from a pool job's start to its first
generated segment, and the step time with 0, 1 and 2 pools (not CI).

    .venv/bin/python tools/bench_pools.py [--config configs/grpo_smollm2.yaml] [--steps 16] [--pools 0,1,2]
                                          [--rounds 1] [KEY=VALUE ...]

Each run is `hpcrl run CONFIG` on this machine, split (1 trainer worker, 1 rollout worker),
rollout.mode=fully_async; as soon as it takes pools (RUN_DIR/pools/controller.json), N pool jobs of 1
node x 1 worker are submitted with `hpcrl submit --join`. Per pool it reads the pool's log: seconds from
its Slurm job's start (sacct's Start, whole seconds) to its engine being ready and to its first segment
served.
Per run it prints the median step time over the steps after which all N pools were live (N = 0: steps 2
and later), the pools' share of the tokens generated in those steps, the load average and the host's
steal time. Rounds alternate the pool counts. Run it alone: other jobs make every number wrong. On this
machine every "node" of the local cluster shares the same cores, so a pool adds engines, not compute.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import steal_ticks  # noqa: E402

HPCRL = str(REPO / ".venv" / "bin" / "hpcrl")
SPLIT = ["trainer.placement=split", "trainer.workers_per_node=2", "trainer.rollout_workers=1",
         "rollout.mode=fully_async", "trainer.val_every=0", "checkpoint.save_every=0"]


def job_start(job_id: str) -> float | None:
    """The unix time Slurm started a job (sacct's Start, whole seconds)."""
    r = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "Start"], capture_output=True, text=True)
    try:
        return time.mktime(time.strptime(r.stdout.strip().splitlines()[0], "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, IndexError):
        return None


def one_run(config: str, pools: int, steps: int, overrides: list[str], work: Path) -> dict:
    run_dir = work / f"run-{pools}pools-{time.time_ns()}"
    load0, steal0, t0 = os.getloadavg()[0], steal_ticks(), time.perf_counter()
    log = open(work / f"{run_dir.name}.out", "w")
    proc = subprocess.Popen([HPCRL, "run", config, f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
                             *SPLIT, *overrides], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    jobs = []
    try:
        while not (run_dir / "pools" / "controller.json").is_file():
            if proc.poll() is not None:
                sys.exit(f"the run ended before taking pools: {(work / f'{run_dir.name}.out').read_text()[-3000:]}")
            time.sleep(0.5)
        for _ in range(pools):
            r = subprocess.run([HPCRL, "submit", "--join", str(run_dir), "--rollout-nodes", "1", "--json",
                                "trainer.workers_per_node=1"], cwd=REPO, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"hpcrl submit --join failed: {r.stderr}")
            jobs.append(json.loads(r.stdout))
        if proc.wait() != 0:
            sys.exit(f"the run failed: {(work / f'{run_dir.name}.out').read_text()[-3000:]}")
    finally:
        for j in jobs:
            subprocess.run(["scancel", j["job_id"]], capture_output=True)
        if proc.poll() is None:
            proc.kill()
        log.close()
    time.sleep(2)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    live = [m for m in metrics if int(m.get("pools/workers_live", 0)) == pools and m["step"] >= 2]
    # the steps after whose update all pools were live: the next step is the first they generate for
    counted = [m for m in live if pools == 0 or m["step"] > live[0]["step"]]
    pool_info = []
    for j in jobs:
        text = Path(j["stdout"]).read_text(errors="replace") if Path(j["stdout"]).is_file() else ""
        start = job_start(j["job_id"])
        ready = re.search(r"engine ready [\d.]+ s after the start \(unix ([\d.]+)\)", text)
        first = re.search(r"first segment served [\d.]+ s after the start \(unix ([\d.]+)\)", text)
        pool_info.append({"job": j["job_id"], "ready_s": float(ready.group(1)) - start if ready and start else None,
                          "first_segment_s": float(first.group(1)) - start if first and start else None})
    out = {"pools": pools, "steps_counted": [m["step"] for m in counted],
           "step_s": statistics.median(m["time/step"] for m in counted) if counted else None,
           "pool_token_share": (sum(m.get("pools/tokens_generated", 0) for m in counted)
                                / max(sum(m["stream/tokens_generated"] for m in counted), 1)),
           "pool_jobs": pool_info, "wall_s": time.perf_counter() - t0, "load_before": load0,
           "load_after": os.getloadavg()[0], "steal_s": (steal_ticks() - steal0) / os.sysconf("SC_CLK_TCK")}
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/grpo_smollm2.yaml")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--pools", default="0,1,2", help="pool counts, e.g. 0,1,2")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    counts = [int(x) for x in args.pools.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-pools-"))
    print(f"machine: {os.cpu_count()} cores; config {args.config}, {args.steps} steps, split 1 trainer + 1 engine, "
          f"fully_async; pools of 1 node x 1 worker on the local cluster; overrides {args.overrides}", flush=True)
    results: dict[int, list[dict]] = {n: [] for n in counts}
    for k in range(args.rounds):
        for n in counts if k % 2 == 0 else list(reversed(counts)):
            r = one_run(args.config, n, args.steps, args.overrides, work)
            results[n].append(r)
            jobs = "; ".join(f"job {p['job']}: engine ready {p['ready_s']} s, first segment {p['first_segment_s']} s"
                             for p in r["pool_jobs"])
            print(f"round {k + 1}, {n} pool(s): median step {r['step_s'] and round(r['step_s'], 2)} s over steps "
                  f"{r['steps_counted']}; pools made {100 * r['pool_token_share']:.0f}% of those steps' tokens; "
                  f"{jobs or 'no pool'}; wall {r['wall_s']:.0f} s, load {r['load_before']:.2f} -> "
                  f"{r['load_after']:.2f}, steal {r['steal_s']:.1f} s", flush=True)
    print("\npools | median step s (median over rounds) | pool token share | job start -> first segment s")
    for n in counts:
        steps = [r["step_s"] for r in results[n] if r["step_s"] is not None]
        firsts = [p["first_segment_s"] for r in results[n] for p in r["pool_jobs"] if p["first_segment_s"]]
        print(f"{n} | {statistics.median(steps) if steps else '-'} | "
              f"{statistics.median(r['pool_token_share'] for r in results[n]):.2f} | "
              f"{statistics.median(firsts) if firsts else '-'}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
