"""Per-phase time and peak memory of the RL step, for one or more checkouts side by side (not CI).

    .venv/bin/python tools/bench_step.py [--repo DIR ...] [--env "K=V ..." ...] [--set "KEY=VALUE ..." ...]
                                         [--steps 3] [--rounds 1] [KEY=VALUE ...]

Runs `hpcrl run CONFIG trainer.total_steps=STEPS` (the demo config by default, validation before the
first step) once per round on each side, alternating sides round by round. A side is a checkout
(`--repo`), or this checkout with extra environment variables (`--env`, e.g. allocator settings).
A side can also be this checkout with extra config overrides (`--set`, e.g. LoRA against full
fine-tuning: `--set actor.lora.rank=16` beside the plain side). It prints for each: the median
per-phase seconds of the steady steps (2..STEPS), the validation time,
the largest resident set of any process of the run (the workers), the user and system CPU seconds
and minor page faults of the whole run (all from wait4's rusage of the process tree), and the load
average and host steal time around the run. Each checkout runs with its own code and config file but this
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


def run_once(repo: Path, extra_env: dict[str, str], config: str, steps: int, overrides: list[str]) -> dict:
    for name in (".venv", "models", "data"):  # the checkout under test uses this one's environment
        if not (repo / name).exists():
            (repo / name).symlink_to(REPO / name)
    run_dir = Path(tempfile.mkdtemp(prefix="hpcrl-bench-step-")) / "run"
    cmd = [str(REPO / ".venv" / "bin" / "hpcrl"), "run", config, f"trainer.total_steps={steps}",
           f"trainer.val_every={steps}", f"trainer.run_dir={run_dir}", "checkpoint.save_every=0",
           "logging.tensorboard=false", *overrides]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(repo), **extra_env)
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
        "user_s": usage.ru_utime, "system_s": usage.ru_stime, "minor_faults": usage.ru_minflt,
        "step_s": statistics.median(m["time/step"] for m in steady),
        "phases": {p: statistics.median(m.get(f"time/{p}", 0.0) for m in steady) for p in phases},
        "validate_s": steps_m[0].get("time/validate", float("nan")),
        "reward": [round(m["reward/mean"], 3) for m in steps_m],
        "rss_metric_gb": max((m.get("memory/rss_gb_max", float("nan")) for m in steps_m), default=float("nan")),
        # each step's largest worker peak (the workers reset their peak every step; step 1 holds the
        # first validation)
        "rss_steps_gb": [round(m.get("memory/rss_gb_max", float("nan")), 2) for m in steps_m],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", action="append", type=Path, help="checkout to measure (repeatable; default: this)")
    p.add_argument("--env", action="append", default=[], metavar="K=V ...",
                   help="a side: this checkout with these environment variables (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE ...", dest="sets",
                   help="a side: this checkout with these extra config overrides (repeatable)")
    p.add_argument("--config", default="configs/grpo_smollm2.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    sides: list[tuple[Path, dict[str, str], list[str]]] = [(r.resolve(), {}, []) for r in (args.repo or [REPO])]
    for spec in args.env:
        try:
            sides.append((REPO, dict(kv.split("=", 1) for kv in spec.split()), []))
        except ValueError:
            p.error(f"--env {spec!r}: expected space-separated KEY=VALUE pairs")
    sides += [(REPO, {}, spec.split()) for spec in args.sets]
    labels = [str(repo) + "".join(f" {k}={v}" for k, v in env.items()) + "".join(f" {o}" for o in sets)
              for repo, env, sets in sides]
    results: list[list[dict]] = [[] for _ in sides]
    for k in range(args.rounds):
        for i, (repo, env, sets) in enumerate(sides):
            r = run_once(repo, env, args.config, args.steps, [*args.overrides, *sets])
            results[i].append(r)
            print(f"[bench_step] round {k + 1} {labels[i]}: step {r['step_s']:.1f} s, "
                  f"validation {r['validate_s']:.1f} s, max RSS {r['max_rss_gb']:.2f} GB "
                  f"(per step {r['rss_steps_gb']}), "
                  f"CPU user {r['user_s']:.0f} s system {r['system_s']:.0f} s, "
                  f"minor faults {r['minor_faults'] / 1e6:.2f} M, "
                  f"load {r['load_before']:.2f} -> {r['load_after']:.2f}, "
                  f"steal {r['steal_s']:.1f} s, rewards {r['reward']}", flush=True)
    phases = sorted({ph for rs in results for r in rs for ph in r["phases"]})
    print(f"\nmedian over rounds of the median steady step (steps 2..{args.steps}), seconds; {args.config}")
    cols = [*phases, "step", "validate"]
    print("  ".join(f"{ph[:13]:>13}" for ph in cols)
          + f"  {'max RSS GB':>10}  {'user s':>7}  {'system s':>8}  {'faults M':>8}  {'load':>5}  side")
    for label, rs in zip(labels, results):
        row = [statistics.median(r["phases"].get(ph, 0.0) for r in rs) for ph in phases]
        row += [statistics.median(r["step_s"] for r in rs), statistics.median(r["validate_s"] for r in rs)]
        print("  ".join(f"{v:13.2f}" for v in row)
              + f"  {max(r['max_rss_gb'] for r in rs):10.2f}  {statistics.median(r['user_s'] for r in rs):7.0f}"
              + f"  {statistics.median(r['system_s'] for r in rs):8.0f}"
              + f"  {statistics.median(r['minor_faults'] for r in rs) / 1e6:8.2f}"
              + f"  {max(r['load_after'] for r in rs):5.2f}  {label}")


if __name__ == "__main__":
    sys.exit(main())
