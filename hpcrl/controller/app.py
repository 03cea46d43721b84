"""`run(main)`: the program every rank executes; rank 0 runs `main`, the other ranks serve.

Why one entry for all ranks: it is what `mpiexec`/`srun` can start, and it gives one place
to own the failure rules: an exception that escapes the controller program ends the whole
job through MPI_Abort (non-zero exit, no rank left waiting), a lost worker is named by the
controller, a lost controller makes the workers abort, and a normal return shuts every
worker down cleanly before MPI_Finalize.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcrl.controller.codec import Encoded
from hpcrl.controller.liveness import Liveness
from hpcrl.controller.runtime import ControllerRuntime, set_runtime
from hpcrl.controller.serve import serve_forever
from hpcrl.controller.stderr_log import terminal
from hpcrl.controller.transport import Backoff, tighten_timer_slack
from hpcrl.launch.exit_order import ExitTurn, hydra_announces_exits, plan_exit
from hpcrl.launch.world import CONTROLLER_RANK, World, abort, init_world


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass
class RuntimeOptions:
    """Knobs of the runtime; each can also be set by an environment variable (HPCRL_...).

    heartbeat_timeout_s bounds how long a dead rank can go unnoticed (default 30 s: well
    under a minute, yet far above any scheduling hiccup on a loaded node).
    failure_grace_s: after the first failure of a call, how long the controller keeps collecting
    the other ranks' failures before it raises, so that it names the rank that failed first and
    not merely the first reply (see `ControllerRuntime.failure_error`).
    stderr_file: where this rank's stderr is also kept (set by launchers/hpcrl_entry.py, see
    `hpcrl.controller.stderr_log`); "" when it is not.
    """

    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    abort_grace_s: float = 5.0  # after a loss, how long user code may handle it before the job is aborted
    failure_grace_s: float = 1.0
    stderr_file: str = ""
    torch_dist: bool = True  # build torch.distributed among the workers at start
    torch_backend: str | None = None  # None: nccl with CUDA, else gloo
    torch_dist_timeout_s: float = 300.0

    @classmethod
    def from_env(cls) -> RuntimeOptions:
        return cls(
            heartbeat_interval_s=_env_float("HPCRL_HEARTBEAT_INTERVAL", 1.0),
            heartbeat_timeout_s=_env_float("HPCRL_HEARTBEAT_TIMEOUT", 30.0),
            abort_grace_s=_env_float("HPCRL_ABORT_GRACE", 5.0),
            failure_grace_s=_env_float("HPCRL_FAILURE_GRACE", 1.0),
            torch_dist=os.environ.get("HPCRL_TORCH_DIST", "1") != "0",
            torch_backend=os.environ.get("HPCRL_TORCH_BACKEND") or None,
            torch_dist_timeout_s=_env_float("HPCRL_TORCH_DIST_TIMEOUT", 300.0),
        )


def _die(world: World, what: str, code: int) -> None:
    # the terminal stream: a quiet terminal shows hpcrl's errors (and the rank's file gets them too)
    print(f"[hpcrl] {what} on {world.describe(world.rank)}; aborting the job:\n{traceback.format_exc()}",
          file=terminal(err=True), flush=True)
    abort(code)
    os._exit(code)


def _install_hooks(world: World) -> None:
    """Exceptions outside `main` (e.g. in a user thread) also end the job instead of hanging it."""

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        traceback.print_exception(exc_type, exc, tb, file=terminal(err=True))
        print(f"[hpcrl] uncaught {exc_type.__name__} on {world.describe(world.rank)}; aborting the job",
              file=terminal(err=True), flush=True)
        abort(1)

    sys.excepthook = hook
    threading.excepthook = lambda args: hook(args.exc_type, args.exc_value, args.exc_traceback)


def _survive_failure_notices() -> None:
    """Keep this rank alive, and its system calls uninterrupted, when the launcher announces that
    another rank died.

    Why: with `-disable-auto-cleanup`, hydra sends SIGUSR1 to every surviving rank when one
    dies (so an MPI library with fault tolerance can look up the dead rank). Python's default
    action for SIGUSR1 terminates the process, and a Python-level handler would interrupt
    MPI's blocking system calls (EINTR), which MPICH may turn into an abort of the whole job.
    Either way the controller could not name the dead rank. Ignoring the signal leaves the
    decision to the heartbeats. A handler installed by the program before `run` is kept.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _finish(world: World, liveness: Liveness, timeout_s: float) -> None:
    """All ranks meet once more before MPI_Finalize (bounded: a rank lost now must not hang us), then
    leave in the order hydra needs (see `hpcrl.launch.exit_order`).

    The meeting also exchanges each rank's parent pid (its hydra proxy, if any) and whether hydra
    announces exits, so every rank reaches the same decision about the exit order, and how many
    heartbeats each rank sent to each other, so that none is left unreceived at MPI_Finalize.
    """
    liveness.stop()
    announced = hydra_announces_exits()
    turn = ExitTurn(0, None, max(timeout_s, 10.0), world.describe(world.rank))
    if announced:
        turn.arm()  # before the meeting: no rank can exit before every rank has passed it
    mine = np.array([os.getppid(), int(announced)], dtype=np.int64)
    everyone = np.zeros((world.size, 2), dtype=np.int64)
    sent_to_me = np.zeros(world.size, dtype=np.int64)
    reqs = [world.comm.Iallgather(mine, everyone), world.comm.Ialltoall(liveness.sent, sent_to_me)]
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(max_sleep_s=0.01)
    while not MPI.Request.Testall(reqs):
        if time.monotonic() > deadline:
            print(f"[hpcrl] {world.describe(world.rank)}: peers did not reach the final barrier in "
                  f"{timeout_s:g} s; aborting", file=terminal(err=True), flush=True)
            abort(3)
        backoff.pause()
    if not liveness.drain(sent_to_me, time.monotonic() + timeout_s):
        print(f"[hpcrl] {world.describe(world.rank)}: some heartbeats still in flight at shutdown",
              file=terminal(err=True), flush=True)
    plan = plan_exit(world.rank, [p.host for p in world.processes], everyone[:, 0].tolist(),
                     [bool(a) for a in everyone[:, 1]], CONTROLLER_RANK)
    if plan is None:
        turn.disarm()
    else:
        turn.position, turn.predecessor_proxy = plan
    for comm in (world.control, world.beats):
        comm.Free()
    if world.workers is not None:
        world.workers.Free()
    # hydra (-disable-auto-cleanup) treats every rank that finalizes and exits as "terminated" and
    # SIGUSR1s the others; a rank already tearing down its interpreter must not die of that (an armed
    # exit turn counts these notices and restores this afterwards).
    _survive_failure_notices()
    MPI.Finalize()
    turn.wait()


