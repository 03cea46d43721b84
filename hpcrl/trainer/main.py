"""The training program: what `hpcrl run`, `hpcrl submit` and the sbatch scripts start on every rank.

    python launchers/hpcrl_entry.py hpcrl.trainer.main:main CONFIG [key=value ...]

Rank 0 runs `main` (the controller); the other ranks serve the worker groups it creates. The run
resumes by itself from the latest valid checkpoint of its run directory (checkpoint.resume=auto),
so the same command line starts a run, restarts it after a requeue, or continues it later.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from hpcrl.trainer.preemption import ignore_on_workers

if TYPE_CHECKING:
    from hpcrl.trainer.progress import PhaseProgress

log = logging.getLogger("hpcrl.trainer")

# Every rank imports this module before the runtime starts (see launchers/hpcrl_entry.py).
ignore_on_workers()

# Exit status of a run that stopped because a checkpoint could not be saved (disk full, quota):
# distinct from 3 (NaN/Inf steps) and from a crash (1), see docs/reliability.md.
SAVE_FAILED_EXIT = 4
# Beyond the workers' files: the manifest's line per file, and whole blocks for the small files.
MANIFEST_BYTES_PER_FILE = 256
SMALL_FILE_SLACK = 3 * 4096


def storage_error(exc: BaseException) -> Exception | None:
    """The checkpoint error behind `exc` when a save failed for its storage: the store's
    CheckpointError (DiskFullError included), or a worker's DiskFullError, which arrives as a
    RemoteError. None for anything else (a bug, a lost worker): that ends the run as before."""
    from hpcrl.checkpoint.store import CheckpointError, DiskFullError
    from hpcrl.controller import RemoteError

    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, RemoteError) and exc.failure.exc_type == DiskFullError.__name__:
        f = exc.failure
        return DiskFullError(f"{f.exc_message} (worker {f.where()}, {f.group}.{f.method})")
    return None


class Checkpointer:
    """Saves and restores everything a run needs: the roles' Megatron state (written by the
    workers), the sampler position, the KL controller (RL loops; a trainer without one has
    `kl_ctrl = None`), step and metrics cursor (controller), and files the trainer writes itself
    (`save_controller_files(folder)` -> records, `load_controller_files(folder)`, when it has them)."""

    def __init__(self, cfg: DictConfig, trainer: Any, metrics: Any):
        from hpcrl.checkpoint.store import CheckpointStore

        c = cfg.checkpoint
        self.cfg = cfg
        self.trainer = trainer
        self.metrics = metrics
        self.store = CheckpointStore(Path(c.dir), keep_last=c.keep_last, keep_every=c.keep_every)
        self.async_save = bool(c.async_save)
        # an async save in progress: its folder, step, controller state and the controller's own files
        self.pending: tuple[Path, int, dict[str, Any], list[Any]] | None = None
        # on_save_error=stop: train() ends the run when a save returns False
        self.stop_on_error = c.get("on_save_error", "stop") == "stop"
        self.failed_steps: list[int] = []
        from hpcrl.checkpoint.compat import architecture

        # what a resume checks the model against (hpcrl.checkpoint.compat), wherever the folder moves
        model_path = OmegaConf.select(cfg, "model.path", default=None, throw_on_missing=False)
        self.model_architecture = architecture(model_path) if model_path else None

    def controller_state(self) -> dict[str, Any]:
        t = self.trainer
        state = {"step": t.step, "sampler": t.sampler.state_dict(), "model_architecture": self.model_architecture}
        if getattr(t, "kl_ctrl", None) is not None:
            state["kl_ctrl"] = t.kl_ctrl.state_dict()
        return {**state, "metrics_cursor": self.metrics.cursor(), "saved_at": time.time()}

    def needed_bytes(self, state: dict[str, Any], config_yaml: str) -> int:
        """~Bytes the save of the current state writes, all ranks together (they share the file
        system of checkpoint.dir, so their sizes add up), and the controller's own files (the RL
        loop's batches generated ahead)."""
        per_rank = [int(n) for group in self.trainer.trained_groups() for n in group.checkpoint_nbytes()]
        own_nbytes = getattr(self.trainer, "controller_files_nbytes", None)
        own = int(own_nbytes()) if own_nbytes is not None else 0
        files = 3 * len(per_rank) + 2 + (1 if own else 0)
        return (sum(per_rank) + own + len(json.dumps(state, indent=1, sort_keys=True)) + len(config_yaml)
                + MANIFEST_BYTES_PER_FILE * files + SMALL_FILE_SLACK)

    def save(self, wait: bool = False) -> bool:
        """Checkpoint the current step. With async_save the workers write in the background while
        the next step runs; the commit happens at the next `finish_pending` (or now if `wait`).

        False: the storage refused the save (disk full, quota, a commit that did not verify); it
        was logged with the path and the bytes, its partial files are gone and the previous
        checkpoint is still the latest valid one. Other errors raise."""
        from hpcrl.config import to_yaml

        if not self.finish_pending() and self.stop_on_error:
            return False
        step = self.trainer.step
        t = time.perf_counter()
        asynchronous = self.async_save and not wait
        state = self.controller_state()
        config_yaml = to_yaml(self.cfg)
        tmp: Path | None = None
        try:
            # refused before anything is written: a save that fills the disk half-way costs the
            # write and, on a shared file system, space other jobs need
            self.store.check_space(step, self.needed_bytes(state, config_yaml))
            tmp = self.store.begin(step)
            records: list[Any] = []
            # what only the controller holds besides `state` (the RL loop's batches generated ahead)
            save_files = getattr(self.trainer, "save_controller_files", None)
            own = save_files(tmp) if save_files is not None else []
            for group in self.trainer.trained_groups():
                records += [r for rank in group.save_checkpoint(str(tmp), async_save=asynchronous)
                            for r in rank or []]
            if asynchronous:
                self.pending = (tmp, step, state, own)
                log.info("checkpoint of step %d: state snapshotted in %.1f s, writing in the background", step,
                         time.perf_counter() - t)
                return True
            path = self.store.commit(tmp, step, records + own, state, config_yaml)
        except Exception as e:
            err = storage_error(e)
            if err is None:
                raise
            return self._failed(step, tmp, err)
        log.info("checkpoint of step %d saved to %s in %.1f s", step, path, time.perf_counter() - t)
        return True

    def finish_pending(self) -> bool:
        """Wait for a background save and commit it. False as for `save`: a writer's error
        surfaces here, on the controller, not in the worker's thread."""
        from hpcrl.config import to_yaml

        if self.pending is None:
            return True
        tmp, step, state, own = self.pending
        self.pending = None
        t = time.perf_counter()
        try:
            records = [r for group in self.trainer.trained_groups() for rank in group.wait_checkpoint()
                       for r in rank or []]
            path = self.store.commit(tmp, step, records + own, state, to_yaml(self.cfg))
        except Exception as e:
            err = storage_error(e)
            if err is None:
                raise
            return self._failed(step, tmp, err)
        log.info("checkpoint of step %d committed to %s (waited %.1f s)", step, path, time.perf_counter() - t)
        return True

    def _settle(self) -> None:
        """Return once no worker writes into the folder of a failed save any more. A call fails as
        soon as one rank fails, while the others may still be writing; calls run in order on
        every rank, so once wait_checkpoint (which also joins an async writer) has returned on all
        of them, nobody writes. No collective is involved: a rank that failed blocks no other."""
        for group in self.trainer.trained_groups():
            try:
                group.wait_checkpoint()
            except Exception as e:  # another writer of the same save failed too: it has stopped
                if storage_error(e) is None:
                    raise

    def _failed(self, step: int, tmp: Path | None, err: Exception) -> bool:
        from hpcrl.checkpoint.files import format_bytes

        after = ""
        if tmp is not None:  # it failed while writing (an up-front refusal wrote nothing)
            self._settle()
            self.store.abandon(tmp)  # the space comes back now; `latest` never named it
            latest = self.store.latest_valid()
            after = (f". Its partial files are removed, {format_bytes(self.store.free_bytes())} are free in "
                     f"{self.store.root}; the last valid checkpoint is {latest or 'none'}")
        self.failed_steps.append(step)
        if self.stop_on_error:
            log.error("checkpoint of step %d not saved: %s%s", step, err, after)
        else:
            log.warning("checkpoint of step %d not saved: %s%s. Training goes on (checkpoint.on_save_error="
                        "continue)", step, err, after)
        return False

    def resume(self) -> bool:
        """Restore the latest valid checkpoint (checkpoint.resume=auto) or a given folder."""
        how = self.cfg.checkpoint.resume
        if how == "never":
            return False
        path = self.store.latest_valid() if how == "auto" else Path(how)
        if path is None:
            return False
        t = time.perf_counter()
        state = self.store.load_controller_state(path)
        for group in self.trainer.trained_groups():
            group.load_checkpoint(str(path))
        tr = self.trainer
        tr.step = int(state["step"])
        tr.sampler.load_state_dict(state["sampler"])
        if getattr(tr, "kl_ctrl", None) is not None:
            tr.kl_ctrl.load_state_dict(state["kl_ctrl"])
        load_files = getattr(tr, "load_controller_files", None)
        if load_files is not None:
            load_files(Path(path))
        self.metrics.truncate(int(state["metrics_cursor"]))
        log.info("resumed from %s (step %d, sampler %s) in %.1f s", path, tr.step, state["sampler"],
                 time.perf_counter() - t)
        from hpcrl.checkpoint.compat import changed_keys

        changed = changed_keys(path, OmegaConf.to_container(self.cfg, resolve=True))
        if changed:  # what the preflight allowed to change (hpcrl.checkpoint.compat), said once
            log.info("resumed with other settings than the checkpoint's: %s", "; ".join(changed))
        return True


