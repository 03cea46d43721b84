"""Entry program that `mpiexec` or `srun` starts on every rank of an hpcrl job.

    mpiexec -disable-auto-cleanup -n 5 python launchers/hpcrl_entry.py prog.py[:main] [args...]
    srun --mpi=pmi2 --het-group=0,1 python launchers/hpcrl_entry.py pkg.module[:main] [args...]

Every rank imports the target (so worker classes defined there resolve by name on the
workers), then rank 0 runs the target's function (default `main`, no arguments; it sees
`sys.argv = [target, *args]`) as the controller and the other ranks serve worker groups. A
non-zero int that the function returns becomes rank 0's exit status, after the clean shutdown.
Why a separate entry: the launcher does not know the algorithm and the algorithm does not
know how it was launched; a program may equally call `hpcrl.controller.run(main)` itself.

Every rank's output (stdout and stderr) is also kept in a file (so that the controller can quote
a rank that died inside C++, and a quiet terminal loses nothing; see hpcrl/controller/stderr_log.py):
`$HPCRL_LOG_DIR/rank{R}.{host}.log` if set, else `$HPCRL_RUN_DIR/logs/rank{R}.{host}.log` (`hpcrl run`
and the Slurm launcher set both from the config), else `{tmp}/hpcrl-{uid}/stderr/rank{R}.{host}.{pid}.log`,
removed when the rank ends cleanly (and after 3 days otherwise). `--no-stderr-capture` or
HPCRL_STDERR_CAPTURE=0 turns it off. HPCRL_TERMINAL=quiet (what `hpcrl run` and the Slurm launcher set
unless logging.verbose) keeps the libraries' output off the terminal: it shows hpcrl's lines and errors
(hpcrl/controller/console.py); unset or `verbose`, the terminal shows everything, as without the capture.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import importlib.util
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM_MODULE = "__hpcrl_program__"


def _load(target: str) -> Callable[[], Any]:
    """Import `path.py[:func]` (under a fixed module name, never via sys.path) or `pkg.mod[:func]`."""
    spec, _, func = target.partition(":")
    func = func or "main"
    if spec.endswith(".py"):
        path = os.path.abspath(spec)
        module_spec = importlib.util.spec_from_file_location(PROGRAM_MODULE, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[PROGRAM_MODULE] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(spec)
    return getattr(module, func)


def _launcher_rank() -> str | None:
    """This rank's number from the launcher's variables: MPI has not started yet (the capture must be
    in place before it, and before any thread); the controller learns each rank's real path at start."""
    return next((os.environ[v] for v in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
                 if os.environ.get(v)), None)


def _log_path(rank: str | None) -> tuple[str, bool]:
    """Where this rank's output is also kept, and whether that file is temporary."""
    host = socket.gethostname()
    base = os.environ.get("HPCRL_LOG_DIR") or (
        os.path.join(os.environ["HPCRL_RUN_DIR"], "logs") if os.environ.get("HPCRL_RUN_DIR") else "")
    if base:  # kept with the run; a Slurm restart appends to the same file
        name = f"rank{rank}.{host}.log" if rank is not None else f"pid{os.getpid()}.{host}.log"
        return os.path.join(base, name), False
    base = os.path.join(tempfile.gettempdir(), f"hpcrl-{os.getuid()}", "stderr")
    _prune(base, 3 * 86400)
    return os.path.join(base, f"rank{rank}.{host}.{os.getpid()}.log"), True


