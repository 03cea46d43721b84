"""The sandbox launcher: a fresh interpreter (`python -I -S _launcher.py SPEC`) that isolates and starts
one program. It imports nothing from hpcrl and as little of the standard library as it can, because
its start-up is a large part of every run: the spec and the status travel as hex-encoded `marshal`
(json would import re and enum, ~12 ms), signals come from the C module `_signal` (`signal` imports
enum). Launcher and caller are the same interpreter, so the marshal format always matches.

Why a separate interpreter: namespaces, mounts and rlimits must be set up between fork and exec, and
doing that in `subprocess`'s preexec_fn is unsafe in the parent (a threaded reward worker or tool
executor). Here the whole process is ours.

Processes (root mode; the user-namespace mode for non-root callers differs only where it says so):

  launcher (root, host namespaces)      unshare(NET|NS|PID|IPC|UTS), fork, wait for init, exit
    init (root, PID 1 of the new PID namespace)
                                        mounts (read-only host, private /tmp, the working directory,
                                        hidden paths, /proc), fork, reap every child until the program
                                        exits, report on the status pipe, exit: the kernel then kills
                                        whatever the program left behind in the namespace
      program (the sandbox uid)         rlimits, no_new_privs, setgroups([]), setgid, setuid, chdir,
                                        execve(python main.py)

Status pipe (fd SPEC["status_fd"]): one dict per line, {"setup_error": str, "stage": str} when isolation
cannot be set up, or {"exec_error": str|None, "wait_status": int, "cpu_s": float, "maxrss_kb": int,
"isolation": {...}} once the program has ended.
"""

from __future__ import annotations

import _signal as signal
import ctypes
import errno
import marshal
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24

PR_SET_PDEATHSIG = 1
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _install_seccomp(program: bytes) -> None:
    """The BPF program (struct sock_filter[], built by the caller: hpcrl/sandbox/seccomp.py)."""
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0), "seccomp filter")


class Reporter:
    def __init__(self, fd: int):
        self.fd = fd

    def send(self, msg: dict) -> None:
        os.write(self.fd, marshal.dumps(msg).hex().encode() + b"\n")


