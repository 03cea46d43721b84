"""Weights & Biases for a run, when `logging.wandb.mode` is offline or online (MetricsWriter calls it).

What goes there: every numeric step metric at its step, the validations against their own axis
(`val/after_steps`: W&B steps only grow, and a validation is recorded after the step that follows
it), and the resolved config. The W&B run id is a hash of the run directory, so the restarts of a
run (a requeue, a resume) continue one W&B run (`resume="allow"`); a step redone after a resume is
not logged twice (W&B keeps the first one: it refuses steps below its last).

The API key: only wandb itself reads it, from WANDB_API_KEY, and only in online mode; hpcrl never
handles it. Offline mode needs no key and gets none: it is removed from the environment that wandb
sees, so nothing wandb writes under the run directory can contain it.
wandb's own console capture is off: each rank's output is already in {logging.dir}.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("hpcrl.trainer")

API_KEY_ENV = "WANDB_API_KEY"


def wandb_run_id(run_dir: str | Path) -> str:
    """A W&B run id that is the same for every start of the run in `run_dir`."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class WandbSink:
    """One W&B run; `log_step`, `log_validation`, `close`."""

    def __init__(self, wandb_cfg: Any, run_dir: str | Path, config: dict[str, Any]) -> None:
        import wandb

        mode = str(wandb_cfg.mode)
        folder = Path(str(wandb_cfg.dir))
        folder.mkdir(parents=True, exist_ok=True)
        key = os.environ.pop(API_KEY_ENV, None) if mode == "offline" else None  # see the module docstring
        try:
            self.run = wandb.init(
                project=str(wandb_cfg.project), entity=wandb_cfg.entity, name=str(wandb_cfg.name),
                id=wandb_run_id(run_dir), resume="allow", dir=str(folder), mode=mode, config=config,
                settings=wandb.Settings(console="off", save_code=False))
        finally:
            if key is not None:
                os.environ[API_KEY_ENV] = key
        self.run.define_metric("val/after_steps")
        self.run.define_metric("val/*", step_metric="val/after_steps")
        self.mode = mode
        self.last_step = int(getattr(self.run, "step", 0) or 0)  # a resumed W&B run goes on from its last step
        log.info("W&B run %s (%s, project %s): %s", self.run.id, mode, wandb_cfg.project,
                 getattr(self.run, "dir", folder))

    def log_step(self, step: int, record: dict[str, Any]) -> None:
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k != "step"}
        if step < self.last_step:
            return  # a step redone after a resume: W&B would refuse it with a warning per call
        self.run.log(numbers, step=step)
        self.last_step = step

    def log_validation(self, after_steps: int, val: dict[str, Any]) -> None:
        numbers = {(k if k.startswith("val/") else f"val/{k}"): float(v) for k, v in val.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        numbers["val/after_steps"] = after_steps
        # at the last logged step: W&B steps only grow, and a validation is recorded after its step
        self.run.log(numbers, step=max(self.last_step, after_steps))

    def close(self) -> None:
        offline = self.mode == "offline"
        where = getattr(self.run, "dir", "")
        self.run.finish()
        if offline:
            log.info("W&B offline run in %s: upload it with `wandb sync %s`", Path(where).parent, Path(where).parent)


def make_wandb_sink(cfg: Any) -> WandbSink | None:
    """The sink of `cfg.logging.wandb`, or None when it is disabled."""
    if str(cfg.logging.wandb.mode) == "disabled":
        return None
    from omegaconf import OmegaConf

    return WandbSink(cfg.logging.wandb, cfg.trainer.run_dir, OmegaConf.to_container(cfg, resolve=True))