def _prune(folder: str, max_age_s: float) -> None:
    """Remove temporary output files of killed jobs (a clean rank removes its own)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        try:
            if name.endswith((".log", ".stderr")) and time.time() - os.stat(path).st_mtime > max_age_s:
                os.unlink(path)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heartbeat-timeout", type=float, help="seconds before a silent rank is declared lost")
    parser.add_argument("--heartbeat-interval", type=float, help="seconds between heartbeats")
    parser.add_argument("--no-torch-dist", action="store_true", help="do not build torch.distributed")
    parser.add_argument("--no-stderr-capture", action="store_true",
                        help="do not keep this rank's output in a file (the controller then cannot quote a dead rank)")
    parser.add_argument("target", help="prog.py[:func] or package.module[:func]")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if importlib.util.find_spec("hpcrl") is None:
        sys.path.insert(0, _REPO)

    # first, before MPI and threads start: the capture forks (see hpcrl/controller/stderr_log.py)
    rank = _launcher_rank()
    label = f"rank {rank} {socket.gethostname()}" if rank is not None else f"pid {os.getpid()}"
    stderr_file, temporary = "", False
    if not ns.no_stderr_capture and os.environ.get("HPCRL_STDERR_CAPTURE", "1") != "0":
        from hpcrl.controller.stderr_log import start_capture

        stderr_file, temporary = _log_path(rank)
        if not start_capture(stderr_file, quiet=os.environ.get("HPCRL_TERMINAL") == "quiet", label=label):
            stderr_file = ""
    from hpcrl.controller.console import setup_worker_logging  # the controller program may set its own

    setup_worker_logging(label)
    # a segfault or abort in C/C++ then leaves the Python stacks of every thread in that file
    faulthandler.enable(all_threads=True)

    # before MPI starts: segments that killed jobs left in /dev/shm (see hpcrl/launch/shm.py; under
    # Slurm the launcher removes them on every node before this step, never the ranks themselves)
    if "SLURM_STEP_ID" not in os.environ:
        from hpcrl.launch.shm import describe_removed, remove_stale_segments

        removed = remove_stale_segments()
        if removed:
            print(f"[hpcrl entry] {describe_removed(removed)}", file=sys.stderr, flush=True)

    # MPI's start-up can hang for good: on the local cluster, slurmstepd's pmi2 plugin got garbled
    # requests (hpcrl/launch/commands.py, SLURM_PMI2_ENV), 3 ranks aborted and 2 spun in MPI_Init for
    # 15 minutes while srun waited.
    # The kernel ends a rank with SIGALRM if the world is not up within the bound (the runtime
    # cancels it then), so the step fails and a Slurm job can requeue itself instead of idling.
    init_bound = int(float(os.environ.get("HPCRL_MPI_INIT_TIMEOUT", "300")))
    if init_bound > 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(init_bound)
    from hpcrl.controller.app import RuntimeOptions, run

    opts = RuntimeOptions.from_env()
    if ns.heartbeat_timeout is not None:
        opts.heartbeat_timeout_s = ns.heartbeat_timeout
    if ns.heartbeat_interval is not None:
        opts.heartbeat_interval_s = ns.heartbeat_interval
    if ns.no_torch_dist:
        opts.torch_dist = False
    opts.stderr_file = stderr_file
    sys.argv = [ns.target, *ns.args]
    try:
        fn = _load(ns.target)
    except BaseException:
        from hpcrl.controller.stderr_log import terminal
        from hpcrl.launch.world import abort

        traceback.print_exc(file=terminal(err=True))
        print(f"[hpcrl entry] {label}: cannot load {ns.target!r}; aborting the job", file=terminal(err=True),
              flush=True)
        abort(1)
    result = run(fn, opts)
    if temporary:  # a clean end: nothing to investigate (the copy to the terminal goes on until exit)
        try:
            os.unlink(stderr_file)
        except OSError:
            pass
    # rank 0, after the clean shutdown: the program's exit status (e.g. 3 when the trainer stopped
    # on non-finite steps), so that mpiexec / srun and Slurm see the run as failed
    _leave(result if isinstance(result, int) and not isinstance(result, bool) else 0)


def _leave(code: int) -> NoReturn:
    """End a rank after its clean shutdown without the garbage collector's passes over every object.

    Why: with torch, megatron-core and vLLM loaded, tearing the interpreter down took each rank
    ~4 s, nearly all of it in the collections the interpreter runs while it clears the modules
    (perf on a tiny-model worker: gc_collect_main and its visitors, 70% of the samples). Under
    mpiexec the ranks leave one after another (hpcrl.launch.exit_order), so the 5 ranks of a tiny
    run left over 11.6-13.6 s; frozen, over 2.3-2.6 s. `gc.freeze()` moves every object out of
    the collector's reach: the teardown then frees what reference counting frees and leaves cycles
    to the kernel, while everything else a normal exit does still happens in order (non-daemon
    threads joined, exit handlers, the C libraries' exit handlers and destructors: MPICH's and
    vLLM's shared memory is unlinked there; `os._exit` skipped those and left the segments in
    /dev/shm).
    """
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    main()
