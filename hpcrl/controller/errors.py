"""Errors the controller raises; each names the MPI rank and host it came from.

Why: in a job of hundreds of ranks the first question is always "which rank, on which
node, and what was its traceback?" — so that is in the message itself, not only in a
log file of some other rank.
"""

from __future__ import annotations

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

    def where(self) -> str:
        node = f", slurm node {self.node}" if self.node and self.node != self.host else ""
        return f"rank {self.rank} (host {self.host}{node}, pid {self.pid})"


class RemoteError(HpcrlRuntimeError):
    """A worker method raised; the message carries the remote traceback."""

    def __init__(self, failure: RemoteFailure, others: int = 0) -> None:
        self.failure = failure
        self.rank = failure.rank
        self.host = failure.host
        self.remote_traceback = failure.traceback
        more = f" (and {others} more rank(s) of this call failed)" if others else ""
        super().__init__(
            f"{failure.group}.{failure.method} failed on worker {failure.where()}, "
            f"group rank {failure.group_rank}: {failure.exc_type}: {failure.exc_message}{more}\n"
            f"--- remote traceback from {failure.where()} ---\n{failure.traceback.rstrip()}"
        )


class WorkerLostError(HpcrlRuntimeError):
    """A worker stopped sending heartbeats (killed, OOM, node lost) for longer than the bound."""

    def __init__(self, rank: int, where: str, silent_s: float, bound_s: float) -> None:
        self.rank = rank
        self.where = where
        self.silent_s = silent_s
        super().__init__(
            f"worker {where} is lost: no heartbeat for {silent_s:.1f} s (bound {bound_s:g} s); "
            "it was killed or its node failed"
        )


class CallTimeout(HpcrlRuntimeError, TimeoutError):
    """`Future.result(timeout=...)` ran out; the call itself is still pending on the workers."""
