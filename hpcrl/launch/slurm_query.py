"""What Slurm says about an hpcrl job: sacct / squeue / scontrol, parsed; plus Slurm's time format.

Why a module of its own: a hetjob appears in Slurm's tools as several rows (`123+0` the controller,
`123+1` the workers, `123+0.batch` ... the steps, and with `sacct -D` one set per (re)start), and the
job's state is a combination of its components' states. `hpcrl status` and the tests read it here.
Every command runs as an argv list (no shell), with a timeout.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from hpcrl.launch.jobs import base_job_id

SACCT_FIELDS = ("JobID", "State", "Elapsed", "ExitCode", "NodeList", "Start", "End", "Partition", "JobName")

# When the components disagree, the job's state is the first of these that any component has.
_STATE_ORDER = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL", "DEADLINE", "CANCELLED",
                "PREEMPTED", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "PENDING", "COMPLETED")
ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "CONFIGURING",
                           "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED"})

_TIME_RE = re.compile(r"^(?:(?P<d>\d+)-)?(?P<rest>\d+(?::\d+){0,2})$")


def parse_slurm_time(text: str | int) -> int:
    """Slurm's --time formats -> whole minutes (rounded up): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.

    Why: submitit's executor wants minutes, and a typo must fail before anything is submitted.
    """
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"time limit must be positive, got {text}")
        return text
    s = str(text).strip()
    m = _TIME_RE.match(s)
    if not m:
        raise ValueError(f"not a Slurm time limit: {s!r} (use MINUTES, HH:MM:SS or D-HH:MM:SS)")
    parts = [int(p) for p in m.group("rest").split(":")]
    days = int(m.group("d") or 0)
    if m.group("d") is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, sec = (parts + [0, 0])[:3]
    elif len(parts) == 1:  # M
        h, mi, sec = 0, parts[0], 0
    elif len(parts) == 2:  # M:S
        h, mi, sec = 0, parts[0], parts[1]
    else:  # H:M:S
        h, mi, sec = parts
    minutes = math.ceil((((days * 24 + h) * 60 + mi) * 60 + sec) / 60)
    if minutes <= 0:
        raise ValueError(f"time limit must be positive, got {s!r}")
    return minutes


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def normalize_state(state: str) -> str:
    """`CANCELLED by 0` -> `CANCELLED`; sacct and squeue spell some states with extras."""
    return state.split()[0].rstrip("+") if state.strip() else "UNKNOWN"


def combine_states(states: list[str]) -> str:
    """One state for a job from its components' states (see _STATE_ORDER)."""
    norm = [normalize_state(s) for s in states if s]
    if not norm:
        return "UNKNOWN"
    for s in _STATE_ORDER:
        if s in norm:
            return s
    return norm[0]


def parse_sacct(text: str) -> list[dict[str, str]]:
    """Rows of `sacct --parsable2 --noheader -o <SACCT_FIELDS>`; JobName is last so a `|` in it survives."""
    rows = []
    n = len(SACCT_FIELDS)
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", n - 1)
        if len(parts) < n:
            continue
        rows.append(dict(zip(SACCT_FIELDS, parts)))
    return rows


def sacct_rows(job_id: str) -> list[dict[str, str]] | None:
    """All rows of the job, every (re)start included (`-D`); None when sacct is not usable here."""
    try:
        r = _run(["sacct", "-D", "-j", base_job_id(job_id), "--parsable2", "--noheader",
                  "-o", ",".join(SACCT_FIELDS)])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return parse_sacct(r.stdout)


@dataclass
class Component:
    """One het component (or the whole job when it is not heterogeneous), latest (re)start."""

    job_id: str
    state: str
    elapsed: str = ""
    exit_code: str = ""
    nodes: str = ""
    partition: str = ""


@dataclass
class JobStatus:
    job_id: str
    state: str
    name: str = ""
    elapsed: str = ""
    restarts: int = 0
    components: list[Component] = field(default_factory=list)
    run_dir: str | None = None
    step: int | None = None
    source: str = ""  # which tool answered: sacct | squeue

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def status_from_sacct(job_id: str, rows: list[dict[str, str]]) -> JobStatus | None:
    """Fold sacct rows into a JobStatus: steps (`.batch`, `.0`) are ignored, requeued instances counted."""
    base = base_job_id(job_id)
    comp_re = re.compile(rf"^{base}(?:\+(\d+))?$")
    latest: dict[int, dict[str, str]] = {}
    requeues: dict[int, int] = {}
    for row in rows:  # sacct -D lists instances oldest first
        m = comp_re.match(row["JobID"])
        if not m:
            continue
        idx = int(m.group(1) or 0)
        if normalize_state(row["State"]) == "REQUEUED":
            requeues[idx] = requeues.get(idx, 0) + 1
        latest[idx] = row
    if not latest:
        return None
    comps = [Component(job_id=latest[i]["JobID"], state=normalize_state(latest[i]["State"]),
                       elapsed=latest[i]["Elapsed"], exit_code=latest[i]["ExitCode"],
                       nodes=latest[i]["NodeList"], partition=latest[i]["Partition"]) for i in sorted(latest)]
    lead = latest[min(latest)]
    return JobStatus(job_id=base, state=combine_states([c.state for c in comps]), name=lead["JobName"],
                     elapsed=lead["Elapsed"], restarts=requeues.get(min(latest), 0), components=comps,
                     source="sacct")


