"""Each rank's output (stdout and stderr), kept in a file that outlives the rank, and what of it the
terminal shows.

Why a file: the controller quotes a dead rank's last words from it (C++ `terminate called after
throwing ...`, faulthandler's stack dump, glibc's `double free or corruption`), and a quiet
terminal still loses nothing: vLLM's, transformers', megatron's and torch's output of every rank
goes there in full.

Why a separate process: what a process writes while it dies (from C, when Python no longer runs)
survives only if someone else holds it. `start_capture` (called by launchers/hpcrl_entry.py on
every rank, before MPI starts) points fd 1 and fd 2 at pipes read by a small child: this file run
as a script by the same interpreter (`-I -S`: stdlib only, nothing of the job imported). The child
appends every byte to the rank's file and copies to the rank's original stdout / stderr (the
terminal, or Slurm's job log) what the mode lets through:

- verbose: everything, as a rank without the capture would print it;
- quiet: only what the rank writes to its terminal streams (`terminal()`: hpcrl's own log lines and
  errors, written there by hpcrl.controller.console), and, once a line that begins a process's
  death appears in its stdout or stderr (`Fatal Python error`, `terminate called`, glibc's
  checks), everything from that line on, each line prefixed with the rank's label.

The child ignores the job's signals, so it keeps copying while the rank is torn down, and it ends
at EOF of all its pipes: when the rank and every process the rank gave its stdout/stderr to are
gone. So it never outlives them. When its parent (the rank) is gone it writes an exit line with the
time; the controller reads that line as the time of death.

File format: per process that wrote to the file (a Slurm restart appends to the same file),
`MARK` + `start pid=P host=H at=T`, then the process's output (stdout and stderr as they arrived; a
line is never shared by the two), then `MARK` + `exit pid=P at=T` (or `closed ...` when the pipes
were closed while the process lived on).

Limits: the file must be readable on the controller's node to be quoted (a shared run folder; a
rank's node-local /tmp is not); a child that cannot keep up (the terminal blocks, as it would
block the rank itself without the child) slows the rank's writes down, never loses them.
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
from typing import TextIO

MARK = "[hpcrl stderr] "
_LINE = re.compile(r"^\[hpcrl stderr\] (start|exit|closed) pid=(\d+)(?: host=(\S*))? at=([0-9.]+)$", re.M)
# What begins the story of a process's death (a stdlib-only subset of hpcrl.controller.postmortem's
# list: the child imports nothing of hpcrl). Narrow on purpose: in quiet mode a match sends the rest
# of the rank's output to the terminal.
_FATAL = re.compile(rb"Fatal Python error|terminate called|double free or corruption|free\(\): invalid"
                    rb"|malloc\(\): |corrupted size vs|Caught signal \d+ \(")

_capture: subprocess.Popen | None = None  # the child of this process, kept referenced for its lifetime
_terminal: dict[str, TextIO] = {}  # "out" / "err": the pipes whose bytes the child always shows
_quiet = False


def _mark(kind: str, pid: int, at: float, host: str | None = None) -> bytes:
    where = f" host={host}" if host is not None else ""
    return f"{MARK}{kind} pid={pid}{where} at={at:.6f}\n".encode()


def start_capture(path: str, quiet: bool = False, label: str = "") -> bool:
    """Tee this process's fd 1 and fd 2 (and so its children's) into `path` from now on; False if
    impossible. quiet: the terminal gets only what is written to `terminal()` (and a fatal end,
    prefixed with `label`); else everything, as without the capture.

    Call it before MPI starts: it forks (and execs at once), which some MPI transports do not
    survive once initialised (memory registered with the network card).
    """
    global _capture, _quiet
    if _capture is not None:
        return True
    created: list[int] = []

    def pipe() -> tuple[int, int]:
        ends = os.pipe()
        created.extend(ends)
        return ends

    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "ab") as f:
            f.write(_mark("start", os.getpid(), time.time(), os.uname().nodename))
        err_r, err_w = pipe()
        out_r, out_w = pipe()
        tout_r, tout_w = pipe()
        terr_r, terr_w = pipe()
        original_err = os.dup(2)  # the child's copy of the terminal's stderr (its own fd 2 is /dev/null)
        created.append(original_err)
        fds = (out_r, tout_r, terr_r, original_err)
        _capture = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), path, str(os.getpid()),
             "quiet" if quiet else "verbose", label, ",".join(map(str, fds))],
            stdin=err_r, stderr=subprocess.DEVNULL, close_fds=True, pass_fds=fds,
            # own session: a signal to the rank's process group (Ctrl-C, a proxy cleaning up) must
            # not end the copy before the rank's last words are in the file
            start_new_session=True,
        )
        # fd 1 and fd 2 stay inheritable: child processes of the rank are captured too; the terminal
        # pipes do not (close-on-exec), so only this process's hpcrl lines pass them
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
    except OSError as e:
        for fd in created:
            os.close(fd)
        _capture = None  # a child already started sees EOF on every pipe and ends
        print(f"[hpcrl] output is not captured in {path}: {e}", file=sys.stderr, flush=True)
        return False
    for fd in created:
        if fd not in (tout_w, terr_w):  # the child has its copies; fd 1 and 2 are the rank's
            os.close(fd)
    _terminal["out"] = os.fdopen(tout_w, "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    _terminal["err"] = os.fdopen(terr_w, "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    _quiet = quiet
    try:  # stdout is a pipe now: line by line, so that it keeps its order with stderr in the file
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    return True


def terminal(err: bool = False) -> TextIO:
    """Where hpcrl's own lines go so that the terminal shows them in quiet mode too (and the rank's
    file gets them): the capture's terminal pipe, or plain stdout / stderr without a capture."""
    stream = _terminal.get("err" if err else "out")
    if stream is not None:
        return stream
    return sys.stderr if err else sys.stdout


