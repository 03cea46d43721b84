"""`hpcrl plot RUN_DIR`: a run's metrics as PNG files, for a glance at a run that lasts days.

Reads `metrics.jsonl` (one record per step) and `validation.jsonl` (one per validation) from the run
directory, which may belong to a run still going (a line being written is skipped) or resumed (the
last record of a step or validation point counts, as in `hpcrl status`). Writes, by default into
`RUN_DIR/plots/`:

- `rewards.png`: training reward (mean, with +-1 std) and accuracy per step; greedy validation
  reward and accuracy at the steps they were taken after;
- `lengths.png`: response length (mean and max) and prompt length per step, and the share of
  responses cut at max_new_tokens;
- `kl_entropy.png`: every KL and entropy metric the run records (the KL loss or the KL in the
  reward and its coefficient, the old-to-new policy KL of the updates, the entropy when its bonus
  is on);
- `time.png`: seconds per phase as stacked bars per step (the `time/*` metrics), the step's
  wall time as a line;
- `memory.png`: peak memory per step, the max and mean over the workers (`memory/*`: RSS on CPU, CUDA
  peaks on GPU) and each rank's own (`memory/rank<R>/*`, the controller is rank 0) while there are
  few enough of them to tell apart.

matplotlib draws off-screen (the Agg backend): no display is needed on a login node.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcrl.trainer.metrics import read_metrics, read_records

STEP_TOTAL = "time/step"
MAX_RANK_LINES = 24  # memory/rank<R>/* lines drawn one per rank up to this many


class NoMetricsError(RuntimeError):
    """The directory holds no step records to plot."""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)  # "nan"/"inf" are stored as strings


def _series(records: Sequence[dict[str, Any]], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
    pairs = [(float(r[x_key]), float(r[key])) for r in records if _is_number(r.get(key))]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _keys(records: Sequence[dict[str, Any]]) -> list[str]:
    """The numeric metrics of any record, in first-seen order."""
    return list(dict.fromkeys(k for r in records for k, v in r.items() if _is_number(v)))


def _is_kl_or_entropy(key: str) -> bool:
    """actor/kl (the KL loss), actor/kl_coef, actor/ppo_kl (old -> current policy), actor/entropy, ..."""
    last = key.rsplit("/", 1)[-1]
    return last.endswith("kl") or last.startswith("kl_") or "entropy" in last


def _line(ax: Any, records: Sequence[dict[str, Any]], key: str, label: str | None = None, **kw: Any) -> bool:
    xs, ys = _series(records, key)
    if not xs:
        return False
    ax.plot(xs, ys, marker="o", markersize=3, label=label or key, **kw)
    return True


def _finish(fig: Any, ax: Any, title: str, ylabel: str, drew: bool, path: Path, empty_note: str,
            twin: Any = None) -> Path:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if drew:
        handles, labels = ax.get_legend_handles_labels()
        if twin is not None:  # one legend for both axes, past the twin's labels
            more = twin.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        ax.legend(handles, labels, fontsize=8, loc="upper left",  # outside: never over the data
                  bbox_to_anchor=(1.1 if twin is not None else 1.01, 1.0))
    else:
        ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_run(run_dir: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Write the PNGs of `run_dir` into `out_dir` (default RUN_DIR/plots); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    steps = read_metrics(run)
    if not steps:
        raise NoMetricsError(f"{run / 'metrics.jsonl'}: no step records (is {run} a run directory, and has "
                             "its first step finished?)")
    val = read_records(run / "validation.jsonl", "after_steps")
    out = Path(out_dir) if out_dir is not None else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    keys = _keys(steps)
    name = "/".join(run.resolve().parts[-2:])  # the last two parts: many run directories are named "run"
    written = []

    fig, ax = plt.subplots(figsize=(10, 4.5))
    drew = _line(ax, steps, "reward/mean", "train reward (mean)")
    xs, mean = _series(steps, "reward/mean")
    _, std = _series(steps, "reward/std")
    if xs and len(std) == len(mean):
        ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        alpha=0.15, label="train reward +-1 std")
    drew |= _line(ax, steps, "reward/acc", "train accuracy")
    for key, label in (("reward_mean", "validation reward (greedy)"), ("acc", "validation accuracy (greedy)")):
        vx, vy = _series(val, key, "after_steps")
        if vx:
            ax.plot(vx, vy, marker="s", linestyle="--", label=label)
            drew = True
    written.append(_finish(fig, ax, f"{name}: rewards", "reward / accuracy", drew, out / "rewards.png",
                           "no reward metrics recorded"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    drew = False
    for key, label in (("response_length/mean", "response length (mean)"),
                       ("response_length/max", "response length (max)"),
                       ("prompt_length/mean", "prompt length (mean)")):
        drew |= _line(ax, steps, key, label)
    xs, clip = _series(steps, "response_length/clip_ratio")
    twin = None
    if xs:
        twin = ax.twinx()
        twin.plot(xs, clip, color="gray", linestyle=":", marker=".", label="cut at max_new_tokens (share)")
        twin.set_ylabel("share cut at max_new_tokens")
        twin.set_ylim(0, 1.05)
    written.append(_finish(fig, ax, f"{name}: lengths", "tokens", drew, out / "lengths.png",
                           "no length metrics recorded", twin))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    drew = False
    for key in sorted(k for k in keys if _is_kl_or_entropy(k)):
        drew |= _line(ax, steps, key)
    written.append(_finish(fig, ax, f"{name}: KL and entropy", "value", drew, out / "kl_entropy.png",
                           "no KL or entropy metric in metrics.jsonl\n(no KL term, and entropy not logged)"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    phases = [k for k in keys if k.startswith("time/") and k != STEP_TOTAL]
    x = [float(r["step"]) for r in steps]
    bottom = [0.0] * len(steps)
    for key in phases:
        ys = [float(r.get(key, 0.0) or 0.0) for r in steps]
        ax.bar(x, ys, bottom=bottom, label=key.removeprefix("time/"), width=0.8)
        bottom = [b + y for b, y in zip(bottom, ys)]
    drew = bool(phases) | _line(ax, steps, STEP_TOTAL, "step (wall)", color="black")
    written.append(_finish(fig, ax, f"{name}: seconds per phase", "seconds", drew, out / "time.png",
                           "no time/* metrics recorded"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    drew = False
    memory = sorted(k for k in keys if k.startswith("memory/"))
    per_rank = [k for k in memory if k.startswith("memory/rank")]
    for key in [k for k in memory if k not in per_rank]:  # max and mean over the workers
        drew |= _line(ax, steps, key, key.removeprefix("memory/"))
    if len(per_rank) <= MAX_RANK_LINES:  # beyond that a legend of hundreds of ranks says nothing
        for key in per_rank:
            drew |= _line(ax, steps, key, key.removeprefix("memory/"), linewidth=0.8, alpha=0.7)
    written.append(_finish(fig, ax, f"{name}: peak memory per rank", "GB", drew, out / "memory.png",
                           "no memory/* metrics recorded"))
    plt.close(fig)
    if any(k.startswith("stream/") for k in keys):  # rollout.mode=fully_async (hpcrl.trainer.stream)
        written.append(_stream_plot(plt, steps, name, out / "stream.png"))
    return written


def _stream_plot(plt: Any, steps: list[dict[str, Any]], name: str, path: Path) -> Path:
    """The fully asynchronous rollout per step: how many versions behind the trained samples were, the
    share spanning versions, the engines' idle share; what was thrown away on a second axis; below, each
    batch's staleness histogram as stacked bars."""
    fig, (ax, hist) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    bins = sorted({int(k.rsplit("_", 1)[1]) for r in steps for k in r if k.startswith("stream/staleness_share_")})
    x = [float(r["step"]) for r in steps]
    bottom = [0.0] * len(steps)
    for k in bins:
        ys = [float(r.get(f"stream/staleness_share_{k}", 0.0) or 0.0) for r in steps]
        hist.bar(x, ys, bottom=bottom, width=0.8, label=f"{k} version(s) behind")
        bottom = [b + y for b, y in zip(bottom, ys)]
    hist.set_ylabel("share of the batch's samples")
    hist.set_xlabel("step")
    if bins:
        hist.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.1, 1.0))
    else:
        hist.text(0.5, 0.5, "no stream/staleness_share_* metrics recorded", ha="center", transform=hist.transAxes)
    drew = False
    for key, label in (("stream/staleness_mean", "staleness (mean, versions)"),
                       ("stream/staleness_max", "staleness (max, versions)"),
                       ("stream/multi_version_share", "samples spanning versions (share)"),
                       ("stream/older_version_token_share", "tokens of older versions (share)"),
                       ("stream/engine_idle_frac", "engines idle (share of the step)")):
        drew |= _line(ax, steps, key, label)
    twin = ax.twinx()
    for key, label in (("stream/tokens_thrown_away", "tokens thrown away"),
                       ("stream/dropped_groups", "groups dropped (too stale)")):
        xs, ys = _series(steps, key)
        if xs:
            twin.plot(xs, ys, linestyle=":", marker=".", label=label)
    twin.set_ylabel("count")
    path = _finish(fig, ax, f"{name}: fully asynchronous rollout", "versions / share", drew, path,
                   "no stream/* metrics recorded", twin)
    plt.close(fig)
    return path
