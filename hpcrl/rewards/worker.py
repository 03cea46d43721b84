"""The reward worker process: scores samples with the configured function, one result per sample.

Started by `RewardScorer` as a fresh interpreter (`python -c ...`), never forked from the controller:
the controller is MPI rank 0 of a torch program, and a forked child (or a multiprocessing "spawn"
child, which re-imports the controller's __main__) could touch MPI or inherit torch's threads. This
process imports only hpcrl.rewards and the reward function's module.

Protocol on the inherited stdin/stdout pipes: frames of an 8-byte big-endian length and a pickle.
  parent -> worker: ("init", {function, sys_path, format_weight, parent_pid, timeout_s}), then
                    ("score", [(index, data_source, response, ground_truth,
                    extra_info, truncated), ...]); EOF means exit.
  worker -> parent: ("ready", pid) or ("init_error", message); ("result", index, {...}) per sample, in
                    order, as each finishes, so the parent knows which sample a hang belongs to.
The protocol file descriptors are private copies: fd 0 becomes /dev/null and fd 1 goes to stderr, so a
reward function that prints or reads stdin cannot corrupt the stream.
"""

from __future__ import annotations

import math
import numbers
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

_HEADER = struct.Struct("!Q")


def write_frame(stream: BinaryIO, msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    """The next message, or None at EOF."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def split_frames(buf: bytearray) -> list[Any]:
    """Pop every complete frame off the front of `buf` (the parent's non-blocking reader)."""
    out = []
    while len(buf) >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buf)
        if len(buf) < _HEADER.size + size:
            break
        out.append(pickle.loads(bytes(buf[_HEADER.size:_HEADER.size + size])))
        del buf[:_HEADER.size + size]
    return out


def _real(value: Any) -> float | None:
    if isinstance(value, (str, bytes)) or value is None:
        return None
    if isinstance(value, numbers.Real) or hasattr(value, "__float__"):  # bool, int, float, numpy scalars
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def normalize(out: Any) -> dict[str, Any]:
    """A reward function's return value as {"score", "acc", "format", "pred", "extra"}; raises on a
    value that is not a finite number or a dict with a numeric "score"."""
    acc = fmt = None
    pred = ""
    extra: dict[str, float] = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"returned a dict without a 'score' key (keys: {sorted(out)})")
        score = _real(out["score"])
        acc, fmt = _real(out.get("acc")), _real(out.get("format"))
        pred = out["pred"] if isinstance(out.get("pred"), str) else ""
        for k, v in out.items():
            if k not in ("score", "acc", "format") and _real(v) is not None:
                extra[str(k)] = _real(v)
    else:
        score = _real(out)
    if score is None:
        shown = out["score"] if isinstance(out, dict) else out
        raise TypeError(f"returned {type(shown).__name__} {shown!r:.80}, expected a float or a dict with a "
                        "numeric 'score'")
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    return {"score": score, "acc": acc, "format": fmt, "pred": pred, "extra": extra, "error": None}


def describe(e: BaseException) -> str:
    """`Type: message (at file:line in function)` for the innermost frame: enough to find the bug."""
    text = f"{type(e).__name__}: {e}"
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        f = tb[-1]
        text += f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"
    return text


# When the scorer's per-sample timeout ends for the sample being scored (time.monotonic()), None
# outside a worker: a reward that runs for long (the code reward) stays inside it.
_sample_deadline: float | None = None
_sample_timeout_s: float | None = None


def sample_deadline() -> float | None:
    """The monotonic time at which the scorer gives up on the sample being scored, or None."""
    return _sample_deadline


def evaluate(fn: Callable, builtin: bool, format_weight: float, item: tuple) -> dict[str, Any]:
    global _sample_deadline
    _, data_source, response, ground_truth, extra_info, truncated = item
    if _sample_timeout_s is not None:
        _sample_deadline = time.monotonic() + _sample_timeout_s
    try:
        if builtin:
            out = fn(data_source, response, ground_truth, extra_info, format_weight=format_weight,
                     truncated=truncated)
        else:
            out = fn(data_source, response, ground_truth, extra_info=extra_info)
        return normalize(out)
    except (Exception, SystemExit) as e:  # a bad sample must never take the worker down
        return {"score": 0.0, "acc": None, "format": None, "pred": "", "extra": {}, "error": describe(e)}


def _exit_when_orphaned(parent_pid: int) -> None:
    """Die with the controller: a worker stuck in a hung function would otherwise outlive it."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(1.0)


def _load(init: dict[str, Any]) -> tuple[Callable, bool]:
    for p in reversed(init["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    if init["function"] == "builtin":
        from hpcrl.rewards import builtin, equality

        if equality.HAVE_MATH_VERIFY:  # import now: the first sample must not pay for it
            import math_verify  # noqa: F401
        return builtin.compute_score, True
    from hpcrl.rewards.loader import resolve_function

    return resolve_function(init["function"]), False


def main() -> None:
    # Only the controller decides when a run stops. Slurm's TERM / USR1 (preemption, time limit,
    # scancel) reach every process of the job; a reward worker dying of them mid-step would score its
    # samples 0 and the resumed run would no longer match an uninterrupted one. The scorer still ends
    # workers with SIGKILL, and a worker exits by itself when the controller is gone.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    msg = read_frame(inp)
    if msg is None or msg[0] != "init":
        return
    init = msg[1]
    global _sample_timeout_s
    _sample_timeout_s = init.get("timeout_s")
    threading.Thread(target=_exit_when_orphaned, args=(init["parent_pid"],), daemon=True).start()
    try:
        fn, builtin = _load(init)
    except BaseException as e:  # reported to the parent, which raises with this text
        write_frame(out, ("init_error", describe(e)))
        return
    write_frame(out, ("ready", os.getpid()))
    format_weight = float(init["format_weight"])
    while (msg := read_frame(inp)) is not None:
        for item in msg[1]:
            write_frame(out, ("result", item[0], evaluate(fn, builtin, format_weight, item)))


if __name__ == "__main__":
    main()