def is_quiet() -> bool:
    """True when the capture keeps the rank's library output off the terminal."""
    return _quiet


def flush_terminal(wait_s: float = 2.0) -> None:
    """Push buffered terminal lines into the pipe and wait (up to `wait_s`) until the child has read
    everything the rank wrote: before an abort. Why wait: MPI_Abort ends the launcher, and what the
    child copies after that reaches no terminal (seen: the controller's traceback only in its file)."""
    for stream in _terminal.values():
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if _capture is None:
        return
    import fcntl
    import struct
    import termios

    fds = [1, 2, *(stream.fileno() for stream in _terminal.values() if not stream.closed)]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:  # FIONREAD on a pipe's write end: the bytes not read yet
            unread = sum(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] for fd in fds)
        except OSError:  # not a pipe (the capture was replaced): nothing to wait for
            return
        if unread == 0:
            time.sleep(0.05)  # the child's write of what it read last
            return
        time.sleep(0.01)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _prefixed(data: bytes, prefix: bytes, at_line_start: bool) -> bytes:
    """`data` with `prefix` at the start of each of its lines (the first only when it starts one)."""
    body = data[:-1] if data.endswith(b"\n") else data
    out = body.replace(b"\n", b"\n" + prefix) + data[len(body):]
    return prefix + out if at_line_start else out


def _tee(path: str, parent: int, quiet: bool, label: str, fds: list[int]) -> None:
    """The child's loop (see the module docstring). fd 0: the rank's stderr."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    try:
        log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        log = -1
    out_r, tout_r, terr_r, original_err = fds
    # where each pipe's bytes go on the terminal (fd 1 is the rank's original stdout); None: nowhere
    # unless a fatal line came (quiet mode)
    route: dict[int, int | None] = {0: None if quiet else original_err, out_r: None if quiet else 1,
                                    tout_r: 1, terr_r: original_err}
    broken: set[int] = set()  # a full disk or a closed terminal must not stop the other copies
    state = {"last": -1, "file_at_line_start": True, "fatal": False, "term_at_line_start": True}
    tails = {0: b"", out_r: b""}
    prefix = f"[{label}] ".encode() if label else b""

    def to(fd: int, data: bytes) -> None:
        if fd >= 0 and fd not in broken:
            try:
                _write_all(fd, data)
            except OSError:
                broken.add(fd)

    def to_file(src: int, data: bytes) -> None:
        if src != state["last"] and not state["file_at_line_start"]:
            to(log, b"\n")  # two pipes never share a line of the file
        to(log, data)
        state["last"], state["file_at_line_start"] = src, data.endswith(b"\n")

    def mark(kind: str, at: float) -> None:
        if not state["file_at_line_start"]:
            to(log, b"\n")
        to(log, _mark(kind, parent, at))
        state["last"], state["file_at_line_start"] = -1, True

    def to_terminal(src: int, data: bytes) -> None:
        dst = route[src]
        if dst is not None:
            to(dst, data)
            return
        if not state["fatal"]:
            window = tails[src] + data
            found = _FATAL.search(window)
            if found is None:
                tails[src] = window[-256:]
                return
            state["fatal"] = True
            data = window[window.rfind(b"\n", 0, found.start()) + 1:]
            state["term_at_line_start"] = True
        to(original_err, _prefixed(data, prefix, bool(state["term_at_line_start"])))
        state["term_at_line_start"] = data.endswith(b"\n")

    open_fds = [0, out_r, tout_r, terr_r]
    exit_written = False
    while open_fds:
        ready = select.select(open_fds, [], [], 0.1)[0]
        if not ready:
            # the rank is gone, but a process it started still holds its stdout or stderr
            if not exit_written and os.getppid() != parent:
                mark("exit", time.time())
                exit_written = True
            continue
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if not data:
                open_fds.remove(fd)
                continue
            to_file(fd, data)
            to_terminal(fd, data)
    closed_at = time.time()  # EOF: the last holder of the pipes has exited (or closed them)
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
    _tee(sys.argv[1], int(sys.argv[2]), quiet=sys.argv[3] == "quiet", label=sys.argv[4],
         fds=[int(fd) for fd in sys.argv[5].split(",")])
