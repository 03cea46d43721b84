"""Which limit a run hit, and the per-process limits the program gets (rlimits).

`classify` reads the limit that stopped a run from what the program cannot write (its exit status
and signal, the caller's own kills, the cgroup's counters), never from what it prints.
"""

from __future__ import annotations

import math
import os
import signal

from hpcrl.sandbox.config import SandboxConfig

# The last line Python writes when it dies of an exception that an rlimit caused: RLIMIT_AS (ENOMEM),
# RLIMIT_FSIZE (EFBIG; Python ignores SIGXFSZ) and, without a cgroup, RLIMIT_NPROC (EAGAIN). The kernel
# counts none of these, so a program's death of one is recognised from its exit status (1, Python's
# for an uncaught exception) with its traceback's last line.
_UNCAUGHT = b"Traceback (most recent call last):"
_RLIMIT_DEATHS = (
    ("memory", (b"MemoryError", b"OSError: [Errno 12] ")),
    ("file_size", (b"OSError: [Errno 27] ",)),
    ("processes", (b"BlockingIOError: [Errno 11] ", b"RuntimeError: can't start new thread")),
)


def rlimits(config: SandboxConfig, with_cgroup: bool) -> dict[str, tuple[int, int]]:
    """The rlimits of the program's process (resource.RLIMIT_* names); with a cgroup, its pids.max is
    the process limit and RLIMIT_NPROC a backstop one above."""
    limits: dict[str, tuple[int, int]] = {"RLIMIT_CORE": (0, 0),
                                          "RLIMIT_NOFILE": (config.max_open_files, config.max_open_files)}
    if config.cpu_s is not None:
        # SIGXCPU at the soft limit ends a process; SIGKILL at the hard one ends one that ignores it
        soft = math.ceil(config.cpu_s)
        limits["RLIMIT_CPU"] = (soft, soft + 1)
    if config.memory_mb is not None:
        limits["RLIMIT_AS"] = (config.memory_mb << 20, config.memory_mb << 20)
    if config.max_processes is not None:
        # with a cgroup its pids.max is the limit (a refusal there is counted); the uid's count stays as a
        # backstop one above it
        n = config.max_processes + (1 if with_cgroup else 0)
        limits["RLIMIT_NPROC"] = (n, n)
    if config.max_file_mb is not None:
        size = int(config.max_file_mb * (1 << 20))
        limits["RLIMIT_FSIZE"] = (size, size)
    return limits


def _died_of_rlimit(exit_code: int | None, stderr: bytes) -> str | None:
    if exit_code != 1 or _UNCAUGHT not in stderr:
        return None
    last = stderr.rstrip().rsplit(b"\n", 1)[-1]
    for limit, starts in _RLIMIT_DEATHS:
        if last.startswith(starts):
            return limit
    return None


def classify(config: SandboxConfig, killed_for: str | None, wait_status: int | None, cpu_s: float | None,
             stderr: bytes, usage: dict[str, float] | None = None) -> tuple[str | None, str | None]:
    """(limit, signal name) of a finished run: the limit that stopped it, from what cannot be written by
    the program: the caller's own kills (time, output), the signal that ended it (SIGXCPU, SIGXFSZ, an
    OOM kill), the cgroup's counters (OOM kills, forks refused at pids.max) and, for the rlimit refusals
    the kernel counts nowhere, the exit status of a Python that died of them. What a program prints
    never makes a limit: one that exits 0 with no limit counted hit none."""
    usage = usage or {}
    sig_name = None
    exit_code = None
    if wait_status is not None:
        if os.WIFSIGNALED(wait_status):
            sig = os.WTERMSIG(wait_status)
            try:
                sig_name = signal.Signals(sig).name
            except ValueError:
                sig_name = str(sig)
        else:
            exit_code = os.WEXITSTATUS(wait_status)
    if killed_for is not None:
        return killed_for, "SIGKILL"
    if sig_name == "SIGXCPU" or (sig_name == "SIGKILL" and config.cpu_s is not None and cpu_s is not None
                                 and cpu_s >= math.ceil(config.cpu_s) - 0.05):
        return "cpu", sig_name
    if sig_name == "SIGXFSZ":
        return "file_size", sig_name
    if usage.get("oom_kills", 0) > 0:  # the kernel killed a process of the run at the memory limit
        return "memory", sig_name
    if usage.get("processes_limit_hits", 0) > 0:  # a fork of the run was refused at pids.max
        return "processes", sig_name
    if exit_code == 0:
        return None, None
    limit = _died_of_rlimit(exit_code, stderr)
    if limit is not None:
        return limit, sig_name
    if sig_name is not None:
        return "signal", sig_name
    return None, None
