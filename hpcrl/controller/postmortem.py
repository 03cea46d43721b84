"""Which rank of a failed call failed first, and which failures are only consequences of it.

Why: when one rank dies inside C++ during a collective (gloo's `terminate called after throwing
an instance of 'gloo::EnforceNotMet'`, a segfault, the OOM killer), its peers' collectives fail a
few milliseconds later with `Connection closed by peer`, and those errors are the ones that reach
the controller first; the dead rank sends nothing. So the controller collects the failures of a
call for a short grace period, learns who died from the ranks' stderr files (`stderr_log`), and
orders: a rank that died, or raised an error of its own, comes first (by time); errors that read
like a lost peer come after, as consequences.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hpcrl.controller.errors import RankFailure, RemoteFailure
from hpcrl.controller.stderr_log import StderrSection

# What a collective or a socket reports when the process at the other end has died or hung.
# Why by text: the exception types are generic (RuntimeError, DistBackendError) and differ by
# library and version; the messages below are the stable part.
CONSEQUENCE = re.compile(
    "|".join([
        r"Connection closed by peer",  # gloo tcp pair
        r"Connection reset by peer",
        r"Broken pipe",
        r"Connection refused",
        r"remote worker crashing",  # gloo's hint after a closed connection
        r"Timed out waiting",  # gloo / c10d store
        r"Socket Timeout",
        r"DistNetworkError",
        r"ncclRemoteError",
        r"remote process exited",  # NCCL
        r"NCCL communicator was aborted",
        r"[Cc]ollective operation timeout",  # NCCL watchdog
        r"MPI_ERR_PROC_FAILED",
    ]),
)

# Lines that begin the story of a process's death, in its stderr.
_FATAL_START = re.compile(
    r"terminate called|Fatal Python error|Segmentation fault|\*\*\* .+ \*\*\*|Assertion .* failed"
    r"|double free|free\(\): |malloc\(\): |corrupted |Caught signal \d+|Aborted \(core dumped\)"
)
_FATAL_PY = re.compile(r"Fatal Python error: (Aborted|Segmentation fault|Bus error|Floating[- ]point exception"
                       r"|Illegal instruction)")
_SIGNALS = {"Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS",
            "Floating point exception": "SIGFPE", "Floating-point exception": "SIGFPE",
            "Illegal instruction": "SIGILL"}
_UCX_SIGNAL = re.compile(r"Caught signal (\d+) \(([^:)]+)")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'(?:\s*\n\s*what\(\):\s*(.*))?")
_OTHER_CAUSE = re.compile(r"(terminate called (?:without an active exception|recursively)"
                          r"|\S.*Assertion .* failed\.?|\*\*\* .+ \*\*\*.*|double free or corruption.*"
                          r"|(?:free|malloc|realloc|munmap_chunk)\(\): .*|corrupted .*)")

EXCERPT_LINES = 20  # lines of a dead rank's stderr quoted in the error
_MAX_LINE = 400

# A death is ordered as if it had happened this much earlier than its stderr closed: the peers'
# errors it causes are raised within milliseconds, sometimes before the dying process has dumped
# its stacks and closed its files, and the clocks of different hosts differ by milliseconds.
DEATH_PRECEDENCE_S = 1.0


def is_consequence(text: str) -> bool:
    """True if an error message reads like the consequence of a peer that died or hung."""
    return bool(CONSEQUENCE.search(text))


def describe_death(text: str) -> tuple[str, bool]:
    """(what killed the process, whether that reads like a consequence) from its stderr text."""
    signal_name = None
    found = _FATAL_PY.findall(text)
    if found:
        signal_name = _SIGNALS.get(found[-1])  # the last one: a process dies once
    else:
        u = _UCX_SIGNAL.search(text)
        if u:
            signal_name = f"signal {u.group(1)} ({u.group(2).strip()})"
    cause = None
    t = _TERMINATE.search(text)
    if t:
        what = (t.group(2) or "").strip()
        cause = f"C++ std::terminate: uncaught {t.group(1)}" + (f": {what}" if what else "")
    else:
        o = _OTHER_CAUSE.search(text)
        if o:
            cause = o.group(1).strip()
            if cause.startswith("terminate called"):
                cause = f"C++ std::terminate ({cause})"
    if signal_name is None and cause:
        signal_name = "SIGABRT"  # libstdc++'s terminate, assert() and glibc's checks all end in abort()
    if signal_name and cause:
        desc = f"{signal_name} after {cause}"
    elif signal_name:
        desc = f"{signal_name} (stacks in its stderr below)"
    elif cause:
        desc = cause
    else:
        desc = ("exited without a fatal-error message in its stderr: SIGKILL (e.g. the kernel's OOM killer, "
                "see dmesg) or os._exit")
    return desc, bool(cause and is_consequence(cause))


def excerpt(text: str, lines: int = EXCERPT_LINES) -> str:
    """The part of a dead process's stderr worth quoting: from the first fatal line on if there is
    one among the last lines (faulthandler's dump of every thread would push it out of a plain
    tail), else the last `lines` lines."""
    all_lines = [ln if len(ln) <= _MAX_LINE else ln[:_MAX_LINE] + " ..." for ln in text.splitlines()
                 if not ln.startswith("Extension modules: ")]  # faulthandler's list, noise here
    window = all_lines[-4 * lines:]
    first = next((i for i, line in enumerate(window) if _FATAL_START.search(line)), None)
    if first is None:
        chosen = window[-lines:]
    else:
        start = max(0, first - 2)
        chosen = window[start:start + 2 * lines]
    return "\n".join(chosen)


def raised(rank: int, where: str, failure: RemoteFailure, observed_at: float) -> RankFailure:
    what = f"{failure.exc_type}: {failure.exc_message}"
    return RankFailure(rank=rank, where=where, kind="raised", what=what, at=failure.at or observed_at,
                       consequence=is_consequence(what), remote=failure)


def died(rank: int, where: str, section: StderrSection, at: float, lost: str = "") -> RankFailure:
    """A rank whose process is gone (`section.exited_at`), or silent (`lost` says for how long)."""
    death, consequence = "", False
    if section.exited_at is not None or _FATAL_START.search(section.text):
        death, consequence = describe_death(section.text)
    if section.exited_at is not None:
        kind, what = "died", death + (f"; {lost}" if lost else "")
    else:
        kind, what = "lost", (lost or "lost") + (f"; its stderr shows {death}" if death else "")
    return RankFailure(rank=rank, where=where, kind=kind, what=what, at=at, consequence=consequence,
                       stderr_path=section.path, stderr_excerpt=excerpt(section.text) if section.readable else "",
                       stderr_readable=section.readable, death=death)


def order(failures: Iterable[RankFailure]) -> list[RankFailure]:
    """First failure first: causes before consequences, then by time (deaths a little earlier)."""
    def key(f: RankFailure) -> tuple[int, float, int]:
        if f.kind == "no reply":
            return (2, 0.0, f.rank)
        shift = DEATH_PRECEDENCE_S if f.kind in ("died", "lost") else 0.0
        return (int(f.consequence), f.at - shift, f.rank)

    return sorted(failures, key=key)
