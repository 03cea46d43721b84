"""Colocated vs split placement vs split one-step-off vs fully asynchronous, on the same workers (not CI).

    .venv/bin/python tools/bench_async.py [--config configs/grpo_smollm2.yaml] [--steps 4] [--rounds 2]
                                          [--modes NAME,...] [--async-staleness 2] [--out bench-async]
                                          [KEY=VALUE ...]

Runs `hpcrl run CONFIG` in these placements and modes of the config's workers (--modes picks some),
alternating them round by round:

- colocated: every worker trains and generates, taking turns (trainer.placement=colocated);
- split sync: the last half of the workers generate, the first half train, one after the other
  (trainer.placement=split, rollout.max_staleness=0);
- split one-step-off: the same split, batch k+1 generated while batch k trains (rollout.max_staleness=1).
- split fully_async: the same split, the engines generating without pause in segments, samples in
  flight continued across weight updates (rollout.mode=fully_async, hpcrl.trainer.stream), tokens at
  most --async-staleness versions behind (default 2; with 1 only one batch is in flight, and the trainer
  waits for its longest sample as one-step-off does); and the same without partial rollout (samples in
  flight start again).

Round k runs every mode with trainer.seed = the config's + k - 1 (the same prompts, other samples). It
prints each run's median steady step (steps 2..STEPS, the first one also generates the first batch)
with the load average and the host's steal time, then for each mode the median over the rounds of its
throughput over steps 2..STEPS (trained samples/s, every mode training the same number a step, and
trained response tokens/s) as ratios, and the per-seed difference of the mean training reward over the
run from each baseline's, with its standard error over the rounds. It draws `OUT/timeline.png`: for
each placement the timeline of steps 2..STEPS of its last run, one row per group of workers (trainer,
rollout), bars for generate / old log-probs / update / weight transfer, so that the overlap shows.
Run it alone on the machine: other jobs make every number wrong.
"""

from __future__ import annotations

import argparse
import json
import os
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

PLACEMENTS = {
    "colocated": [],
    "split sync": ["trainer.placement=split", "rollout.max_staleness=0"],
    "split one-step-off": ["trainer.placement=split", "rollout.max_staleness=1"],
    # the engines generating without pause (hpcrl.trainer.stream), samples continued across updates or not
    "split fully_async": ["trainer.placement=split", "rollout.mode=fully_async"],
    "split fully_async no partial": ["trainer.placement=split", "rollout.mode=fully_async",
                                     "rollout.partial_rollout=false"],
}
# controller phases -> (row, colour); the rollout row of a split run is drawn from the engines' own spans
ROWS = {"generate": ("rollout", "tab:green"), "validate": ("rollout", "tab:olive"),
        "old_logprob": ("trainer", "tab:orange"), "ref_logprob": ("trainer", "tab:brown"),
        "values": ("trainer", "tab:pink"), "update_actor": ("trainer", "tab:blue"),
        "update_critic": ("trainer", "tab:cyan"), "reshard": ("both", "tab:red"), "transfer": ("both", "tab:red"),
        "generate_wait": ("trainer", "lightgrey"), "batch_wait": ("trainer", "lightgrey")}