def _write_id_maps(uid: int, gid: int) -> None:
    """User-namespace mode: the caller's uid/gid map to themselves, so files keep their owners."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def _unescape_mount_path(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as 3-digit octal escapes
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit() and len(field[i + 1:i + 4]) == 3:
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


_ATIME_FLAGS = {"noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}


def _remount_everything_read_only() -> list[str]:
    """Make every mount of this (private) mount namespace read-only: the program can then write only
    to the tmpfs mounted afterwards, whatever the permissions of host directories (world-writable
    ones included). The mount's other flags are kept: in a user namespace, clearing a locked flag
    (nosuid, nodev, noexec, atime) is refused. Returns the mount points that could not be remounted
    (shadowed ones); the root itself failing raises."""
    failed = []
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        target, opts = _unescape_mount_path(fields[4]), fields[5].split(",")
        if "ro" in opts:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= MS_NOSUID if "nosuid" in opts else 0
        flags |= MS_NODEV if "nodev" in opts else 0
        flags |= MS_NOEXEC if "noexec" in opts else 0
        atime = [_ATIME_FLAGS[o] for o in opts if o in _ATIME_FLAGS]
        flags |= sum(atime) if atime else MS_STRICTATIME
        try:
            _mount(None, target, None, flags)
        except OSError:
            if target == "/":
                raise
            failed.append(target)
    return failed


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _hide_folder(path: str, exposed: dict[str, int]) -> None:
    """Cover `path` with an empty read-only tmpfs. Paths under it that the program needs (the
    interpreter's installation) are bound back read-only from the file descriptors opened before
    anything was covered; the folders on the way to them can be passed but not listed (mode 711)."""
    inside = [p for p in exposed if _within(p, path) and p != path]
    if not inside:
        _mount("hidden", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=000")
        return
    _mount("hidden", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=711")
    for p in inside:
        rel = p[len(path.rstrip("/")) + 1:]
        parent = os.path.join(path, os.path.dirname(rel))
        os.makedirs(parent, mode=0o711, exist_ok=True)
        target = os.path.join(path, rel)
        if os.path.isdir(f"/proc/self/fd/{exposed[p]}"):
            os.makedirs(target, mode=0o711, exist_ok=True)
        elif not os.path.lexists(target):
            open(target, "w").close()
        _mount(f"/proc/self/fd/{exposed[p]}", target, None, MS_BIND)
    _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _setup_mounts(spec: dict, files: dict[str, bytes]) -> dict:
    """In the new mount namespace (as its root): host read-only, hidden paths covered (with the
    interpreter bound back where it lies inside one), one private tmpfs for /tmp (also bound on
    /var/tmp and /dev/shm) holding the working directory, a fresh /proc."""
    info: dict = {}
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount reaches the host
    exposed = {}
    for p in spec["expose"]:
        try:
            exposed[p] = os.open(p, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            pass
    hidden = []
    # parents first: a folder inside one already covered no longer exists and is skipped
    for path in sorted(spec["hidden_paths"], key=len):
        if os.path.isdir(path):
            _hide_folder(path, exposed)
            hidden.append(path)
        elif os.path.exists(path):
            _mount("/dev/null", path, None, MS_BIND)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            hidden.append(path)
    for fd in exposed.values():
        os.close(fd)
    info["hidden"] = hidden
    info["exposed"] = [p for p in exposed if any(_within(p, h) for h in hidden)]
    info["not_read_only"] = _remount_everything_read_only()
    _mount("sandbox", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk_mb']}m,mode=1777")
    for extra in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(extra):
            _mount("/tmp", extra, None, MS_BIND)
    work = spec["workdir"]
    if not os.path.isdir(work):  # the host folder was under /tmp (the default): now shadowed, make it anew
        os.makedirs(work, mode=0o700)
    else:  # a working root elsewhere: cover the host folder with a folder of the private /tmp
        inner = "/tmp/.work"
        os.mkdir(inner, 0o700)
        _mount(inner, work, None, MS_BIND)
    for name, data in files.items():
        with open(os.path.join(work, name), "wb") as f:
            f.write(data)
    if spec["uid"] is not None:
        for name in [*files, ""]:
            os.chown(os.path.join(work, name), spec["uid"], spec["gid"])
    info["private_tmp"] = True
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        info["own_proc"] = True
    except OSError as e:  # e.g. a container that masks parts of /proc refuses a fresh one in a user namespace
        info["own_proc"] = False
        info["own_proc_error"] = str(e)
    return info


def _exec_program(spec: dict, err_fd: int, cgroup_fds: list[int]) -> None:
    """In the program's process: its cgroup, limits, privileges dropped, the seccomp filter, exec.
    Never returns. A failure before exec is a setup error ("setup: ...") or, for execve itself, the
    interpreter's."""
    stage = "setup: "
    try:
        # "0": the writer (v1 `tasks`: this thread, the only one of this fresh fork); all it starts inherits it
        for fd in cgroup_fds:
            os.write(fd, b"0")
            os.close(fd)
        # Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        for name, (soft, hard) in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        # setuid-root binaries on the host (su, mount, ...) must not give root back
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if spec["uid"] is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        if spec["seccomp"]:
            _install_seccomp(spec["seccomp"])
        os.chdir(spec["workdir"])
        stage = ""
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as e:
        os.write(err_fd, f"{stage}{type(e).__name__}: {e}".encode())
    os._exit(127)


def _kill_leftovers_of_uid(uid: int) -> None:
    """Without a PID namespace: as the sandbox uid, kill(-1) reaches exactly that uid's processes (the
    uid is reserved for this run by the caller's slot lock). Done in a child so init keeps root."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def _init(spec: dict, reporter: Reporter, namespaces: bool, cgroup_fds: list[int]) -> None:
    """PID 1 of the sandbox (or a subreaper when there are no namespaces). Never returns."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the caller killed the launcher: the sandbox goes too
    isolation: dict = {"namespaces": namespaces}
    try:
        if namespaces:
            files = {}
            for name in os.listdir(spec["workdir"]):
                with open(os.path.join(spec["workdir"], name), "rb") as f:
                    files[name] = f.read()
            isolation.update(_setup_mounts(spec, files))
        else:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans come back to us, not to the host's init
    except OSError as e:
        reporter.send({"setup_error": str(e), "stage": "mounts"})
        os._exit(0)
    err_r, err_w = os.pipe()  # close-on-exec: EOF without data means the exec worked
    program = os.fork()
    if program == 0:
        os.close(err_r)
        _exec_program(spec, err_w, cgroup_fds)
    os.close(err_w)
    for fd in cgroup_fds:
        os.close(fd)
    # init holds no copy of the program's stdio: the caller's EOF then means the program is done
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)

    def backstop(*_: object) -> None:
        # the caller enforces the wall time; this only matters when the caller itself is gone
        if not namespaces and spec["uid"] is not None:
            _kill_leftovers_of_uid(spec["uid"])
        os._exit(0)

    signal.signal(signal.SIGALRM, backstop)
    signal.alarm(int(spec["backstop_s"]) + 1)
    exec_error = b""
    while chunk := os.read(err_r, 4096):
        exec_error += chunk
    os.close(err_r)
    status = 0
    while True:
        try:
            pid, st, _ = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if pid == program:
            status = st
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    reporter.send({"exec_error": exec_error.decode(errors="replace") or None, "wait_status": status,
                   "cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_kb": usage.ru_maxrss,
                   "isolation": isolation})
    if not namespaces and spec["uid"] is not None:
        _kill_leftovers_of_uid(spec["uid"])
    os._exit(0)


