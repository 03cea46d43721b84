"""Controller program for the failure tests: SIGKILL a worker or the controller, or let a worker
die inside C++ during a collective.

    hpcrl_entry.py tests/programs/ctrl_kill.py OUT.json worker|controller|cxx

`worker`: rank 0 kills MPI rank 2 while a call is in flight on it, records when the
WorkerLostError arrived and what it said, then lets the error escape (so the job must
abort non-zero). `controller`: rank 0 records the pids and kills itself; the workers must
notice and end the job. `cxx`: every worker enters a gloo all_reduce; MPI rank 3 instead
throws a C++ exception that nothing catches (std::terminate, then SIGABRT), so the other
ranks' collective fails with "Connection closed by peer"; rank 0 records the error it got
(which must name rank 3 first) and lets it escape.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from hpcrl.controller import HpcrlRuntimeError, Worker, WorkerGroup, WorkerLostError

CXX_VICTIM = 3  # MPI rank that dies inside C++ in the `cxx` mode
CXX_TEXT = "hpcrl-test: this rank dies inside C++"


def throw_uncaught_cpp_exception(what: str) -> None:
    """Throw a real `std::runtime_error` from C++ with no handler on the stack.

    Why this way: it is the same path as gloo's `terminate called after throwing an instance
    of 'gloo::EnforceNotMet'` (libstdc++'s terminate handler writes that text to fd 2, then
    calls abort()), without building a C++ extension. The unwinder finds no catch in the
    Python/ctypes frames above, so `__cxa_throw` calls std::terminate.
    """
    cxx = ctypes.CDLL("libstdc++.so.6")
    alloc = cxx.__cxa_allocate_exception
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    exc = alloc(64)  # >= sizeof(std::runtime_error)
    ctor = cxx._ZNSt13runtime_errorC1EPKc  # std::runtime_error::runtime_error(const char*)
    ctor.restype, ctor.argtypes = None, [ctypes.c_void_p, ctypes.c_char_p]
    ctor(exc, what.encode())
    type_info = ctypes.addressof(ctypes.c_char.in_dll(cxx, "_ZTISt13runtime_error"))
    dtor = ctypes.cast(cxx._ZNSt13runtime_errorD1Ev, ctypes.c_void_p).value
    throw = cxx.__cxa_throw
    throw.restype, throw.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    throw(exc, type_info, dtor)


class Sleeper(Worker):
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)

    def reduce_then_die(self, victim: int, delay_s: float) -> None:
        dist.all_reduce(torch.ones(4))  # every gloo pair has carried data
        if self.process_info()["mpi_rank"] == victim:
            time.sleep(delay_s)  # by now the other ranks wait inside the next all_reduce
            throw_uncaught_cpp_exception(CXX_TEXT)
        dist.all_reduce(torch.ones(1 << 16))


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
    if mode == "cxx":
        _write(path, out)
        out["started_at"] = time.time()
        try:
            g.reduce_then_die(CXX_VICTIM, 0.5)
        except HpcrlRuntimeError as e:
            out["error_at"] = time.time()
            out["error"] = str(e)
            out["error_type"] = type(e).__name__
            out["error_rank"] = getattr(e, "rank", None)
            out["failures"] = [{"rank": f.rank, "kind": f.kind, "consequence": f.consequence}
                               for f in getattr(e, "failures", [])]
            _write(path, out)
            raise
        return
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
