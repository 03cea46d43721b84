"""When to stop early: Slurm's warning signal, a termination request, or the job's time running out.

Only the controller decides. Slurm delivers USR1 (`--signal=B:USR1@N`, forwarded by the batch
script to every task) and TERM (scancel, preemption) to all ranks; workers ignore both (see
`ignore_on_workers`) and keep serving until the controller, at the next step boundary, has saved
the checkpoint and shuts them down. So every rank stops at the same step by construction.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from types import FrameType

log = logging.getLogger("hpcrl.preemption")


def under_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


def slurm_job_id() -> str | None:
    """The id that `scontrol requeue` takes: the leader's id for a heterogeneous job."""
    return os.environ.get("SLURM_HET_JOB_ID") or os.environ.get("SLURM_JOB_ID")


def ignore_on_workers() -> None:
    """Called at import on every rank, before the runtime starts: TERM and USR1 must not kill a
    worker in the middle of a step (the controller installs its own handlers afterwards)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _job_end_time() -> float | None:
    """Unix time at which Slurm ends the job (SLURM_JOB_END_TIME, else asked from squeue)."""
    if not under_slurm():
        return None
    value = os.environ.get("SLURM_JOB_END_TIME")
    if not value:
        try:
            r = subprocess.run(["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%e"],
                               capture_output=True, text=True, timeout=30)
            stamp = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
            if stamp and stamp[0].isdigit():
                return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            return None
        return None
    try:
        return float(value)
    except ValueError:
        return None


class StopWatch:
    """The controller's view: has anyone asked us to stop, or will the next step not fit?"""

    def __init__(self, margin_s: float = 60.0):
        self.reason: str | None = None
        self.margin_s = margin_s
        self.end_time = _job_end_time()
        # Off Slurm, USR1 is hydra's notice that a rank exited (the heartbeats handle that) and
        # Ctrl-C keeps its usual meaning; TERM still means "save and stop".
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT) if under_slurm() else (signal.SIGTERM,):
            signal.signal(sig, self._on_signal)
            # restart interrupted system calls: MPI must not see EINTR because of us
            signal.siginterrupt(sig, False)
        if self.end_time:
            log.info("job ends at %s; saving when less than a step + %.0f s is left",
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.end_time)), margin_s)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        # no logging here: handlers run between bytecodes, possibly inside the logging module; one
        # os.write says when the signal came (the stop itself is logged at the step boundary)
        try:
            os.write(2, f"[hpcrl] controller: {name} at {time.strftime('%H:%M:%S')}"
                        f"{'' if self.reason is None else ' (already stopping: ' + self.reason + ')'}\n".encode())
        except OSError:
            pass
        if self.reason is None:
            self.reason = f"signal {name}"

    def should_stop(self, last_step_s: float) -> str | None:
        """Reason to save and stop now, or None. Called at every step boundary."""
        if self.reason is None and self.end_time is not None:
            left = self.end_time - time.time()
            if left < 1.5 * last_step_s + self.margin_s:
                self.reason = f"{left:.0f} s left before the job's time limit"
        return self.reason


def requeue_self() -> bool:
    """Put this job back in the queue (it restarts with SLURM_RESTART_COUNT + 1 and resumes). A job that
    Slurm is already requeuing counts as requeued (hpcrl.launch.slurm_query.requeue_job says why)."""
    from hpcrl.launch.slurm_query import requeue_job

    job = slurm_job_id()
    if job is None:
        return False
    result = requeue_job(job, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
    if not result.requeued:
        log.error("scontrol requeue %s failed: %s", job, result.how)
        return False
    log.info("job %s %s", job, result.how)
    return True