def main() -> None:
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    # the caller died (a reward worker killed at its timeout): the launcher goes, init follows it, and
    # init's end empties the PID namespace. The caller's thread waits for this process until it
    # exits, so the signal cannot come from that thread ending early.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["caller_pid"]:
        os._exit(0)
    reporter = Reporter(spec["status_fd"])
    os.set_inheritable(spec["status_fd"], False)  # the program must not inherit the status pipe
    # the run cgroup's attach files (cgroup.py), opened here in the host's mount namespace: the copy of
    # /sys/fs/cgroup in the sandbox's is read-only, and an fd open for writing on it would make that
    # remount fail
    cgroup_fds = []
    try:
        for path in spec["cgroup_attach"]:
            cgroup_fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    except OSError as e:
        reporter.send({"setup_error": f"opening {e.filename}: {e.strerror}", "stage": "cgroup"})
        return
    namespaces = False
    flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if spec["user_namespace"]:
        flags |= CLONE_NEWUSER
    if _libc.unshare(flags) == 0:
        namespaces = True
        if spec["user_namespace"]:
            try:
                _write_id_maps(os.getuid(), os.getgid())
            except OSError as e:
                reporter.send({"setup_error": f"writing the user namespace's id maps: {e}", "stage": "namespaces"})
                return
    else:
        e = ctypes.get_errno()
        if not spec["allow_host_network_fallback"]:
            kinds = ("user, " if spec["user_namespace"] else "") + "network, mount, pid, ipc, uts"
            reporter.send({"setup_error": f"unshare({kinds} namespaces): {os.strerror(e)} "
                                          f"({errno.errorcode.get(e, e)})", "stage": "namespaces"})
            return
    init = os.fork()
    if init == 0:
        _init(spec, reporter, namespaces, cgroup_fds)
    for fd in (0, 1, 2):  # the launcher holds no copy of the program's stdio either
        os.close(fd)
    os.waitpid(init, 0)
    os._exit(0)  # no interpreter teardown: the caller is waiting for this exit


if __name__ == "__main__":
    main()
