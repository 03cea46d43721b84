"""Shared-memory segments that killed jobs leave in /dev/shm, and their removal at start.

MPI (MPICH's `mpich_shm_*`) and vLLM's CPU communicator (`*cpushm*`) keep their intra-node
traffic in POSIX shared memory. A rank killed with SIGKILL never unlinks its segments: they stay
in /dev/shm, holding RAM (tmpfs) until the node reboots. vLLM's names were also fixed (the same
for every job on the node), so the next rollout world on the node failed at start with
`create shm in SHMManager failed. errno: 17` (EEXIST); hpcrl now gives them a name unique to the
job (`hpcrl.engines.vllm.engine`), and MPICH's already carry a per-job hash.

When it runs: for `hpcrl run` and other local launches, on every rank before MPI starts
(launchers/hpcrl_entry.py). Under Slurm, before the world's srun step, once per node (the
launcher here, `srun --het-group=1` one task per worker node: `python -m hpcrl.launch.shm`), and
not in the ranks. Why: MPICH's hash comes from the step's id, so a requeued job's world reuses the
names its killed predecessor left, and a rank removing them could remove a segment that a faster
rank of the same node had just opened. Removed before the step starts, nothing of the new world
exists. (The garbled pmi2 requests once blamed on this had another cause: hpcrl/launch/commands.py,
SLURM_PMI2_ENV.)
A segment is stale when it matches one of `PATTERNS`, belongs to this user, is older than
`min_age_s`, and no process on the node has it mapped or open (read from /proc/*/maps and
/proc/*/fd). The age bound protects a segment another job on the node has just created and not
yet mapped; a live job's segments are always mapped, so they are never removed.
"""

from __future__ import annotations

import fnmatch
import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PATTERNS = ("mpich_shm_*", "*cpushm*")


def _in_use(dir_: Path) -> set[str]:
    """Names of files under dir_ that some process we can inspect has mapped or open."""
    prefix = str(dir_).rstrip("/") + "/"
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        used.add(line[at + len(prefix):].rstrip("\n").removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(prefix):].removesuffix(" (deleted)"))
        except OSError:  # the process ended, or it is another user's
            continue
    return used


def segment_age_s(st: os.stat_result, now: float) -> float:
    """Seconds since a segment was created or last changed."""
    return now - max(st.st_mtime, st.st_ctime)


def stale_segments(dir_: Path = SHM_DIR, min_age_s: float = 2.0) -> list[Path]:
    """This user's segments under dir_ that match PATTERNS and that no process maps or holds open."""
    try:
        entries = list(os.scandir(dir_))
    except OSError:
        return []
    now, uid = time.time(), os.geteuid()
    candidates = []
    for e in entries:
        if not any(fnmatch.fnmatchcase(e.name, p) for p in PATTERNS):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == uid and segment_age_s(st, now) >= min_age_s and e.is_file(follow_symlinks=False):
            candidates.append(e.name)
    if not candidates:
        return []  # the common case: no scan of /proc
    used = _in_use(dir_)
    return [dir_ / name for name in sorted(candidates) if name not in used]


def remove_stale_segments(dir_: Path = SHM_DIR, min_age_s: float = 2.0) -> list[Path]:
    """Unlink the stale segments (see `stale_segments`); returns those removed."""
    removed = []
    for path in stale_segments(dir_, min_age_s):
        try:
            path.unlink()
            removed.append(path)
        except OSError:  # e.g. another rank of this node removed it first
            continue
    return removed


def describe_removed(removed: list[Path]) -> str:
    names = ", ".join(p.name for p in removed[:3]) + (", ..." if len(removed) > 3 else "")
    return f"removed {len(removed)} shared-memory segment(s) that killed jobs left in {removed[0].parent} ({names})"


if __name__ == "__main__":  # one task per node, before a Slurm job's world starts
    import socket
    import sys

    gone = remove_stale_segments()
    if gone:
        print(f"[hpcrl shm] {socket.gethostname()}: {describe_removed(gone)}", file=sys.stderr, flush=True)