def squeue_status(job_id: str) -> JobStatus | None:
    """Fallback without accounting: squeue knows pending and running jobs only."""
    base = base_job_id(job_id)
    try:
        r = _run(["squeue", "-h", "-j", base, "-o", "%i|%T|%M|%P|%N|%j"])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or not r.stdout.strip():
        return None
    comps = []
    name = ""
    for line in r.stdout.splitlines():
        parts = line.split("|", 5)
        if len(parts) < 6:
            continue
        comps.append(Component(job_id=parts[0], state=normalize_state(parts[1]), elapsed=parts[2],
                               partition=parts[3], nodes=parts[4]))
        name = name or parts[5]
    if not comps:
        return None
    return JobStatus(job_id=base, state=combine_states([c.state for c in comps]), name=name,
                     elapsed=comps[0].elapsed, components=comps, source="squeue")


def scontrol_restarts(job_id: str) -> int | None:
    """`Restarts=` of the job while slurmctld still knows it (MinJobAge), else None."""
    value = (scontrol_job(job_id) or {}).get("Restarts", "")
    return int(value) if value.isdigit() else None


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """`scontrol -o show job JOB` of the job's leader as {field: value} (its first line: the leader of a
    hetjob), or None when slurmctld does not know the job or does not answer."""
    try:
        r = _run(["scontrol", "-o", "show", "job", base_job_id(job_id)])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or not r.stdout.strip():
        return None
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout.splitlines()[0]))


# States of a job that Slurm has taken back for a restart (Restarts= shows it too, from the moment of the
# requeue, while the old run is still being stopped).
_REQUEUED_STATES = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


@dataclass
class RequeueResult:
    requeued: bool
    how: str  # "requeued", "already requeued (...)": for the log line; on failure, the reason


def requeue_job(job_id: str, restart: int) -> RequeueResult:
    """`scontrol requeue JOB`, idempotent: a job that Slurm is already requeuing counts as requeued.

    `restart` is this run's SLURM_RESTART_COUNT. Why idempotent: Slurm's requeue stops the running job
    by signalling every process of its batch step (SIGTERM, and SIGKILL KillWait seconds later), and the
    `scontrol` that asked for it is one of them. When the signal lands before scontrol has exited, the
    requeue has happened but scontrol dies of it, with status -15 and nothing on stdout or stderr: seen
    in CI as `scontrol requeue 8 failed:` with an empty reason right after `*** JOB 8 ... CANCELLED ...
    DUE TO JOB REQUEUE ***`. Two paths of hpcrl (the launcher after a failed srun, the controller after
    a preemption signal) and Slurm itself can also requeue the same job. So a failed call is checked
    against the job's own record: Restarts= above `restart`, or a state of a job taken back, is success.
    """
    leader = base_job_id(job_id)
    try:
        r = _run(["scontrol", "requeue", leader], timeout=60)
        ok, said = r.returncode == 0, (r.stderr or r.stdout).strip()
        status = r.returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, said, status = False, str(e), None
    if ok:
        return RequeueResult(True, "requeued")
    info = scontrol_job(leader) or {}
    restarts = int(info["Restarts"]) if info.get("Restarts", "").isdigit() else None
    state = normalize_state(info.get("JobState", ""))
    if (restarts is not None and restarts > restart) or state in _REQUEUED_STATES:
        if said:
            why = f"scontrol said: {said}"
        elif status is not None and status < 0:
            why = f"scontrol was killed by signal {-status}, the requeue's own stop of the job"
        else:
            why = f"scontrol exited with status {status}"
        return RequeueResult(True, f"already requeued (JobState={state}, Restarts={restarts}; {why})")
    return RequeueResult(False, f"{said or f'no message, exit status {status}'} "
                                f"(JobState={state or '?'}, Restarts={'?' if restarts is None else restarts})")


def last_step(run_dir: str | None) -> int | None:
    """The `step` of the last complete line of {run_dir}/metrics.jsonl (appended across restarts)."""
    if not run_dir:
        return None
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written right now, or the cut-off first line of the tail
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            return rec["step"]
    return None


def job_status(job_id: str, run_dir: str | None = None) -> JobStatus | None:
    """Everything `hpcrl status JOB` shows; None when Slurm knows no such job."""
    rows = sacct_rows(job_id)
    st = status_from_sacct(job_id, rows) if rows else None
    if st is None:
        st = squeue_status(job_id)
    if st is None:
        return None
    restarts = scontrol_restarts(job_id)
    if restarts is not None:
        st.restarts = max(st.restarts, restarts)
    st.run_dir = run_dir
    st.step = last_step(run_dir)
    return st


def is_active(job_id: str) -> bool:
    """Whether the job still holds or waits for an allocation (squeue lists it)."""
    try:
        r = _run(["squeue", "-h", "-j", base_job_id(job_id), "-o", "%T"])
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and any(normalize_state(s) in ACTIVE_STATES for s in r.stdout.split())
