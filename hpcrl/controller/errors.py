"""Errors the controller raises; each names the MPI rank and host it came from.

Why: in a job of hundreds of ranks the first question is always "which rank, on which
node, and what was its traceback?" — so that is in the message itself, not only in a
log file of some other rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass


class HpcrlRuntimeError(RuntimeError):
    """Base of errors raised by the hpcrl controller runtime."""


@dataclass(frozen=True)
class RemoteFailure:
    """A worker-side exception, as shipped to the controller (plain fields, pickled)."""

    rank: int
    host: str
    node: str
    pid: int
    group: str
    group_rank: int
    method: str
    exc_type: str
    exc_message: str
    traceback: str
    at: float = 0.0  # wall-clock time the worker caught the exception (orders the failures of a call)

    def where(self) -> str:
        node = f", slurm node {self.node}" if self.node and self.node != self.host else ""
        return f"rank {self.rank} (host {self.host}{node}, pid {self.pid})"


@dataclass(frozen=True)
class RankFailure:
    """How one rank took part in a failed call, as the controller's report lists it.

    `kind`: "raised" (a method's exception, `remote` holds it), "died" (its process exited: its
    stderr file says when), "lost" (silent past the heartbeat bound) or "no reply" (still in the
    call when the report was made). `consequence`: the message reads like the effect of a peer
    that died (e.g. gloo's `Connection closed by peer`), see `hpcrl.controller.postmortem`.
    """

    rank: int
    where: str
    kind: str
    what: str
    at: float = 0.0  # wall-clock time of the failure; 0 when unknown
    consequence: bool = False
    stderr_path: str = ""
    stderr_excerpt: str = ""  # the end of its stderr (dead or lost ranks)
    stderr_readable: bool = False  # its stderr file could be read on the controller's node
    death: str = ""  # what its stderr says ended it (dead or lost ranks), e.g. "SIGABRT after C++ ..."
    remote: RemoteFailure | None = None

    def line(self, first_at: float = 0.0) -> str:
        what = self.what if len(self.what) <= 500 else self.what[:500] + " ..."
        when = f" [{self.at - first_at:+.3f} s]" if self.at and first_at and self.kind != "no reply" else ""
        return f"{self.where}{when}: {what}"

    def stderr_block(self) -> str:
        if self.stderr_excerpt:
            return f"\n--- stderr of {self.where} ({self.stderr_path}) ---\n{self.stderr_excerpt}"
        if self.kind not in ("died", "lost"):
            return ""
        if not self.stderr_path:
            return f"\n(the stderr of {self.where} was not kept in a file: see launchers/hpcrl_entry.py)"
        if self.stderr_readable:
            return f"\n(nothing in the stderr of {self.where}, {self.stderr_path})"
        return f"\n(the stderr of {self.where}, {self.stderr_path}, cannot be read on the controller's node)"


def describe_others(failures: Sequence[RankFailure]) -> str:
    """The lines after the first failure: consequences, other failures, ranks that did not reply."""
    if len(failures) < 2:
        return ""
    first, others = failures[0], failures[1:]
    sections = [
        ("consequences", [f for f in others if f.kind != "no reply" and f.consequence]),
        ("also failed", [f for f in others if f.kind != "no reply" and not f.consequence]),
        ("no reply", [f for f in others if f.kind == "no reply"]),
    ]
    lines = []
    if first.consequence:
        lines.append("(every failure seen reads like the consequence of a lost peer, and no rank was seen to die)")
    for title, group in sections:
        if group:
            lines.append(f"{title} ({len(group)}):")
            lines.extend("  " + f.line(first.at) for f in group)
    return "\n" + "\n".join(lines)


class RemoteError(HpcrlRuntimeError):
    """A worker method raised; the message carries the remote traceback.

    `failures`: every rank of the call as the controller saw it, the first failure first (this
    one), then the consequences and the ranks that did not reply (see `RankFailure`).
    """

    def __init__(self, failure: RemoteFailure, others: int = 0, failures: Sequence[RankFailure] = ()) -> None:
        self.failure = failure
        self.rank = failure.rank
        self.host = failure.host
        self.remote_traceback = failure.traceback
        self.failures = list(failures)
        if self.failures:
            others = sum(f.kind != "no reply" for f in self.failures[1:])
        more = f" (and {others} more rank(s) of this call failed)" if others else ""
        super().__init__(
            f"{failure.group}.{failure.method} failed on worker {failure.where()}, "
            f"group rank {failure.group_rank}: {failure.exc_type}: {failure.exc_message}{more}\n"
            f"--- remote traceback from {failure.where()} ---\n{failure.traceback.rstrip()}"
            f"{describe_others(self.failures)}"
        )


class WorkerLostError(HpcrlRuntimeError):
    """A worker stopped sending heartbeats (killed, OOM, node lost) for longer than the bound."""

    def __init__(self, rank: int, where: str, silent_s: float, bound_s: float,
                 failures: Sequence[RankFailure] = (), context: str = "") -> None:
        self.rank = rank
        self.where = where
        self.silent_s = silent_s
        self.failures = list(failures)
        first = self.failures[0] if self.failures else None
        detail = first.death if first else ""
        super().__init__(
            f"{context}worker {where} is lost: no heartbeat for {silent_s:.1f} s (bound {bound_s:g} s); "
            f"it was killed or its node failed{f'; its stderr shows {detail}' if detail else ''}"
            f"{first.stderr_block() if first else ''}{describe_others(self.failures)}"
        )


class WorkerDiedError(WorkerLostError):
    """A worker's process exited during a call (a signal, a C++ abort, the OOM killer).

    Raised instead of the `RemoteError`s of the ranks whose collectives failed because of it; the
    message quotes the end of its stderr (`hpcrl.controller.stderr_log`) and lists those ranks
    as consequences. A `WorkerLostError`, so code that handles lost workers handles this too.
    """

    def __init__(self, first: RankFailure, failures: Sequence[RankFailure], context: str = "") -> None:
        self.rank = first.rank
        self.where = first.where
        self.silent_s = 0.0
        self.failures = list(failures) or [first]
        clock = time.strftime("%H:%M:%S", time.localtime(first.at)) + f".{int(first.at % 1 * 1000):03d}"
        HpcrlRuntimeError.__init__(
            self,
            f"{context}worker {first.where} is lost: its process died at {clock}: {first.what}"
            f"{first.stderr_block()}{describe_others(self.failures)}",
        )


class CallTimeout(HpcrlRuntimeError, TimeoutError):
    """`Future.result(timeout=...)` ran out; the call itself is still pending on the workers."""
