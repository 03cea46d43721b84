"""Where a run's numbers go: `metrics.jsonl` (one JSON object per step), TensorBoard, the log.

metrics.jsonl is the run's record that tools read (`hpcrl status`, tests, plots). It is appended
across restarts; a resumed run first cuts it back to the checkpoint's cursor, so steps that were
done after the last checkpoint (and are about to be redone) are not recorded twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpcrl.trainer.progress import duration, phase_running

log = logging.getLogger("hpcrl")

# Wall-clock quantities: they differ between otherwise identical runs.
TIMING_PREFIXES = ("time/", "throughput/")


class PhaseTimer:
    """Wall time of each phase of a step (`time/<phase>` metrics). Each phase is also announced to
    the active progress reporter (hpcrl.trainer.progress), which logs a line while a long one runs."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        # [phase, start, end] in unix time: the step's timeline (trace/controller in the step record)
        self.spans: list[list[Any]] = []

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t, start = time.perf_counter(), time.time()
        try:
            with phase_running(phase):
                yield
        finally:
            self.seconds[phase] += time.perf_counter() - t
            self.spans.append([phase, round(start, 4), round(time.time(), 4)])


def peak_memory_metrics(per_rank: Sequence[dict[str, float]], ranks: Sequence[int] | None = None
                        ) -> dict[str, float]:
    """memory/<key>_max and memory/<key>_mean over the worker processes, from each one's
    `peak_memory()` (hpcrl.workers.memory); with `ranks` (their MPI ranks, in the same order) also
    memory/rank<R>/<key> for each."""
    by_key: dict[str, list[float]] = defaultdict(list)
    out: dict[str, float] = {}
    for i, d in enumerate(per_rank):
        for k, v in d.items():
            by_key[k].append(v)
            if ranks is not None:
                out[f"memory/rank{ranks[i]}/{k}"] = v
    for key, values in by_key.items():
        out[f"memory/{key}_max"] = max(values)
        out[f"memory/{key}_mean"] = sum(values) / len(values)
    return out


def distribution_metrics(prefix: str, values: Any, mask: Any = None) -> dict[str, float]:
    """<prefix>/mean, /std, /min, /max of a tensor's entries (where `mask` is set, when given)."""
    import torch

    v = torch.as_tensor(values).float()
    if mask is not None:
        v = v[torch.as_tensor(mask).bool()]
    if v.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/std": float(v.std()) if v.numel() > 1 else 0.0,
            f"{prefix}/min": float(v.min()), f"{prefix}/max": float(v.max())}


def per_source_metrics(prefix: str, values: Any, sources: Sequence[str]) -> dict[str, float]:
    """<prefix>/<data source>/mean and /std of per-sample values, one pair per data source."""
    import torch

    v = torch.as_tensor(values).float()
    out: dict[str, float] = {}
    for source in sorted(set(sources)):
        mine = v[torch.tensor([s == source for s in sources])]
        out[f"{prefix}/{source}/mean"] = float(mine.mean())
        out[f"{prefix}/{source}/std"] = float(mine.std()) if mine.numel() > 1 else 0.0
    return out


def phase_throughput(seconds: dict[str, float], tokens: dict[str, float]) -> dict[str, float]:
    """throughput/<phase>_tokens_per_s: the tokens each phase processed over its wall time (phases
    that did not run this step, or ran no tokens, are left out)."""
    return {f"throughput/{phase}_tokens_per_s": n / seconds[phase]
            for phase, n in tokens.items() if n > 0 and seconds.get(phase, 0.0) > 0}


