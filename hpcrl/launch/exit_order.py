"""Leave a hydra job one rank at a time, so that `mpiexec` itself exits 0 after a clean run.

Why (measured with pip's MPICH 5.0.2 and the single-machine route of `commands.py`:
`-launcher fork -disable-auto-cleanup`, one hydra proxy per rank): with auto-cleanup disabled,
every rank's exit, also a clean one after MPI_Finalize, makes its proxy report the rank as
terminated, and mpiexec then writes a "send SIGUSR1" request to every proxy whose exit it has
not read yet. MPI_Finalize synchronises the ranks, so they all exit within milliseconds. A proxy
that has already exited, but whose exit mpiexec has not read yet, is then written to twice;
the second write fails with EPIPE and mpiexec dies of SIGPIPE (returncode -13; with SIGPIPE
ignored it prints "write error (Broken pipe)" and exits 255 instead). In a bare 5-rank
mpi4py world that only calls MPI_Finalize, 9 of 10 runs on the loaded 2-core CI machine failed
that way, so this is not a question of load alone, and ignoring SIGPIPE does not help.

The cure: after MPI_Finalize the ranks leave in a fixed order (workers by rank, controller
last). A rank leaves only once (1) the proxy of the rank before it has exited and (2) it has
received one SIGUSR1 per rank that left before it, i.e. mpiexec has handled each of those exits.
Then mpiexec handles the exit of the previous proxy before any later one, and writes at most one
request to a proxy that is gone (that write still succeeds: the socket is only half closed).

Only this launch route needs it: under srun (PMI-2) nobody sends SIGUSR1, and with hydra's
auto-cleanup (its default) a clean exit is not announced at all. Every wait is bounded.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Sequence
from typing import Any

_PROXY = "hydra_pmi_proxy"
_LAUNCHERS = ("mpiexec", "mpirun")


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie counts: its sockets are already closed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def hydra_announces_exits() -> bool:
    """True if this process was started by a local hydra proxy of an mpiexec with auto-cleanup off.

    Why from /proc: the ranks cannot ask hydra; the flag is only on mpiexec's command line
    (the fork launcher makes mpiexec the proxy's parent). The last of
    `-disable-auto-cleanup`/`-enable-auto-cleanup` wins, as in hydra.
    """
    proxy = os.getppid()
    args = _cmdline(proxy)
    if not args or os.path.basename(args[0]) != _PROXY:
        return False
    launcher = _cmdline(_parent_of(proxy))
    if not launcher or not os.path.basename(launcher[0]).startswith(_LAUNCHERS):
        return False
    auto_cleanup = True
    for arg in launcher[1:]:
        flag = arg.lstrip("-")
        if flag == "disable-auto-cleanup":
            auto_cleanup = False
        elif flag == "enable-auto-cleanup":
            auto_cleanup = True
    return not auto_cleanup


class ExitTurn:
    """This rank's place in the exit order: `arm()` before MPI_Finalize, `wait()` after it.

    SIGUSR1 deliveries are counted through `signal.set_wakeup_fd` (CPython writes one byte per
    delivery, where a Python handler would run once for several); the handler is installed
    with SA_RESTART so the notices do not interrupt MPI's blocking system calls.
    """

    def __init__(self, position: int, predecessor_proxy: int | None, stall_s: float, who: str = "") -> None:
        self.position = position  # how many ranks leave before this one
        self.predecessor_proxy = predecessor_proxy
        self.stall_s = stall_s  # give up after this long without progress (a lost or merged notice)
        self.who = who
        self._fds: tuple[int, int] | None = None
        self._old_fd = -1
        self._old_handler: Any = signal.SIG_IGN
        self.notices = 0

    def arm(self) -> None:
        """Start counting exit notices; must run in the main thread before any rank can exit."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._fds = (r, w)
        self._old_handler = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
        signal.siginterrupt(signal.SIGUSR1, False)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def disarm(self) -> None:
        """Stop counting; later notices go where they went before (never to SIGUSR1's default action,
        which would kill a rank that is still tearing down)."""
        if self._fds is None:
            return
        keep = self._old_handler not in (signal.SIG_DFL, None)
        signal.signal(signal.SIGUSR1, self._old_handler if keep else signal.SIG_IGN)
        signal.set_wakeup_fd(self._old_fd)
        for fd in self._fds:
            os.close(fd)
        self._fds = None

    def _read_notices(self) -> bool:
        assert self._fds is not None
        got = False
        while True:
            try:
                data = os.read(self._fds[0], 4096)
            except BlockingIOError:
                return got
            if not data:
                return got
            n = data.count(signal.SIGUSR1)
            self.notices += n
            got |= n > 0

    def wait(self) -> None:
        """Return when it is this rank's turn to exit (or when waiting made no progress for `stall_s`)."""
        if self._fds is None:
            return
        try:
            last_progress = time.monotonic()
            predecessor_gone = self.predecessor_proxy is None
            while True:
                if self._read_notices():
                    last_progress = time.monotonic()
                if not predecessor_gone and gone(self.predecessor_proxy):
                    predecessor_gone = True
                    last_progress = time.monotonic()
                if predecessor_gone and self.notices >= self.position:
                    return
                if time.monotonic() - last_progress > self.stall_s:
                    from hpcrl.controller.stderr_log import terminal  # (a quiet terminal shows it too)

                    print(f"[hpcrl] {self.who}: exit turn not confirmed after {self.stall_s:g} s without progress "
                          f"({self.notices}/{self.position} exit notices, previous proxy "
                          f"{'gone' if predecessor_gone else 'alive'}); exiting anyway", file=terminal(err=True),
                          flush=True)
                    return
                select.select([self._fds[0]], [], [], 0.01)
        finally:
            self.disarm()


def plan_exit(rank: int, hosts: Sequence[str], proxies: Sequence[int], announced: Sequence[bool],
              controller_rank: int = 0) -> tuple[int, int | None] | None:
    """(position, proxy pid of the rank before) in the exit order, or None if no order is needed.

    Needed when every rank runs under its own hydra proxy on one host and hydra announces exits:
    the proxies are then local processes whose exit this rank can observe. With several ranks per
    proxy, or proxies on other hosts, the ranks leave as before.
    """
    size = len(hosts)
    if size < 2 or not all(announced) or len(set(hosts)) != 1 or len(set(proxies)) != size:
        return None
    order = [r for r in range(size) if r != controller_rank] + [controller_rank]
    position = order.index(rank)
    return position, (proxies[order[position - 1]] if position else None)