def nonfinite_in_a_row(step_metrics: dict[str, float]) -> int:
    """Optimizer steps the actor or the critic has skipped in a row for a NaN/Inf gradient."""
    return int(max(step_metrics.get(f"{role}/nonfinite_steps_in_a_row", 0) for role in ("actor", "critic")))


def nonfinite_limit_reached(cfg: DictConfig, step_metrics: dict[str, float]) -> bool:
    """The actor or the critic has skipped trainer.max_nonfinite_steps optimizer steps in a row."""
    limit = int(cfg.trainer.max_nonfinite_steps)
    return limit > 0 and nonfinite_in_a_row(step_metrics) >= limit


def make_trainer(cfg: DictConfig) -> Any:
    """The loop of `algorithm.name`: hpcrl.trainer.ppo (the RL family) or hpcrl.trainer.dpo. Both
    offer what `train` drives: step, sampler, kl_ctrl (None without one), trained_groups(),
    train_step(step) -> metrics (validation ones named val/*), val_data, final_validation(), close()."""
    from hpcrl.config import is_dpo

    if is_dpo(cfg):
        from hpcrl.trainer.dpo import DPOTrainer

        return DPOTrainer(cfg)
    from hpcrl.trainer.ppo import PPOTrainer

    return PPOTrainer(cfg)