def _worker_lost_controller(world: World, timeout_s: float) -> Callable[[int, float], None]:
    def on_lost(rank: int, silent_s: float) -> None:
        print(f"[hpcrl worker {world.describe(world.rank)}] controller {world.describe(rank)} silent for "
              f"{silent_s:.1f} s (bound {timeout_s:g} s): aborting", file=terminal(err=True), flush=True)
        abort(4)
        os._exit(4)

    return on_lost


def run(main: Callable[[], Any], options: RuntimeOptions | None = None) -> Any:
    """Start the runtime on every rank of the MPI world; returns `main()`'s value on rank 0, None elsewhere."""
    opts = options or RuntimeOptions.from_env()
    world = init_world()
    signal.alarm(0)  # the world is up: cancel launchers/hpcrl_entry.py's bound on MPI's start-up
    tighten_timer_slack()
    _install_hooks(world)
    _survive_failure_notices()
    # the controller quotes a dead rank's stderr file, so it must know every rank's path
    stderr_files = world.comm.allgather(opts.stderr_file)
    if world.is_controller:
        return _run_controller(world, main, opts, stderr_files)
    _run_worker(world, opts)
    return None


def _run_worker(world: World, opts: RuntimeOptions) -> None:
    liveness = Liveness(world, opts.heartbeat_interval_s, opts.heartbeat_timeout_s,
                        _worker_lost_controller(world, opts.heartbeat_timeout_s))
    liveness.start()
    if opts.torch_dist:
        try:
            from hpcrl.launch.rendezvous import init_torch_distributed

            init_torch_distributed(world, opts.torch_backend, opts.torch_dist_timeout_s)
        except BaseException:
            _die(world, "torch.distributed initialisation failed", 1)
    serve_forever(world, liveness)
    _finish(world, liveness, opts.heartbeat_timeout_s)


def _run_controller(world: World, main: Callable[[], Any], opts: RuntimeOptions, stderr_files: list[str]) -> Any:
    rt = ControllerRuntime(world, opts.heartbeat_interval_s, opts.heartbeat_timeout_s, opts.abort_grace_s,
                           opts.failure_grace_s, stderr_files)
    rt.liveness.start()
    set_runtime(rt)
    try:
        result = main()
    except SystemExit as e:
        if e.code not in (None, 0):
            _die(world, f"controller program exited with {e.code}", e.code if isinstance(e.code, int) else 1)
        result = None
    except BaseException:
        _die(world, "controller program failed", 1)
    try:
        shutdown(rt)
    except BaseException:
        _die(world, "shutdown failed", 1)
    set_runtime(None)
    _finish(world, rt.liveness, opts.heartbeat_timeout_s)
    return result


def shutdown(rt: ControllerRuntime) -> None:
    """Finish calls in flight, let each worker close its objects, and wait for every acknowledgement."""
    rt.drain()
    empty = Encoded(None)
    messages = {r: ({"k": "shutdown"}, empty) for r in range(1, rt.world.size)}
    fut = rt.submit("shutdown", messages, lambda results: None)
    rt.closed = True
    fut.result()
    for r in range(1, rt.world.size):
        rt.liveness.retire(r)
