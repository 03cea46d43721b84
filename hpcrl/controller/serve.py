"""The loop every worker rank runs: receive a call, run it on the named role object, reply.

Why one loop per process hosting named objects: colocated roles (a Megatron actor and a
vLLM engine on the same ranks) share the process, the device and the torch.distributed
world; the controller addresses each by its group name. Calls run strictly in arrival
order, so all ranks of a group execute the same sequence of SPMD methods.
A method's exception goes back to the controller with its traceback and the worker keeps
serving; anything else that goes wrong here aborts the job.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import time
import traceback
from typing import Any

from mpi4py import MPI

from hpcrl.controller.codec import Encoded, decode, encode
from hpcrl.controller.errors import RemoteFailure
from hpcrl.controller.liveness import Liveness
from hpcrl.controller.startup_gc import collector_paused
from hpcrl.controller.transport import (
    TAG_CALL,
    TAG_CALL_DATA,
    TAG_REPLY,
    TAG_REPLY_DATA,
    Backoff,
    dumps,
    post_receives,
    probe_header,
    send_message,
    wait_all,
)
from hpcrl.controller.worker import Placement, creating
from hpcrl.launch.faults import FaultInjector
from hpcrl.launch.world import CONTROLLER_RANK, World, abort


def resolve_class(module: str, qualname: str) -> type:
    """Find a worker class by reference (the controller sends names, never pickled code)."""
    obj: Any = sys.modules.get(module) or importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class WorkerServer:
    """State of one worker process: its role objects and replies still being sent."""

    def __init__(self, world: World, liveness: Liveness) -> None:
        self.world = world
        self.comm = world.control
        self.liveness = liveness
        self.objects: dict[str, Any] = {}
        self._sending: list[tuple[list[MPI.Request], Encoded]] = []  # replies in flight, payload kept alive
        self.faults = FaultInjector(world.rank)  # HPCRL_FAULT, for the fault tests (hpcrl/launch/faults.py)

    def _reap_sends(self) -> None:
        self._sending = [s for s in self._sending if not MPI.Request.Testall(s[0])]

    def _failure(self, header: dict, exc: BaseException) -> RemoteFailure:
        me = self.world.info(self.world.rank)
        obj = self.objects.get(header.get("obj", ""))
        return RemoteFailure(
            rank=me.rank,
            host=me.host,
            node=me.node,
            pid=me.pid,
            group=header.get("obj", "?"),
            group_rank=getattr(obj, "group_rank", header.get("group_rank", -1)),
            method=header.get("m") or "__init__",
            exc_type=type(exc).__name__,
            exc_message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            at=time.time(),
        )

    def _execute(self, header: dict, args: tuple, kwargs: dict) -> Any:
        kind = header["k"]
        if kind == "create":
            cls = resolve_class(*header["cls"])
            placement = Placement(
                group=header["obj"],
                group_rank=header["group_rank"],
                group_size=header["group_size"],
                mpi_rank=self.world.rank,
                worker_rank=self.world.worker_rank,
                local_rank=self.world.local_rank,
                host=self.world.info(self.world.rank).host,
                coords=tuple(header["coords"]) if header.get("coords") else None,
            )
            with creating(placement), collector_paused():  # imports megatron-core / vLLM, loads models
                self.objects[header["obj"]] = cls(*args, **kwargs)
            return None
        if kind == "call":
            self.faults.maybe_kill_self(header["m"])
            return getattr(self.objects[header["obj"]], header["m"])(*args, **kwargs)
        if kind == "drop":
            self.objects.pop(header["obj"]).close()
            gc.collect()  # a model's modules refer to each other: free them (and their process groups) now
            if not self.objects:
                # No role left on this rank: what is alive is the process's own (imported modules, the
                # runtime). Set aside (gc.freeze), the next drop's collection walks only what was built
                # after it: a full one walks the ~480,000 objects of torch, megatron-core and vLLM, 0.25 s
                # on these CPUs, at each of the Megatron test world's ~60 drops on each rank.
                gc.freeze()
            return None
        raise ValueError(f"unknown message kind {kind!r}")

    def _reply(self, call_id: int, result: Any, failure: RemoteFailure | None) -> None:
        if failure is None:
            enc = encode(result)
            header = {"id": call_id, "ok": True, "skel": enc.skeleton, "specs": enc.specs}
        else:
            enc = Encoded(None)
            header = {"id": call_id, "ok": False, "failure": failure}
        try:
            blob = dumps(header)
        except Exception as e:  # an unpicklable result is the method's error, not the runtime's
            enc = Encoded(None)
            blob = dumps({"id": call_id, "ok": False, "failure": self._failure({"m": "<reply>"}, e)})
        reqs = send_message(self.comm, CONTROLLER_RANK, TAG_REPLY, TAG_REPLY_DATA, blob, enc)
        self._sending.append((reqs, enc))

    def _shutdown(self, call_id: int) -> None:
        from hpcrl.launch.rendezvous import destroy_torch_distributed

        failure = None
        for name in reversed(list(self.objects)):
            try:
                self.objects.pop(name).close()
            except Exception as e:
                failure = failure or self._failure({"obj": name, "m": "close"}, e)
        destroy_torch_distributed()
        self._reply(call_id, None, failure)
        for reqs, _ in self._sending:
            wait_all(reqs, lambda: None, time.monotonic() + self.liveness.timeout_s, "shutdown reply")
        self._sending.clear()

    def serve(self) -> None:
        """Run calls until the controller says shutdown (controller loss is handled by liveness)."""
        backoff = Backoff()
        while True:
            header = probe_header(self.comm, CONTROLLER_RANK, TAG_CALL)
            if header is None:
                if self._sending:
                    self._reap_sends()
                backoff.pause()
                continue
            backoff.reset()
            if header["k"] == "shutdown":
                self._shutdown(header["id"])
                return
            objs, reqs = post_receives(self.comm, CONTROLLER_RANK, TAG_CALL_DATA, header["specs"])
            wait_all(reqs, lambda: None, None, "argument transfer")
            args, kwargs = decode(header["skel"], objs)
            failure = None
            result = None
            try:
                result = self._execute(header, args, kwargs)
            except Exception as e:
                failure = self._failure(header, e)
            del args, kwargs, objs
            self._reply(header["id"], result if header.get("want", True) else None, failure)
            del result
            if self._sending:
                self._reap_sends()


def serve_forever(world: World, liveness: Liveness) -> None:
    """Worker entry: serve until shutdown; any runtime failure ends the whole job."""
    try:
        WorkerServer(world, liveness).serve()
    except BaseException:
        print(
            f"[hpcrl worker {world.describe(world.rank)}] runtime failure, aborting the job:\n"
            f"{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        abort(1)
        os._exit(1)
