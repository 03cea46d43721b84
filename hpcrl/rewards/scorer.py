"""RewardScorer: scores a batch of completions in a small pool of worker processes.

Why processes and not threads: a reward function may hang (a symbolic check that explodes, user code
stuck on I/O), and only a process can be stopped; after a timeout the worker is killed (its whole
process group, so anything it started goes too) and replaced. Why not multiprocessing: the controller is
MPI rank 0 of a torch program, so forking it is unsafe and "spawn"/"forkserver" re-import its __main__
(torch, mpi4py) in the child. Workers are fresh interpreters with the MPI/PMI variables removed from
their environment; see `worker.py` for the protocol.

Timeouts are per sample: a worker gets a chunk of samples and streams one result per sample; when
`timeout_s` passes without the next result, that sample scores 0 and is counted in reward/timeouts, and
the rest of the chunk goes to a fresh worker. A function that raises (or a worker that dies) scores 0
for that sample and is counted in reward/errors. Either way the run goes on, and each failure is logged
once with the sample's index.
"""

from __future__ import annotations

import logging
import math
import os
import selectors
import signal
import subprocess
import sys
import time
import weakref
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

from hpcrl.rewards import builtin
from hpcrl.rewards.loader import resolve_function
from hpcrl.rewards.types import RewardInput, RewardResult
from hpcrl.rewards.worker import split_frames, write_frame

log = logging.getLogger("hpcrl.rewards")

# Start-up includes importing math-verify/sympy on a busy node; it never counts against a sample.
START_TIMEOUT_S = 120.0
MAX_CHUNK = 64
_LOGGED_FAILURES_PER_CALL = 10
# Environment a worker must not inherit: it would look like (and could join) the MPI job.
_MPI_ENV_PREFIXES = ("PMI_", "PMIX_", "PMI2_", "HYDRA_", "HYDI_", "MPIR_", "MPICH_", "OMPI_", "I_MPI_",
                     "MPI_LOCALNRANKS", "MPI_LOCALRANKID")
_WORKER_CMD = "from hpcrl.rewards.worker import main; main()"