def train(cfg: DictConfig) -> int:
    """Build the groups, resume if there is something to resume, run the remaining steps; long phases
    get progress lines meanwhile (hpcrl.trainer.progress)."""
    from hpcrl.trainer.progress import PhaseProgress, activate

    progress = PhaseProgress(logging.getLogger("hpcrl.progress").info, float(cfg.logging.progress_after_s),
                             float(cfg.logging.progress_every_s))
    activate(progress)
    progress.start()
    try:
        return _train(cfg, progress)
    finally:
        progress.stop()
        activate(None)


def _train(cfg: DictConfig, progress: PhaseProgress) -> int:
    from hpcrl.trainer.metrics import MetricsWriter, progress_line, remaining_s
    from hpcrl.trainer.preemption import StopWatch, requeue_self, under_slurm
    from hpcrl.trainer.progress import phase_running
    from hpcrl.trainer.wandb_sink import make_wandb_sink
    from hpcrl.workers.memory import peak_memory

    run_dir = Path(cfg.trainer.run_dir)
    total = int(cfg.trainer.total_steps)
    log_every = int(cfg.logging.log_every)
    watch = StopWatch()
    metrics = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, wandb=make_wandb_sink(cfg))
    trainer = make_trainer(cfg)
    ckpt = Checkpointer(cfg, trainer, metrics)
    if ckpt.resume():
        log.info("continuing at step %d of %d", trainer.step + 1, total)
    save_every = int(cfg.checkpoint.save_every)
    last_step_s = 0.0
    stopped = None
    started, ends = 0.0, []  # when this process's first step began and each step was logged (the ETA)

    def save_failed() -> int:
        log.error("stopping after step %d of %d: the checkpoint of step %d could not be saved (the error is above); "
                  "the last valid checkpoint in %s is intact and a rerun resumes from it. Exit status %d.",
                  trainer.step, total, ckpt.failed_steps[-1], cfg.checkpoint.dir, SAVE_FAILED_EXIT)
        trainer.close()
        metrics.close()
        return SAVE_FAILED_EXIT

    while trainer.step < total:
        stopped = watch.should_stop(last_step_s)
        if stopped:
            break
        step = trainer.step + 1
        t = time.perf_counter()
        first_here = not started
        started = started or t
        progress.context = f"step {step}/{total}"
        m = trainer.train_step(step)
        # the controller's own peak (the workers' are in m): rank 0 of the memory/rank<R>/* metrics
        m.update({f"memory/rank0/{k}": v for k, v in peak_memory().items()})
        progress.learn_step(m)
        trainer.step = step
        if not ckpt.finish_pending() and ckpt.stop_on_error:
            return save_failed()
        metrics.write(step, m)
        validation = {k: v for k, v in m.items() if k.startswith("val/")}
        if validation:  # the step began with a validation (after step - 1 steps)
            metrics.write_validation(step - 1, validation)
        ends.append(time.perf_counter())
        if first_here or step % log_every == 0 or step == total:
            log.info(progress_line(step, total, m, remaining_s(started, ends, total - step)))
        if nonfinite_limit_reached(cfg, m):
            # no save: the weights are those of the last finite step, but the last checkpoint is
            # the last state known good, and a rerun resumes from it
            log.error("stopping at step %d: %d optimizer steps in a row had a NaN/Inf loss or gradient and were "
                      "skipped (trainer.max_nonfinite_steps=%d); nothing saved, the last checkpoint in %s is "
                      "intact. Lower the learning rate or check the rewards and data.", step,
                      nonfinite_in_a_row(m), cfg.trainer.max_nonfinite_steps, cfg.checkpoint.dir)
            trainer.close()
            metrics.close()
            return 3
        last_step_s = time.perf_counter() - t
        stopped = watch.should_stop(last_step_s)
        if stopped or (save_every and step % save_every == 0 and step < total):
            # the save before a stop is the run's state on disk: its failure ends the run whatever
            # on_save_error says (a requeue would resume from an older checkpoint and fail again)
            with phase_running("checkpoint_save"):
                saved = ckpt.save(wait=bool(stopped))
            if not saved and (ckpt.stop_on_error or stopped):
                return save_failed()
        if stopped:
            break
    if stopped:
        if not ckpt.finish_pending():
            return save_failed()
        log.warning("stopping after step %d of %d: %s; checkpoint saved", trainer.step, total, stopped)
        requeue = under_slurm() and cfg.slurm.requeue
        if requeue and requeue_self():
            log.info("requeued: the job restarts and resumes from step %d", trainer.step + 1)
        trainer.close()
        metrics.close()
        return 0
    progress.context = f"after step {trainer.step}/{total}"
    if trainer.val_data is not None:
        with phase_running("validate"):
            metrics.write_validation(trainer.step, trainer.final_validation())
    with phase_running("checkpoint_save"):
        saved = ckpt.save(wait=True)
    if not saved:  # the final state: nothing is left to go on with
        return save_failed()
    trainer.close()
    metrics.close()
    if ckpt.failed_steps:
        log.warning("checkpoints of steps %s could not be saved (checkpoint.on_save_error=continue)",
                    ckpt.failed_steps)
    log.info("done: %d steps; metrics in %s, logs in %s, checkpoints in %s", total, run_dir / "metrics.jsonl",
             Path(cfg.logging.dir), Path(cfg.checkpoint.dir))
    return 0


