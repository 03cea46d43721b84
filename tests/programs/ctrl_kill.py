"""Controller program for the failure tests: SIGKILL a worker, or the controller itself.

    hpcrl_entry.py tests/programs/ctrl_kill.py OUT.json worker|controller

`worker`: rank 0 kills MPI rank 2 while a call is in flight on it, records when the
WorkerLostError arrived and what it said, then lets the error escape (so the job must
abort non-zero). `controller`: rank 0 records the pids and kills itself; the workers must
notice and end the job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from hpcrl.controller import Worker, WorkerGroup, WorkerLostError


class Sleeper(Worker):
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    g = WorkerGroup(Sleeper)
    info = g.process_info()
    out = {"controller_pid": os.getpid(), "workers": info, "host": info[0]["host"]}
    if mode == "controller":
        g.nap.future(60.0)
        out["killed_at"] = time.time()
        _write(path, out)
        os.kill(os.getpid(), signal.SIGKILL)
    victim = next(w for w in info if w["mpi_rank"] == 2)
    fut = g.nap.future(120.0)
    time.sleep(0.5)
    out["killed_at"] = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    _write(path, out)
    try:
        fut.result()
    except WorkerLostError as e:
        out["error_at"] = time.time()
        out["error"] = str(e)
        out["error_rank"] = e.rank
        _write(path, out)
        raise
