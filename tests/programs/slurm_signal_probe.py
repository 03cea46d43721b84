"""Controller program for tests/test_submit.py: which signals reach the controller of a Slurm hetjob?

    hpcrl submit --target tests/programs/slurm_signal_probe.py CONFIG [KEY=VALUE ...]

Like the trainer: every rank ignores USR1 and TERM at import; the controller then handles both. It writes
one JSON line per event to $HPCRL_RUN_DIR/probe.jsonl (so it also checks that the launcher exports it):
"ready" once the worker group answers, then the name of every signal it gets. It returns after TERM
(`hpcrl cancel`), or after 5 minutes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from types import FrameType

from hpcrl.controller import Worker, WorkerGroup

signal.signal(signal.SIGUSR1, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Echo(Worker):
    def where(self) -> dict:
        return {"pid": os.getpid(), "node": os.environ.get("SLURMD_NODENAME", ""),
                "netmod": os.environ.get("MPIR_CVAR_CH4_NETMOD", "")}


def main() -> None:
    out = os.path.join(os.environ["HPCRL_RUN_DIR"], "probe.jsonl")
    got: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        got.append(signal.Signals(signum).name)

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, on_signal)
        signal.siginterrupt(sig, False)

    def record(event: dict) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(event) + "\n")

    workers = WorkerGroup(Echo).where()
    record({"event": "ready", "argv": sys.argv[1:], "workers": workers,
            "restart": os.environ.get("SLURM_RESTART_COUNT", "0")})
    seen = 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        while seen < len(got):
            record({"event": got[seen]})
            seen += 1
            if got[seen - 1] == "SIGTERM":
                return
        time.sleep(0.2)
