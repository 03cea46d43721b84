"""Run one Python program in the sandbox (`run_program`), or many at once (`Sandbox`).

The caller's side of a run: a host working folder with the program in it, a uid reserved for the
run (root callers), the launcher started as a fresh interpreter in a session of its own, stdin fed
and stdout/stderr read under their caps until the program ends or the wall-clock deadline passes,
then the launcher's status report turned into a `SandboxResult`. What happens inside the sandbox is
in `_launcher.py`; what each limit does and does not protect is in docs/agents.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import marshal
import math
import os
import pwd
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpcrl.sandbox.cgroup import RunCgroup, sweep_stale
from hpcrl.sandbox.cgroup import layout as cgroup_layout
from hpcrl.sandbox.config import SandboxConfig
from hpcrl.sandbox.limits import classify, rlimits
from hpcrl.sandbox.seccomp import no_user_namespaces_filter

log = logging.getLogger("hpcrl.sandbox")

LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
PROGRAM_NAME = "main.py"
WORKDIR_PREFIX = "hpcrl-sbx-"
LIMITS = ("timeout", "cpu", "memory", "processes", "file_size", "output", "signal")
_READ_CHUNK = 1 << 16
# After the launcher has exited, how long output pipes still held open by escaped processes are read.
_EXIT_GRACE_S = 0.5
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot isolate programs here (no namespaces, no usable interpreter): a setup problem
    of the machine or config, never a program's doing."""


