"""Each rank's stderr, also kept in a file that outlives the rank, so that the controller can quote
a dead rank's last words (C++ `terminate called after throwing ...`, faulthandler's stack dump,
glibc's `double free or corruption`).

Why a separate process: what a process writes while it dies (from C, when Python no longer runs)
survives only if someone else holds it. `start_capture` (called by launchers/hpcrl_entry.py on
every rank, before MPI starts) points fd 2 at a pipe read by a small child: this file run as a
script by the same interpreter (`-I -S`: stdlib only, nothing of the job imported). The child
copies every byte to the rank's original stderr first (the terminal or Slurm log shows what it
always did) and appends it to the file. It ignores the job's signals, so it keeps copying while
the rank is torn down, and it ends at EOF: when the rank and every process the rank gave its
stderr to are gone. So it never outlives them. When its parent (the rank) is gone it writes an
exit line with the time; the controller reads that line as the time of death.

File format: per process that wrote to the file (a Slurm restart appends to the same file),
`MARK` + `start pid=P host=H at=T`, then the process's bytes, then `MARK` + `exit pid=P at=T`
(or `closed ...` when fd 2 was closed while the process lived on).

Limits: the file must be readable on the controller's node to be quoted (a shared run folder; a
rank's node-local /tmp is not); a child that cannot keep up (the terminal blocks, as it would
block the rank itself without the child) slows the rank's stderr writes down, never loses them.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

MARK = "[hpcrl stderr] "
_LINE = re.compile(r"^\[hpcrl stderr\] (start|exit|closed) pid=(\d+)(?: host=(\S*))? at=([0-9.]+)$", re.M)

_capture: subprocess.Popen | None = None  # the child of this process, kept referenced for its lifetime


def _mark(kind: str, pid: int, at: float, host: str | None = None) -> bytes:
    where = f" host={host}" if host is not None else ""
    return f"{MARK}{kind} pid={pid}{where} at={at:.6f}\n".encode()


def start_capture(path: str) -> bool:
    """Tee this process's fd 2 (and so its children's) into `path` from now on; False if impossible.

    Call it before MPI starts: it forks (and execs at once), which some MPI transports do not
    survive once initialised (memory registered with the network card).
    """
    global _capture
    if _capture is not None:
        return True
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "ab") as f:
            f.write(_mark("start", os.getpid(), time.time(), os.uname().nodename))
        read_end, write_end = os.pipe()
        try:
            _capture = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), path, str(os.getpid())],
                stdin=read_end, stdout=2, stderr=subprocess.DEVNULL, close_fds=True,
                # own session: a signal to the rank's process group (Ctrl-C, a proxy cleaning up) must
                # not end the copy before the rank's last words are in the file
                start_new_session=True,
            )
            os.dup2(write_end, 2)  # fd 2 stays inheritable: child processes of the rank are captured too
        finally:
            os.close(read_end)
            os.close(write_end)
    except OSError as e:
        print(f"[hpcrl] stderr is not captured in {path}: {e}", file=sys.stderr, flush=True)
        return False
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _tee(path: str, parent: int) -> None:
    """The child's loop (see the module docstring)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    try:
        log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        log = -1
    outs = [1, log]  # stdout is the rank's original stderr
    exit_written = False

    def mark(kind: str, at: float) -> None:
        if log >= 0:
            try:
                os.write(log, _mark(kind, parent, at))
            except OSError:
                pass

    while True:
        if not select.select([0], [], [], 0.1)[0]:
            # the rank is gone, but a process it started still holds its stderr
            if not exit_written and os.getppid() != parent:
                mark("exit", time.time())
                exit_written = True
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        for i, fd in enumerate(outs):
            if fd >= 0:
                try:
                    _write_all(fd, data)
                except OSError:  # a full disk or a closed terminal must not stop the other copy
                    outs[i] = -1
    closed_at = time.time()  # EOF: the last holder of the pipe has exited (or closed it)
    if not exit_written:
        # the kernel closes a dying process's files before it reparents its children: wait for that
        deadline = time.monotonic() + 1.0
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.002)
        mark("exit" if os.getppid() != parent else "closed", closed_at)


@dataclass(frozen=True)
class StderrSection:
    """One process's part of a stderr file."""

    path: str
    readable: bool
    text: str = ""  # what the process wrote (the end of it, see `read_section`), marks removed
    exited_at: float | None = None  # wall-clock time its stderr closed because it exited
    truncated: bool = False  # the section started before the part that was read


def _tail(path: str, max_bytes: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        return f.read().decode("utf-8", "replace"), size > max_bytes


def exit_time(path: str, pid: int) -> float | None:
    """When process `pid` exited, from the last line of its stderr file; None if alive or unknown.

    Cheap (reads the last few hundred bytes): the controller polls it while it waits for the
    other ranks of a failed call.
    """
    if not path:
        return None
    try:
        text, _ = _tail(path, 512)
    except OSError:
        return None
    for kind, mpid, _, at in reversed(_LINE.findall(text)):
        if int(mpid) == pid:
            return float(at) if kind == "exit" else None
    return None


def read_section(path: str, pid: int, max_bytes: int = 256 * 1024) -> StderrSection:
    """What process `pid` wrote to the stderr file `path` (its last `max_bytes` at most)."""
    if not path:
        return StderrSection(path, False)
    try:
        text, cut = _tail(path, max_bytes)
    except OSError:
        return StderrSection(path, False)
    start, end, exited_at, truncated = 0, len(text), None, cut
    marks = [(m.group(1), int(m.group(2)), float(m.group(4)), m.start(), m.end()) for m in _LINE.finditer(text)]
    starts = [m for m in marks if m[0] == "start" and m[1] == pid]
    if starts:
        start, truncated = starts[-1][4] + 1, False
    for kind, mpid, at, s, _ in marks:
        if mpid == pid and kind in ("exit", "closed") and s >= start:
            end = s
            exited_at = at if kind == "exit" else None
            break
    body = _LINE.sub("", text[start:end]).strip("\n")
    return StderrSection(path, True, body, exited_at, truncated)


if __name__ == "__main__":
    _tee(sys.argv[1], int(sys.argv[2]))