def setup_logging(log_file: Path, level: str = "INFO") -> None:
    """The controller's log: appended to `log_file`, and on the terminal what hpcrl.controller.console
    lets through (hpcrl's lines and errors; everything with logging.verbose)."""
    from hpcrl.controller.console import setup_controller_logging

    setup_controller_logging(str(log_file), level)


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsWriter:
    """Appends one line per step to `run_dir/metrics.jsonl` (flushed and fsynced: a preempted job
    keeps every finished step) and mirrors scalars to TensorBoard when enabled, and to W&B when a
    sink is given (hpcrl.trainer.wandb_sink)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb: Any = None):
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = None
        self.wandb = wandb
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                log.warning("tensorboard is not installed; metrics go to %s only", self.path)

    def cursor(self) -> int:
        """Bytes of complete lines written so far (saved in checkpoints)."""
        return self.path.stat().st_size if self.path.exists() else 0

    def truncate(self, cursor: int) -> None:
        """Drop lines after `cursor` (steps after the checkpoint we resume from)."""
        if self.path.exists() and self.path.stat().st_size > cursor:
            with open(self.path, "r+b") as f:
                f.truncate(cursor)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log_step(step, record)

    def write_validation(self, after_steps: int, val: dict[str, Any]) -> None:
        """validation.jsonl: one record per validation, keyed by the optimizer steps done before it
        (a resumed run may validate the same point again; readers keep the last record per key)."""
        record = {"after_steps": after_steps, **{k.removeprefix("val/"): _plain(v) for k, v in val.items()}}
        with open(self.path.with_name("validation.jsonl"), "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if self.tb is not None:
            for k, v in val.items():
                self.tb.add_scalar(k if k.startswith("val/") else f"val/{k}", float(v), after_steps)
        if self.wandb is not None:
            self.wandb.log_validation(after_steps, val)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None


def read_records(path: Path, key: str) -> list[dict[str, Any]]:
    """The JSON lines of `path`, the last one per `key` (a resumed run may redo a validation point),
    sorted by it; an unfinished last line (a run writing now) is skipped. Empty without the file."""
    if not path.exists():
        return []
    by_key: dict[Any, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and key in rec:
            by_key[rec[key]] = rec
    return [by_key[k] for k in sorted(by_key)]


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """All step records of a run, one per step (empty when it has none yet)."""
    return read_records(Path(run_dir) / "metrics.jsonl", "step")


def remaining_s(started: float, ends: list[float], left: int) -> float:
    """Seconds until `left` more steps are done, at the pace of this process's steps after its
    first (the first also warms up, so it sets the pace only until a second one is done). `ends`:
    when each step was logged, so a step's time includes the save and validation after the one
    before it."""
    if not ends:
        return 0.0
    per_step = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else ends[0] - started
    return max(per_step, 0.0) * left


def progress_line(step: int, total: int, m: dict[str, Any], eta_s: float | None = None) -> str:
    """One human line per step for the job output; eta_s: seconds to `total` (shown while steps remain).
    KL: to the reference (in the reward, or the KL loss) when there is one, else the update's own
    old-to-new policy KL (ppo_kl)."""
    parts = [f"step {step}/{total}"]
    kl_key = next((k for k in ("actor/kl", "actor/kl_loss") if k in m), None)
    for key, label, fmt in (("reward/mean", "reward", "{:.3f}"), ("reward/acc", "acc", "{:.3f}"),
                            ("response_length/mean", "len", "{:.1f}"), ("actor/pg_loss", "pg_loss", "{:+.4f}"),
                            ("critic/vf_loss", "vf_loss", "{:.4f}"),
                            (kl_key or "actor/ppo_kl", "kl" if kl_key else "ppo_kl", "{:+.4f}"),
                            ("actor/entropy", "entropy", "{:.3f}"),
                            ("dpo/loss", "loss", "{:.4f}"), ("dpo/rewards/accuracies", "acc", "{:.3f}"),
                            ("dpo/rewards/margins", "margin", "{:+.3f}"),
                            ("time/step", "time", "{:.1f}s"), ("throughput/tokens_per_s", "tok/s", "{:.0f}")):
        if isinstance(m.get(key), (int, float)):
            parts.append(f"{label} " + fmt.format(m[key]))
    if eta_s is not None and step < total:
        parts.append(f"ETA {duration(eta_s)}")
    return " | ".join(parts)