def worker_env() -> dict[str, str]:
    """The controller's environment minus MPI/PMI variables, one thread per math library, and hpcrl
    importable even when it is not installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_ENV_PREFIXES)}
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Worker:
    """One worker process and the parent's view of it: read buffer, samples in flight, deadline."""

    def __init__(self, init: dict[str, Any], env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_CMD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buf = bytearray()
        self.ready = False
        self.pending: deque[int] = deque()
        self.deadline = time.monotonic() + START_TIMEOUT_S
        self.send(("init", init))

    def send(self, msg: Any) -> bool:
        try:
            write_frame(self.proc.stdin, msg)
            return True
        except (BrokenPipeError, OSError):
            return False

    def read(self) -> list[Any] | None:
        """Complete messages available now; None once the worker has closed its end (it died)."""
        eof = False
        while True:
            try:
                data = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                break
            if not data:
                eof = True
                break
            self.buf += data
        msgs = split_frames(self.buf)
        return None if eof and not msgs else msgs

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def _shutdown(workers: list[_Worker], grace_s: float = 2.0) -> None:
    """EOF to every worker at once (idle ones exit at that), then kill whatever is left after grace_s."""
    for w in workers:
        try:
            w.proc.stdin.close()
        except OSError:
            pass
    end = time.monotonic() + grace_s
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        w.kill()
    workers.clear()


class RewardScorer:
    """Scores completions with `function` ("builtin" or "package.module:function", verl's signature
    fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict with "score").

    A bad `function` raises ValueError here, before anything else of the run starts. The builtin scorer
    raises ValueError in `score` for a data_source it has no rule for (a config error, not a sample
    error). `format_weight` applies to the builtin scorer only (custom functions score format
    themselves). Workers start in the background at construction; call `close` (or use `with`).
    """

    def __init__(self, function: str = "builtin", timeout_s: float = 10.0, format_weight: float = 0.0,
                 workers: int = 2):
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s}: must be > 0 seconds.")
        if workers < 1:
            raise ValueError(f"reward workers={workers}: need at least 1 worker process.")
        self.function = function
        self.builtin = function == "builtin"
        if not self.builtin:
            resolve_function(function)
        self.timeout_s = float(timeout_s)
        self.format_weight = float(format_weight)
        self._init = {"function": function, "sys_path": list(sys.path), "format_weight": self.format_weight,
                      "parent_pid": os.getpid(), "timeout_s": self.timeout_s}
        self._env = worker_env()
        self._sel = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        for _ in range(workers):
            self._add_worker()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        for w in self._workers:
            try:
                self._sel.unregister(w.fd)
            except (KeyError, ValueError):
                pass
        self._finalizer()
        self._sel.close()

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def _add_worker(self, at: int | None = None) -> _Worker:
        w = _Worker(self._init, self._env)
        self._sel.register(w.fd, selectors.EVENT_READ, w)
        if at is None:
            self._workers.append(w)
        else:
            self._workers[at] = w
        return w

    def _replace(self, w: _Worker, kill: bool) -> None:
        self._sel.unregister(w.fd)
        if kill:
            w.kill()
        else:
            w.proc.wait()
            w._close_pipes()
        self._add_worker(self._workers.index(w))

    def score(self, items: list[RewardInput]) -> RewardResult:
        """Score `items` (in order). Failures of single samples never raise; see the module docstring."""
        if not self._finalizer.alive:
            raise RuntimeError("RewardScorer.score called after close()")
        t0 = time.monotonic()
        if self.builtin:
            for ds in dict.fromkeys(it.data_source for it in items):
                if builtin.style_of(ds) is None:
                    raise builtin.unknown_data_source_error(ds)
        try:
            return self._score(items, t0)
        except BaseException:  # start-up failure, protocol error, Ctrl-C: the pool state is unknown
            self.close()
            raise

    def _score(self, items: list[RewardInput], t0: float) -> RewardResult:
        n = len(items)
        payload = [(i, it.data_source, it.response, it.ground_truth, dict(it.extra_info or {}), bool(it.truncated))
                   for i, it in enumerate(items)]
        size = max(1, min(MAX_CHUNK, math.ceil(n / (4 * len(self._workers))))) if n else 1
        queue: deque[list[int]] = deque(list(range(i, min(i + size, n))) for i in range(0, n, size))
        out: list[dict[str, Any] | None] = [None] * n
        remaining = n

        def fail(w: _Worker, error: str, timeout: bool) -> None:
            nonlocal remaining
            i = w.pending.popleft()
            out[i] = {"score": 0.0, "acc": None, "format": None, "pred": "", "extra": {}, "error": error,
                      "timeout": timeout}
            remaining -= 1
            if w.pending:
                queue.appendleft(list(w.pending))
                w.pending.clear()

        while remaining:
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and not w.pending and queue:
                    chunk = queue.popleft()
                    w.pending.extend(chunk)
                    w.deadline = now + self.timeout_s
                    if not w.send(("score", [payload[i] for i in chunk])):
                        fail(w, f"reward worker died before scoring (exit code {w.proc.poll()})", False)
                        self._replace(w, kill=True)
            busy = [w for w in self._workers if w.pending or not w.ready]
            if not busy and not queue:
                raise RuntimeError(f"reward scorer lost track of {remaining} samples (a bug in hpcrl.rewards)")
            wait = max(0.0, min(w.deadline for w in busy) - now) if busy else 0.0
            for key, _ in self._sel.select(wait):
                w = key.data
                msgs = w.read()
                if msgs is None:
                    code = w.proc.wait()
                    if not w.ready:
                        raise RuntimeError(f"reward worker exited during start-up with code {code} (reward."
                                           f"function={self.function!r}); its stderr is above.")
                    if w.pending:
                        fail(w, f"reward worker died while scoring this sample (exit code {code})", False)
                    else:
                        log.warning("reward worker %d exited (code %s) while idle; starting another",
                                    w.proc.pid, code)
                    self._replace(w, kill=False)
                    continue
                for msg in msgs:
                    if msg[0] == "ready":
                        w.ready, w.deadline = True, math.inf
                    elif msg[0] == "init_error":
                        raise RuntimeError(f"reward worker could not load reward.function={self.function!r}: "
                                           f"{msg[1]}")
                    elif msg[0] == "result":
                        i = w.pending.popleft()
                        if i != msg[1]:
                            raise RuntimeError(f"reward worker protocol error: expected sample {i}, got {msg[1]}")
                        out[i] = dict(msg[2], timeout=False)
                        remaining -= 1
                        w.deadline = time.monotonic() + self.timeout_s if w.pending else math.inf
            now = time.monotonic()
            for w in list(self._workers):
                if now < w.deadline:
                    continue
                if not w.ready:
                    raise RuntimeError(f"reward worker did not start within {START_TIMEOUT_S:.0f} s "
                                       f"(reward.function={self.function!r}).")
                if w.pending:
                    fail(w, f"timed out after {self.timeout_s:g} s", True)
                    self._replace(w, kill=True)
        return self._result(items, out, time.monotonic() - t0)

    def _result(self, items: list[RewardInput], out: list[dict[str, Any]], elapsed: float) -> RewardResult:
        if self.builtin:  # a failed builtin check is a wrong, unformatted answer
            for d in out:
                if d["error"] is not None:
                    d["acc"], d["format"] = 0.0, 0.0
        failures = [(i, d) for i, d in enumerate(out) if d["error"] is not None]
        for i, d in failures[:_LOGGED_FAILURES_PER_CALL]:
            log.warning("reward: sample %d (data_source=%r) %s: %s", i, items[i].data_source,
                        "timed out" if d["timeout"] else "failed", d["error"])
        if len(failures) > _LOGGED_FAILURES_PER_CALL:
            log.warning("reward: %d more failed samples in this batch (not shown)",
                        len(failures) - _LOGGED_FAILURES_PER_CALL)
        scores = [float(d["score"]) for d in out]
        timeouts = sum(1 for d in out if d["timeout"])
        metrics: dict[str, float] = {
            "reward/mean": sum(scores) / len(scores) if scores else 0.0,
            "reward/errors": float(len(failures) - timeouts),
            "reward/timeouts": float(timeouts),
            "time/reward": elapsed,
        }
        formats = [d["format"] for d in out if d["format"] is not None]
        if formats:
            metrics["reward/format_mean"] = sum(formats) / len(formats)
        by_source: dict[str, list[float]] = defaultdict(list)
        extras: dict[str, list[float]] = defaultdict(list)
        for it, d in zip(items, out):
            if d["acc"] is not None:
                by_source[it.data_source].append(d["acc"])
            for k, v in d["extra"].items():
                extras[k].append(v)
        accs = [a for v in by_source.values() for a in v]
        if accs:
            metrics["reward/acc_mean"] = sum(accs) / len(accs)
        for ds, v in by_source.items():
            metrics[f"reward/acc/{ds}"] = sum(v) / len(v)
        for k, v in extras.items():
            metrics.setdefault(f"reward/{k}", sum(v) / len(v))
        return RewardResult(scores=scores, metrics=metrics, details=out)
