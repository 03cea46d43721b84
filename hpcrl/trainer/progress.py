"""Lines in the log while a long phase of a step runs: rollout, validation, update, checkpoint save.

A step's phases run on the workers as single calls, so the controller sees nothing of their progress
inside; what it knows is how long the same phase took the last time and at what rate (the step's
`time/<phase>` and `throughput/<phase>_tokens_per_s`). A phase that has run `first_after_s` gets a
line, then one every `every_s` (logging.progress_after_s / progress_every_s), and a last one when it
ends:

    step 4/100: update_actor 1m05s | last time 1m30s at 9420 tok/s | ETA 25 s
    step 4/100: update_actor done in 1m31s

Validation runs batch by batch on the controller and says how far it is (`advance`):

    step 1/100: validate 45 s | 96/256 prompts at 2.1 prompts/s | ETA 1m16s

(A colon after the step, where the step's own line has ` | `: tools that read step lines from
controller.log tell them apart.)

Phases are announced by `PhaseTimer` (hpcrl.trainer.metrics) and `phase_running`, to the reporter
that `activate` installed (the trainer's loop; none elsewhere, e.g. in tests and benchmarks).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


def duration(seconds: float) -> str:
    """4 s, 12m05s, 3h07m, 2d04h."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


@dataclass
class _Running:
    phase: str
    started: float
    next_line: float
    work: float | None = None  # units the phase will do (validation prompts), when known
    done: float = 0.0
    unit: str = ""
    lines: int = 0  # progress lines written for it so far


class PhaseProgress:
    """Writes progress lines for long phases through `emit` (a thread polls once a second)."""

    def __init__(self, emit: Callable[[str], None], first_after_s: float = 30.0, every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.emit = emit
        self.first_after_s = first_after_s
        self.every_s = every_s
        self.clock = clock
        self.context = ""  # e.g. "step 4/100", set by the loop
        self._duration = duration
        self._lock = threading.Lock()
        self._stack: list[_Running] = []
        self._last_s: dict[str, float] = {}  # phase -> seconds it took the last time
        self._last_rate: dict[str, tuple[float, str]] = {}  # phase -> (rate, unit) of the last time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # what the loop tells it -------------------------------------------------------------------
    def begin(self, phase: str, work: float | None = None, unit: str = "") -> None:
        now = self.clock()
        with self._lock:
            self._stack.append(_Running(phase, now, now + self.first_after_s, work, 0.0, unit))

    def advance(self, n: float, work: float | None = None, unit: str | None = None) -> None:
        """`n` more units of the innermost phase are done (of `work` in all, when given now)."""
        with self._lock:
            if self._stack:
                r = self._stack[-1]
                r.done += n
                r.work = work if work is not None else r.work
                r.unit = unit if unit is not None else r.unit

    def end(self) -> None:
        now = self.clock()
        with self._lock:
            if not self._stack:
                return
            r = self._stack.pop()
            self._last_s[r.phase] = now - r.started
            if r.work is not None and r.done > 0 and now > r.started:
                self._last_rate[r.phase] = (r.done / (now - r.started), f"{r.unit}/s")
            text = (f"{self._head()}{r.phase} done in {self._duration(now - r.started)}" if r.lines else None)
        if text:
            self.emit(text)

    def learn(self, phase: str, rate: float, unit: str) -> None:
        """The rate `phase` ran at the last time, e.g. the step's throughput/update_actor_tokens_per_s."""
        with self._lock:
            self._last_rate[phase] = (rate, unit)

    def learn_step(self, metrics: dict[str, Any]) -> None:
        """Take each phase's tokens/s from a step's metrics (throughput/<phase>_tokens_per_s)."""
        for key, value in metrics.items():
            if key.startswith("throughput/") and key.endswith("_tokens_per_s") and isinstance(value, (int, float)):
                self.learn(key.removeprefix("throughput/").removesuffix("_tokens_per_s"), float(value), "tok/s")

    # the line ---------------------------------------------------------------------------------
    def _head(self) -> str:
        return f"{self.context}: " if self.context else ""

    def due_line(self) -> str | None:
        """The progress line of the innermost phase if one is due now (and schedules the next)."""
        now = self.clock()
        with self._lock:
            if not self._stack or now < self._stack[-1].next_line or self.every_s <= 0:
                return None
            r = self._stack[-1]
            r.next_line = now + self.every_s
            r.lines += 1
            elapsed = now - r.started
            parts = [f"{self._head()}{r.phase} {self._duration(elapsed)}"]
            if r.work is not None and r.done > 0:
                rate = r.done / elapsed
                parts.append(f"{r.done:g}/{r.work:g} {r.unit} at {rate:.3g} {r.unit}/s")
                parts.append(f"ETA {self._duration(max(r.work - r.done, 0.0) / rate)}")
                return " | ".join(parts)
            last = self._last_s.get(r.phase)
            rate_unit = self._last_rate.get(r.phase)
            if last is None:
                parts.append("first time: no pace yet")
                return " | ".join(parts)
            before = f"last time {self._duration(last)}"
            if rate_unit is not None:
                before += f" at {rate_unit[0]:.4g} {rate_unit[1]}"
            parts.append(before)
            parts.append(f"ETA {self._duration(last - elapsed)}" if last > elapsed else "past the last time's length")
            return " | ".join(parts)

    # the thread -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None and self.every_s > 0:
            self._thread = threading.Thread(target=self._run, name="hpcrl-progress", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            text = self.due_line()
            if text:
                self.emit(text)


_active: PhaseProgress | None = None


def activate(progress: PhaseProgress | None) -> None:
    """Make `progress` the reporter that phases announce themselves to (None: none)."""
    global _active
    _active = progress


@contextmanager
def phase_running(phase: str, work: float | None = None, unit: str = "") -> Iterator[None]:
    """Tell the active reporter that `phase` runs for the duration of the block."""
    progress = _active
    if progress is None:
        yield
        return
    progress.begin(phase, work, unit)
    try:
        yield
    finally:
        progress.end()


def advance(n: float, work: float | None = None, unit: str | None = None) -> None:
    """`n` more units of the running phase are done (no-op without an active reporter)."""
    if _active is not None:
        _active.advance(n, work, unit)
