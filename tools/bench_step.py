"""Per-phase time and peak memory of the RL step, for one or more checkouts side by side (not CI).

    .venv/bin/python tools/bench_step.py [--repo DIR ...] [--steps 3] [--rounds 1] [KEY=VALUE ...]

Runs `hpcrl run CONFIG trainer.total_steps=STEPS` (the demo config by default, validation before the
first step) once per round in each checkout, alternating checkouts round by round, and prints for
each: the median per-phase seconds of the steady steps (2..STEPS), the validation time, the largest
resident set of any process of the run (the workers; from wait4's rusage), and the load average and
host steal time around the run. Each checkout runs with its own code and config file but this
repository's .venv, models and data (linked in when missing). Run it alone on the machine: other
jobs make every number wrong.
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

REPO = Path(__file__).resolve().parents[1]


def steal_ticks() -> int:
    """Host steal time so far (USER_HZ ticks, all CPUs), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    return int(fields[8]) if len(fields) > 8 else 0


def run_once(repo: Path, config: str, steps: int, overrides: list[str]) -> dict:
    for name in (".venv", "models", "data"):  # the checkout under test uses this one's environment
        if not (repo / name).exists():
            (repo / name).symlink_to(REPO / name)
    run_dir = Path(tempfile.mkdtemp(prefix="hpcrl-bench-step-")) / "run"
    cmd = [str(REPO / ".venv" / "bin" / "hpcrl"), "run", config, f"trainer.total_steps={steps}",
           f"trainer.val_every={steps}", f"trainer.run_dir={run_dir}", "checkpoint.save_every=0",
           "logging.tensorboard=false", *overrides]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(repo))
    load0, steal0, t0 = os.getloadavg()[0], steal_ticks(), time.perf_counter()
    with open(run_dir.parent / "out.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{repo}: hpcrl run failed, see {run_dir.parent / 'out.log'}")
    steps_m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = steps_m[1:] or steps_m
    phases = sorted({k[5:] for m in steady for k in m if k.startswith("time/") and k != "time/step"})
    return {
        "wall_s": wall, "load_before": load0, "load_after": os.getloadavg()[0],
        "steal_s": (steal_ticks() - steal0) / os.sysconf("SC_CLK_TCK"),
        "max_rss_gb": usage.ru_maxrss * 1024 / 1e9,  # kB: the largest process of the run's tree
        "step_s": statistics.median(m["time/step"] for m in steady),
        "phases": {p: statistics.median(m.get(f"time/{p}", 0.0) for m in steady) for p in phases},
        "validate_s": steps_m[0].get("time/validate", float("nan")),
        "reward": [round(m["reward/mean"], 3) for m in steps_m],
        "rss_metric_gb": max((m.get("memory/rss_gb_max", float("nan")) for m in steps_m), default=float("nan")),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", action="append", type=Path, help="checkout to measure (repeatable; default: this)")
    p.add_argument("--config", default="configs/grpo_smollm2.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    repos = [r.resolve() for r in (args.repo or [REPO])]
    results: dict[Path, list[dict]] = {r: [] for r in repos}
    for k in range(args.rounds):
        for repo in repos:
            r = run_once(repo, args.config, args.steps, args.overrides)
            results[repo].append(r)
            print(f"[bench_step] round {k + 1} {repo}: step {r['step_s']:.1f} s, validation {r['validate_s']:.1f} s, "
                  f"max RSS {r['max_rss_gb']:.2f} GB, load {r['load_before']:.2f} -> {r['load_after']:.2f}, "
                  f"steal {r['steal_s']:.1f} s, rewards {r['reward']}", flush=True)
    phases = sorted({ph for rs in results.values() for r in rs for ph in r["phases"]})
    width = max(len(str(r)) for r in repos)
    print(f"\nmedian over rounds of the median steady step (steps 2..{args.steps}), seconds; {args.config}")
    print(f"{'checkout':<{width}}  " + "  ".join(f"{ph[:13]:>13}" for ph in [*phases, "step", "validate"])
          + f"  {'max RSS GB':>10}  {'load':>5}")
    for repo, rs in results.items():
        row = [statistics.median(r["phases"].get(ph, 0.0) for r in rs) for ph in phases]
        row += [statistics.median(r["step_s"] for r in rs), statistics.median(r["validate_s"] for r in rs)]
        print(f"{str(repo):<{width}}  " + "  ".join(f"{v:13.2f}" for v in row)
              + f"  {max(r['max_rss_gb'] for r in rs):10.2f}  {max(r['load_after'] for r in rs):5.2f}")


if __name__ == "__main__":
    sys.exit(main())
