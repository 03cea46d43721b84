"""The limits and isolation settings of one sandboxed program run."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# Unprivileged uids for root-started sandboxes, one per concurrent run (RLIMIT_NPROC counts per uid).
# Debian leaves 60000-64999 to local allocation and systemd's dynamic users start at 61184, so this
# range is normally unused; set `uid_base` to another free range where it is not.
DEFAULT_UID_BASE = 60100
DEFAULT_UID_SLOTS = 256


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one program run. `None` for a limit means unlimited (tests use that to show that the
    limit is what stops a program); see docs/agents.md for how each is enforced."""

    wall_s: float = 10.0  # wall-clock time; the caller kills the sandbox at the deadline
    cpu_s: float | None = 5.0  # CPU seconds per process (RLIMIT_CPU, whole seconds, rounded up)
    # Address space per process (RLIMIT_AS), and with disk_mb the memory of the whole run (its cgroup:
    # resident, shared memory, memfd and the private tmpfs of all its processes: memory_mb + disk_mb).
    memory_mb: int | None = 512
    max_processes: int | None = 32  # processes + threads of the run (the cgroup's pids.max; RLIMIT_NPROC)
    max_file_mb: float | None = 16.0  # size of any one file written (RLIMIT_FSIZE)
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # stdout and stderr each; more ends the run (limit "output")
    disk_mb: int = 64  # the private tmpfs holding /tmp, /var/tmp, /dev/shm and the working directory
    # Interpreter the program runs with; None: one every user can execute (see runner.default_python).
    python: str | None = None
    # -I: no user site, no PYTHON* variables, the script's folder is not put on sys.path.
    python_args: tuple[str, ...] = ("-I",)
    # Host paths the program must not see at all, even where their permissions would let it read
    # them (run folders, data files with the ground truth): each is covered by an empty mount.
    hidden_paths: tuple[str, ...] = ()
    # Extra environment variables; nothing else of the caller's environment reaches the program.
    env: Mapping[str, str] = field(default_factory=dict)
    # Where the host-side working folders are made (default: the system temp folder).
    work_root: str | None = None
    uid_base: int = DEFAULT_UID_BASE
    uid_slots: int = DEFAULT_UID_SLOTS
    # True: where no network namespace can be made (a container without CAP_SYS_ADMIN, no user
    # namespaces), run programs anyway WITH THE HOST'S NETWORK and without the PID and mount
    # namespaces (no read-only host, no private /tmp, no hidden paths). False: refuse to start.
    allow_host_network_fallback: bool = False
    # True: where no cgroup can be made for a run (cgroup v2 without memory and pids delegated to this
    # process, and no writable cgroup v1 memory and pids hierarchies), run programs anyway WITHOUT A
    # MEMORY BOUND ON THE RUN AS A WHOLE: shared memory and memfds escape the per-process limit, and the
    # process limit is the uid's RLIMIT_NPROC only. False: refuse to start.
    allow_without_cgroup: bool = False

    def __post_init__(self) -> None:
        problems = []
        for name in ("wall_s", "cpu_s", "memory_mb", "max_processes", "max_file_mb"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                problems.append(f"{name}={value!r} must be a positive number or None (unlimited)")
        if self.wall_s is None:
            problems.append("wall_s must be set: the wall-clock limit is what ends a program that sleeps")
        for name in ("max_open_files", "max_output_bytes", "disk_mb", "uid_slots"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                problems.append(f"{name}={getattr(self, name)!r} must be a positive integer")
        if not (isinstance(self.uid_base, int) and 1000 <= self.uid_base < 2**31 - self.uid_slots):
            problems.append(f"uid_base={self.uid_base!r} must be an unprivileged uid (>= 1000)")
        if any(not str(p).startswith("/") or str(p).rstrip("/") == "" for p in self.hidden_paths):
            problems.append(f"hidden_paths={self.hidden_paths!r} must be absolute paths other than /")
        if problems:
            raise ValueError("SandboxConfig: " + "; ".join(problems))
