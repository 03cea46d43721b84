"""A small per-user registry: Slurm job id -> the run directory of the hpcrl run it belongs to.

Why: `hpcrl status JOB` reads the run's metrics (the current step), but Slurm does not know where a
run writes. `hpcrl submit` and the in-allocation launcher (so also plain `sbatch sbatch/*.sh` jobs)
record every job here. One JSON object per line in `$HPCRL_JOB_REGISTRY`, else
`$XDG_CACHE_HOME/hpcrl/jobs.jsonl` (default `~/.cache/hpcrl/jobs.jsonl`).

Appends take an exclusive `flock` and write the whole line with one `write(2)` on an `O_APPEND`
descriptor, so concurrent writers (several jobs starting at once, on a shared home too) never
interleave or lose lines. Readers skip lines they cannot parse (e.g. a node that died mid-write).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

# A job as the user types it: 123, a het component 123+1, or an array task 123_4.
JOB_ID_RE = re.compile(r"^(\d+)(?:[+_]\d+)?$")


def registry_path() -> str:
    """Where the registry lives; `HPCRL_JOB_REGISTRY` overrides it (tests, shared project registries)."""
    explicit = os.environ.get("HPCRL_JOB_REGISTRY")
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "hpcrl", "jobs.jsonl")


def base_job_id(job_id: str) -> str:
    """`123+1` / `123_4` / `123` -> `123`: a hetjob is registered (and cancelled) by its leader's id."""
    m = JOB_ID_RE.match(str(job_id).strip())
    if not m:
        raise ValueError(f"not a Slurm job id: {job_id!r} (expected e.g. 123, 123+1 or 123_4)")
    return m.group(1)


def register_job(job_id: str, run_dir: str, **extra: Any) -> None:
    """Record that Slurm job `job_id` writes to `run_dir` (made absolute). Best effort, never raises.

    Why best effort: the trainer calls this at start; a read-only or full home directory must not
    kill a training run, it only makes `hpcrl status JOB` unable to show the step.
    """
    try:
        entry = {"job_id": base_job_id(job_id), "run_dir": os.path.abspath(run_dir), "time": time.time(), **extra}
        line = (json.dumps(entry, ensure_ascii=True) + "\n").encode()
        path = registry_path()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(line)
            while view:  # a regular file takes it in one write; loop only for pathological short writes
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)  # also releases the lock
    except (OSError, ValueError) as e:
        print(f"[hpcrl] warning: could not record job {job_id} in the job registry: {e}", file=sys.stderr)


def iter_jobs() -> Iterator[dict[str, Any]]:
    """Registry entries, oldest first; unreadable lines are skipped."""
    try:
        with open(registry_path(), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and "job_id" in entry and "run_dir" in entry:
                    yield entry
    except FileNotFoundError:
        return


def lookup_run_dir(job_id: str) -> str | None:
    """The run directory last registered for `job_id` (or its hetjob leader), or None."""
    try:
        want = base_job_id(job_id)
    except ValueError:
        return None
    found = None
    for entry in iter_jobs():
        if str(entry["job_id"]) == want:
            found = str(entry["run_dir"])
    return found


def recent_jobs(limit: int = 10) -> list[dict[str, Any]]:
    """The last `limit` distinct jobs in the registry, newest first (for `hpcrl status` without a job)."""
    latest: dict[str, dict[str, Any]] = {}
    for entry in iter_jobs():
        latest.pop(str(entry["job_id"]), None)  # re-insert: dict order = order of last registration
        latest[str(entry["job_id"])] = entry
    return list(reversed(list(latest.values())))[:limit]