@dataclass
class SandboxResult:
    """What one program run did.

    exit_code: the exit status, or minus the signal number when a signal ended it; None when it never
    started (`error` says why) or was killed by the caller (timeout, output). limit: which limit
    stopped it, one of LIMITS, or None. cpu_s: user + system CPU seconds of the program and the
    children it waited for (None when the caller had to kill the sandbox).
    """

    exit_code: int | None
    stdout: str
    stderr: str
    limit: str | None = None
    signal: str | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float | None = None
    max_rss_mb: float | None = None
    error: str | None = None
    isolation: dict[str, Any] = field(default_factory=dict)
    # the run's cgroup counters (hpcrl.sandbox.cgroup.RunCgroup.usage): memory_limit_hits, oom_kills,
    # processes_limit_hits, peak_memory_mb; {} without a cgroup
    usage: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Exited with status 0 and hit no limit."""
        return self.exit_code == 0 and self.limit is None and self.error is None


def _usable_by_everyone(path: str) -> bool:
    """Whether an unprivileged uid can execute `path` and read its installation (the folder above
    bin/): /root/.pyenv/... is not (/root is 0700)."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & 0o001:
            return False
        prefix = os.path.dirname(os.path.dirname(real))
        lib = os.path.join(prefix, "lib")
        if os.path.isdir(lib) and (os.stat(lib).st_mode & 0o005) != 0o005:
            return False
        parent = os.path.dirname(real)
        while True:
            if not os.stat(parent).st_mode & 0o001:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def default_python() -> str:
    """The interpreter programs run with. Non-root callers: this one (the program runs as the same
    user). Root callers: the program runs as an unprivileged uid, so the first of this interpreter's
    base installation, /usr/bin/python3, /usr/local/bin/python3 and python3 on PATH that every user
    can execute."""
    if os.geteuid() != 0:
        return sys.executable
    base = getattr(sys, "_base_executable", sys.executable)
    candidates = [base, sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")]
    for c in candidates:
        if c and os.path.exists(c) and _usable_by_everyone(c):
            return os.path.realpath(c)
    raise SandboxUnavailableError(
        f"no Python interpreter that an unprivileged user can run: tried {[c for c in candidates if c]} (a "
        "folder on the way is not executable for others, e.g. /root/...). Install one (apt-get install "
        "python3-minimal) or set SandboxConfig.python to one every user can run.")


class _UidSlot:
    """A uid reserved for one run, across all processes of the machine: an abstract unix socket named
    after the uid is bound for the run's duration (the kernel releases it when the holder dies, and
    abstract names leave no files behind). Distinct uids keep concurrent runs' process counts apart:
    RLIMIT_NPROC counts every process of the uid."""

    _real_users: dict[int, bool] = {}

    def __init__(self, config: SandboxConfig, give_up_s: float = 60.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        start = random.randrange(config.uid_slots)
        deadline = time.monotonic() + give_up_s
        while True:
            for k in range(config.uid_slots):
                uid = config.uid_base + (start + k) % config.uid_slots
                if self._is_real_user(uid):
                    continue
                try:
                    self.sock.bind(f"\0hpcrl-sandbox-uid-{uid}")
                except OSError:
                    continue
                self.uid = uid
                return
            if time.monotonic() > deadline:
                self.sock.close()
                raise SandboxUnavailableError(f"all {config.uid_slots} sandbox uids from {config.uid_base} are "
                                              f"in use for {give_up_s:.0f} s; raise SandboxConfig.uid_slots")
            time.sleep(0.01)

    @classmethod
    def _is_real_user(cls, uid: int) -> bool:
        """A uid with an account belongs to someone: its files and processes are not ours to touch."""
        if uid not in cls._real_users:
            try:
                pwd.getpwuid(uid)
                cls._real_users[uid] = True
                log.warning("sandbox: uid %d has an account; skipping it (set SandboxConfig.uid_base to a free "
                            "range)", uid)
            except KeyError:
                cls._real_users[uid] = False
        return cls._real_users[uid]

    def release(self) -> None:
        self.sock.close()


def _program_env(config: SandboxConfig, workdir: str) -> dict[str, str]:
    env = {"PATH": _SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": "/tmp"}
    env.update({str(k): str(v) for k, v in config.env.items()})
    return env


def _cgroup_help(reason: str) -> str:
    return (f"the sandbox cannot give a run a cgroup here: {reason}. The cgroup is what bounds a run's memory "
            "as a whole (shared memory, memfds and tmpfs pages escape the per-process RLIMIT_AS) and counts its "
            "processes. Give this process a cgroup v2 subtree with the memory and pids controllers delegated "
            "(e.g. systemd-run -p Delegate=yes, or a container whose cgroup root is its own), or run as root "
            "where cgroup v1 memory and pids hierarchies are mounted. To run programs WITHOUT a memory bound "
            "on the run as a whole instead, set SandboxConfig(allow_without_cgroup=True).")


@functools.lru_cache(maxsize=8)
def _interpreter_prefixes(python: str) -> tuple[str, ...]:
    """The folders an interpreter needs: its installation (sys.prefix, sys.base_prefix, and where the
    executable really lies). Asked from the interpreter itself once per process."""
    real = os.path.realpath(python)
    if real == os.path.realpath(sys.executable):
        found = [sys.prefix, sys.base_prefix]
    else:
        try:
            out = subprocess.run([python, "-I", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                                 capture_output=True, text=True, timeout=60, env={"PATH": _SAFE_PATH}).stdout
            found = out.split("\n")[:2]
        except (OSError, subprocess.TimeoutExpired):
            found = []
    found.append(os.path.dirname(os.path.dirname(real)))
    return tuple(sorted({os.path.realpath(p) for p in found if p and os.path.isabs(p)}))


def _exposed_paths(python: str, hidden: Sequence[str]) -> list[str]:
    """The interpreter's folders that lie inside a hidden path: bound back read-only in the sandbox."""
    needed = {os.path.abspath(python), *_interpreter_prefixes(python)}
    needed |= {os.path.dirname(os.path.abspath(python))}
    inside = sorted(p for p in needed if any(p.startswith(h.rstrip("/") + "/") for h in hidden))
    # a folder bound back brings what is under it: keep the outermost ones
    return [p for p in inside if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in inside)]


def _namespace_help(error: str) -> str:
    who = ("as root this needs CAP_SYS_ADMIN (a container started without it: docker run --cap-add SYS_ADMIN "
           "--security-opt seccomp=unconfined, or --privileged)" if os.geteuid() == 0 else
           "as a non-root user this needs unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
           "kernel.unprivileged_userns_clone=1 on Debian kernels that have it; on Ubuntu 24.04 also "
           "kernel.apparmor_restrict_unprivileged_userns=0)")
    return (f"the sandbox cannot create its namespaces: {error}. The network namespace is what keeps "
            f"programs off the network; {who}. To run programs WITH THE HOST'S NETWORK and without PID and "
            "mount isolation instead, set SandboxConfig(allow_host_network_fallback=True).")


class _Pump:
    """Feeds stdin and drains stdout/stderr of the launcher until the program is done, the deadline
    passes or an output cap is exceeded (then the whole sandbox is killed)."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int):
        self.proc, self.deadline, self.cap = proc, deadline, cap
        self.out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        self.truncated = {fd: False for fd in self.out}
        self.killed_for: str | None = None
        self.sel = selectors.DefaultSelector()
        for fd in self.out:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)
        self.stdin, self.stdin_view = proc.stdin.fileno(), memoryview(stdin)
        if stdin:
            os.set_blocking(self.stdin, False)
            self.sel.register(self.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        try:
            self.pidfd: int | None = os.pidfd_open(proc.pid)
            self.sel.register(self.pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):  # Linux < 5.3: poll the launcher instead
            self.pidfd = None

    def _launcher_exited(self) -> bool:
        # WNOWAIT: look without reaping, so the caller's wait4 still gets the exit status and rusage
        return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def run(self) -> None:
        exited, grace_end = False, math.inf
        readers = set(self.out)
        while readers or not exited:
            now = time.monotonic()
            if now >= self.deadline:
                self.killed_for = "timeout"
                break
            if exited and not readers:
                break
            if exited and grace_end == math.inf:
                grace_end = now + _EXIT_GRACE_S
            if now >= grace_end:  # escaped processes hold the pipes: stop listening, the kill below ends them
                break
            wait = min(self.deadline, grace_end) - now
            if self.pidfd is None:
                wait = min(wait, 0.02)
            for key, _ in self.sel.select(wait):
                fd = key.fd
                if fd == self.pidfd:
                    exited = True
                    self.sel.unregister(fd)
                elif fd == self.stdin:
                    self._feed()
                elif not self._drain(fd):
                    readers.discard(fd)
                if self.killed_for:
                    break
            if self.killed_for:
                break
            if self.pidfd is None and not exited:
                exited = self._launcher_exited()
        self.sel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        if self.killed_for or readers:
            self.kill()

    def _feed(self) -> None:
        try:
            n = os.write(self.stdin, self.stdin_view[:_READ_CHUNK])
            self.stdin_view = self.stdin_view[n:]
        except (BrokenPipeError, OSError):  # the program stopped reading: the rest of stdin is moot
            self.stdin_view = self.stdin_view[:0]
        if not self.stdin_view:
            self.sel.unregister(self.stdin)
            self.proc.stdin.close()

    def _drain(self, fd: int) -> bool:
        """Read what is there; False at EOF."""
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return True
        if not data:
            self.sel.unregister(fd)
            return False
        buf = self.out[fd]
        room = self.cap - len(buf)
        buf += data[:max(room, 0)]
        if len(data) > room:
            self.truncated[fd] = True
            self.killed_for = "output"
        return True

    def kill(self) -> None:
        try:  # the launcher's session: launcher, init and program (init's death ends the PID namespace)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_status(fd: int, timeout_s: float = 2.0) -> list[dict[str, Any]]:
    msgs, buf = [], b""
    end = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while time.monotonic() < end:
            if not sel.select(max(0.0, end - time.monotonic())):
                break
            chunk = os.read(fd, _READ_CHUNK)
            if not chunk:
                break
            buf += chunk
    for line in buf.splitlines():
        try:
            msgs.append(marshal.loads(bytes.fromhex(line.decode())))
        except (ValueError, EOFError, TypeError):
            msgs.append({"setup_error": f"unreadable launcher status {line[:200]!r}", "stage": "protocol"})
    return msgs


def run_program(source: str, stdin: str | bytes = b"", argv: Sequence[str] = (),
                config: SandboxConfig | None = None) -> SandboxResult:
    """Run the Python program `source` in the sandbox and return what it did. A program's behaviour
    (crash, hang, limit hit) never raises; SandboxUnavailableError means the sandbox itself cannot
    be set up here (see its message)."""
    config = config or SandboxConfig()
    python = config.python or default_python()
    stdin_bytes = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
    root = os.geteuid() == 0
    lay, why_no_cgroup = cgroup_layout()
    if lay is None and not config.allow_without_cgroup:
        raise SandboxUnavailableError(_cgroup_help(why_no_cgroup))
    try:
        seccomp_filter = no_user_namespaces_filter()
    except ValueError as e:
        raise SandboxUnavailableError(f"{e}: programs could make user namespaces of their own (and mount what "
                                      "they like in them); not supported here") from None
    hidden = [os.path.abspath(p) for p in config.hidden_paths]
    slot = _UidSlot(config) if root else None
    workdir = ""
    status_r = status_w = -1
    run_cgroup = None
    usage: dict[str, float] = {}
    try:
        workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-", dir=config.work_root)
        with open(os.path.join(workdir, PROGRAM_NAME), "w", encoding="utf-8") as f:
            f.write(source)
        if slot is not None:  # without a mount namespace the program works in this very folder
            for p in (workdir, os.path.join(workdir, PROGRAM_NAME)):
                os.chown(p, slot.uid, slot.uid)
        if lay is not None:
            memory = None if config.memory_mb is None else (config.memory_mb + config.disk_mb) << 20
            try:
                run_cgroup = RunCgroup(lay, memory, config.max_processes)
            except OSError as e:
                raise SandboxUnavailableError(f"making the run's cgroup failed: {e}") from e
        status_r, status_w = os.pipe()
        spec = {
            "workdir": workdir,
            "argv": [python, *config.python_args, PROGRAM_NAME, *map(str, argv)],
            "env": _program_env(config, workdir),
            "uid": slot.uid if slot else None,
            "gid": slot.uid if slot else None,
            "rlimits": rlimits(config, run_cgroup is not None),
            "user_namespace": not root,
            "allow_host_network_fallback": config.allow_host_network_fallback,
            "hidden_paths": hidden,
            "expose": _exposed_paths(python, hidden),
            "disk_mb": config.disk_mb,
            "backstop_s": config.wall_s + 2.0,
            "status_fd": status_w,
            "caller_pid": os.getpid(),
            "cgroup_attach": run_cgroup.attach_files if run_cgroup else [],
            "seccomp": seccomp_filter,
        }
        # The launcher runs as the caller (root stays root until the program's own process drops it),
        # so the caller's interpreter is fine for it; -S skips site for a fast start. The wall clock
        # starts here: waiting for a uid or making folders is not the program's time.
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-S", LAUNCHER, marshal.dumps(spec).hex()],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(status_w,), env={"PATH": _SAFE_PATH, "LANG": "C.UTF-8"},
                                start_new_session=True)
        os.close(status_w)
        status_w = -1
        pump = _Pump(proc, stdin_bytes, t0 + config.wall_s, config.max_output_bytes)
        try:
            pump.run()
        except BaseException:  # e.g. KeyboardInterrupt: the sandbox must not outlive the caller's interest
            pump.kill()
            raise
        finally:
            _, launcher_status, _ = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(launcher_status)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    pipe.close()
                except OSError:
                    pass
        wall = time.monotonic() - t0
        msgs = _read_status(status_r)
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        if run_cgroup is not None:
            usage = run_cgroup.usage()
            run_cgroup.remove()
        if slot is not None:
            slot.release()
    out_fd, err_fd = list(pump.out)  # stdout first
    stdout_b, stderr_b = bytes(pump.out[out_fd]), bytes(pump.out[err_fd])
    setup = next((m for m in msgs if "setup_error" in m), None)
    if setup is not None:
        if setup.get("stage") == "namespaces":
            raise SandboxUnavailableError(_namespace_help(setup["setup_error"]))
        if setup.get("stage") == "cgroup":
            raise SandboxUnavailableError(_cgroup_help(setup["setup_error"]))
        raise SandboxUnavailableError(f"the sandbox could not be set up ({setup.get('stage')}): {setup['setup_error']}")
    final = next((m for m in msgs if "wait_status" in m), None)
    result = SandboxResult(exit_code=None, stdout=stdout_b.decode(errors="replace"),
                           stderr=stderr_b.decode(errors="replace"), stdout_truncated=pump.truncated[out_fd],
                           stderr_truncated=pump.truncated[err_fd], wall_s=wall, usage=usage)
    if final is None:
        if pump.killed_for is not None:  # killed by the caller before init reported (timeout, output cap)
            result.limit, result.signal = classify(config, pump.killed_for, None, None, stderr_b, usage)
        else:  # not the program's doing: it cannot signal the launcher or init (other uid, other PID namespace)
            result.error = f"the sandbox launcher ended without a report (exit status {proc.returncode})"
        return result
    result.isolation = final.get("isolation", {})
    result.isolation["cgroup"] = lay.version if run_cgroup is not None else None
    if final.get("exec_error"):
        if final["exec_error"].startswith("setup: "):
            raise SandboxUnavailableError(f"the sandbox could not be set up (program): {final['exec_error'][7:]}")
        result.error = f"could not start {python}: {final['exec_error']}"
        return result
    status = int(final["wait_status"])
    result.exit_code = os.waitstatus_to_exitcode(status)
    result.cpu_s = float(final["cpu_s"])
    result.max_rss_mb = final["maxrss_kb"] / 1024.0
    result.limit, result.signal = classify(config, pump.killed_for, status, result.cpu_s, stderr_b, usage)
    if pump.killed_for is not None:
        result.exit_code = None
    return result


@dataclass
class ProgramJob:
    """One program for `Sandbox.run_many`."""

    source: str
    stdin: str | bytes = b""
    argv: Sequence[str] = ()


_checked: set[str] = set()  # repr of the configs that passed the check (env is a dict: not hashable)
_checked_lock = threading.Lock()


def _sweep_stale_workdirs(work_root: str | None) -> None:
    """Remove working folders left by processes that were killed mid-run (their pid is in the name)."""
    root = Path(work_root or tempfile.gettempdir())
    try:
        entries = list(root.glob(f"{WORKDIR_PREFIX}*"))
    except OSError:
        return
    for p in entries:
        try:
            pid = int(p.name[len(WORKDIR_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:  # alive (another user's process)
            pass


class Sandbox:
    """Runs programs with `config`, at most `max_concurrency` at a time (default: the CPU count), from
    sync code (`run`, `run_many`) or asyncio (`run_async`). Construction checks once per process and
    config that the sandbox works here, raising SandboxUnavailableError with what to do if not."""

    def __init__(self, config: SandboxConfig | None = None, max_concurrency: int | None = None, check: bool = True):
        self.config = config or SandboxConfig()
        self.max_concurrency = max_concurrency or max(1, os.cpu_count() or 1)
        self._slots = threading.BoundedSemaphore(self.max_concurrency)
        self._executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="hpcrl-sandbox")
        if check:
            self.check()

    def check(self) -> None:
        with _checked_lock:
            if repr(self.config) in _checked:
                return
            _sweep_stale_workdirs(self.config.work_root)
            sweep_stale()
            r = run_program("pass\n", config=replace(self.config, wall_s=max(self.config.wall_s, 30.0)))
            if r.error or r.exit_code != 0:
                raise SandboxUnavailableError(f"a trivial program failed in the sandbox: {r.error or r.stderr[-500:]}")
            if not r.isolation.get("namespaces"):
                log.warning("sandbox: running WITHOUT namespaces (allow_host_network_fallback=True): programs "
                            "have the host's network, no PID or mount isolation, no hidden paths")
            if r.isolation.get("cgroup") is None:
                log.warning("sandbox: running WITHOUT a cgroup (allow_without_cgroup=True): a run's shared memory, "
                            "memfds and tmpfs pages are not bounded as a whole")
            _checked.add(repr(self.config))

    def run(self, source: str, stdin: str | bytes = b"", argv: Sequence[str] = (),
            config: SandboxConfig | None = None) -> SandboxResult:
        """Run one program (waits for a free slot)."""
        with self._slots:
            return run_program(source, stdin, argv, config or self.config)

    async def run_async(self, source: str, stdin: str | bytes = b"", argv: Sequence[str] = (),
                        config: SandboxConfig | None = None) -> SandboxResult:
        """`run` from asyncio: the blocking run goes to this sandbox's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(self.run, source, stdin, argv, config))

    def run_many(self, jobs: Sequence[ProgramJob | str], config: SandboxConfig | None = None) -> list[SandboxResult]:
        """Run every job, up to max_concurrency at a time (with `config` in place of the sandbox's);
        results in job order."""
        futures = []
        for job in jobs:
            job = ProgramJob(job) if isinstance(job, str) else job
            futures.append(self._executor.submit(self.run, job.source, job.stdin, job.argv, config))
        return [f.result() for f in futures]

    def try_acquire_slot(self) -> bool:
        """Take one of the max_concurrency slots without waiting (for callers that queue themselves,
        like the python tool); pair with `run_in_slot`, which gives it back."""
        return self._slots.acquire(blocking=False)

    def run_in_slot(self, source: str, stdin: str | bytes = b"", argv: Sequence[str] = (),
                    config: SandboxConfig | None = None) -> SandboxResult:
        """`run` for a caller that holds a slot (try_acquire_slot); the slot is given back at the end."""
        try:
            return run_program(source, stdin, argv, config or self.config)
        finally:
            self._slots.release()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