def run_once(config: str, steps: int, overrides: list[str]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="hpcrl-bench-async-")) / "run"
    cmd = [str(REPO / ".venv" / "bin" / "hpcrl"), "run", config, f"trainer.total_steps={steps}", "trainer.val_every=0",
           f"trainer.run_dir={run_dir}", "checkpoint.save_every=0", "logging.tensorboard=false", *overrides]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    load0, steal0, t0 = os.getloadavg()[0], steal_ticks(), time.perf_counter()
    with open(run_dir.parent / "out.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"hpcrl run failed ({' '.join(overrides) or 'colocated'}), see {run_dir.parent / 'out.log'}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the end-of-run save: 1.6 GB for SmolLM2
    steady = records[1:]
    return {"wall_s": time.perf_counter() - t0, "load_before": load0, "load_after": os.getloadavg()[0],
            "steal_s": (steal_ticks() - steal0) / os.sysconf("SC_CLK_TCK"),
            "step_s": statistics.median(m["time/step"] for m in steady),
            "phases": {k[5:]: statistics.median(m.get(k, 0.0) for m in steady)
                       for k in sorted({k for m in steady for k in m if k.startswith("time/") and k != "time/step"})},
            "reward": [round(m["reward/mean"], 3) for m in records], "records": records,
            "steady_s": sum(m["time/step"] for m in steady),
            "tokens": sum(m["response_length/mean"] for m in steady)}


def draw(timelines: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.6 + 1.4 * len(timelines)), squeeze=False)
    for ax, (name, records) in zip(axes[:, 0], timelines.items()):
        spans = [s for m in records for s in m.get("trace/controller", [])]
        t0 = min(s[1] for s in spans)
        split = any("trace/rollout" in m for m in records)
        seen: set[str] = set()
        for phase, start, end in spans:
            row, colour = ROWS.get(phase, ("trainer", "grey"))
            if split and phase == "generate":
                continue  # drawn from the engines' spans below
            rows = ["trainer", "rollout"] if row == "both" or not split else [row]
            for r in rows:
                ax.barh(r, end - start, left=start - t0, color=colour, label=None if phase in seen else phase)
                seen.add(phase)
        for m in records:
            for rank_spans in m.get("trace/rollout", []):
                for start, end in rank_spans:
                    ax.barh("rollout", end - start, left=start - t0, color="tab:green",
                            label=None if "generate" in seen else "generate")
                    seen.add("generate")
        for m in records:  # step boundaries
            ax.axvline(min(s[1] for s in m["trace/controller"]) - t0, color="black", linewidth=0.6)
        ax.set_title(f"{name}: steps {records[0]['step']}..{records[-1]['step']}", fontsize=10)
        ax.set_xlabel("seconds")
        ax.legend(loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/grpo_smollm2.yaml")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-async"))
    p.add_argument("--modes", default=",".join(PLACEMENTS),
                   help=f"comma-separated, of: {', '.join(PLACEMENTS)} (default: all)")
    p.add_argument("--async-staleness", type=int, default=2,
                   help="rollout.max_staleness of the fully_async modes (a long tail needs more: a sample "
                        "spanning more updates than this starts again)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    from hpcrl.config import load_config

    cfg = load_config(args.config, args.overrides)
    workers = cfg.trainer.nnodes * cfg.trainer.workers_per_node
    if workers < 2:
        p.error(f"{args.config}: {workers} worker(s); the split placement needs at least 2")
    split = [f"trainer.rollout_workers={workers // 2}"]
    chosen = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in PLACEMENTS]
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {list(PLACEMENTS)}")
    results: dict[str, list[dict]] = {name: [] for name in chosen}
    for k in range(args.rounds):
        seed = [f"trainer.seed={int(cfg.trainer.seed) + k}"]
        for name in chosen:
            extra = PLACEMENTS[name]
            if "rollout.mode=fully_async" in extra:
                extra = [*extra, f"rollout.max_staleness={args.async_staleness}"]
            r = run_once(args.config, args.steps, [*args.overrides, *seed, *extra, *(split if extra else [])])
            results[name].append(r)
            phases = ", ".join(f"{ph} {v:.1f}" for ph, v in r["phases"].items() if v >= 0.05)
            lengths = [m["response_length/mean"] for m in r["records"]]
            stream = ""
            if any("stream/dropped_groups" in m for m in r["records"]):
                total = {key: sum(m.get(f"stream/{key}", 0.0) for m in r["records"])
                         for key in ("dropped_groups", "tokens_thrown_away", "tokens_generated")}
                stream = (f"; stream: {total['dropped_groups']:.0f} group(s) dropped for staleness, "
                          f"{total['tokens_thrown_away']:.0f} of {total['tokens_generated']:.0f} tokens thrown "
                          f"away, samples spanning versions "
                          f"{statistics.mean(m['stream/multi_version_share'] for m in r['records']):.2f}, "
                          f"staleness mean {statistics.mean(m['stream/staleness_mean'] for m in r['records']):.2f} "
                          f"max {max(m['stream/staleness_max'] for m in r['records']):.0f}, engine idle "
                          f"{statistics.mean(m['stream/engine_idle_frac'] for m in r['records'][1:]):.2f}")
            print(f"[bench_async] round {k + 1} {name}: step {r['step_s']:.1f} s ({phases}); "
                  f"load {r['load_before']:.2f} -> {r['load_after']:.2f}, steal {r['steal_s']:.1f} s; "
                  f"rewards {r['reward']}; response length mean {statistics.mean(lengths):.0f} (by step "
                  f"{[round(x) for x in lengths]}), max {max(m['response_length/max'] for m in r['records']):.0f}, "
                  f"cut {statistics.mean(m['response_length/clip_ratio'] for m in r['records']):.2f}{stream}",
                  flush=True)
    samples = cfg.data.train_batch_size * cfg.rollout.n  # every step trains this many
    steady = args.steps - 1
    print(f"\n{workers} workers ({args.config}); {samples} samples a step; over {args.rounds} round(s), "
          f"steps 2..{args.steps} (medians over the rounds):")
    rate = {name: statistics.median(steady * samples / r["steady_s"] for r in rs) for name, rs in results.items()}
    base = [b for b in ("colocated", "split sync", "split one-step-off") if b in rate]
    for name, rs in results.items():
        step = statistics.median(r["step_s"] for r in rs)
        tokens = statistics.median(r["tokens"] * samples / r["steady_s"] for r in rs)
        print(f"  {name:<30} median step {step:6.1f} s  mean step {samples / rate[name]:6.1f} s  "
              f"{rate[name]:.3f} samples/s  {tokens:7.1f} trained response tokens/s  "
              + "  ".join(f"{rate[name] / rate[b]:.2f}x {b}" for b in base))
    if args.rounds > 1:
        print("training reward over the run (mean of steps 1..STEPS), per-seed difference from each baseline, "
              "mean +- standard error over the rounds:")
        mean_reward = {name: [statistics.mean(r["reward"]) for r in rs] for name, rs in results.items()}
        for name in results:
            diffs = {b: [x - y for x, y in zip(mean_reward[name], mean_reward[b], strict=True)]
                     for b in base if b != name}
            print(f"  {name:<30} reward {statistics.mean(mean_reward[name]):.3f} "
                  f"(rounds {[round(x, 3) for x in mean_reward[name]]})  "
                  + "  ".join(f"{statistics.mean(d):+.3f} +- {statistics.stdev(d) / len(d) ** 0.5:.3f} vs {b}"
                              for b, d in diffs.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    draw({name: rs[-1]["records"][1:] for name, rs in results.items()}, args.out / "timeline.png")
    print(f"timeline: {args.out / 'timeline.png'}")


if __name__ == "__main__":
    sys.exit(main())