def main() -> int:
    from hpcrl.config import ConfigError, load_config, to_yaml
    from hpcrl.config.validate import config_warnings
    from hpcrl.trainer.metrics import setup_logging
    from hpcrl.trainer.preflight import preflight

    if len(sys.argv) < 2:
        print("usage: hpcrl_entry.py hpcrl.trainer.main:main CONFIG [key=value ...]", file=sys.stderr)
        return 2
    try:
        cfg = load_config(sys.argv[1], sys.argv[2:])
        preflight(cfg)
    except ConfigError as e:
        from hpcrl.controller.stderr_log import terminal

        print("invalid config:\n" + "\n".join(f"  - {p}" for p in e.problems), file=terminal(err=True))
        raise SystemExit(2) from None
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(Path(cfg.logging.dir) / "controller.log", cfg.logging.level)
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    log.info("hpcrl run %s: %s (Slurm job %s, restart %s)", cfg.trainer.experiment, run_dir,
             os.environ.get("SLURM_JOB_ID", "-"), restarts)
    for warning in config_warnings(cfg):  # settings that run but bias the update
        log.warning(warning)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    status = train(cfg)
    if status:
        from hpcrl.launch.allocation import write_verdict

        # a deliberate stop (NaN/Inf steps, ...): the Slurm launcher must not requeue what a restart repeats
        write_verdict(str(run_dir), status)
    return status
