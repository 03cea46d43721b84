"""Entry program that `mpiexec` or `srun` starts on every rank of an hpcrl job.

    mpiexec -disable-auto-cleanup -n 5 python launchers/hpcrl_entry.py prog.py[:main] [args...]
    srun --mpi=pmi2 --het-group=0,1 python launchers/hpcrl_entry.py pkg.module[:main] [args...]

Every rank imports the target (so worker classes defined there resolve by name on the
workers), then rank 0 runs the target's function (default `main`, no arguments; it sees
`sys.argv = [target, *args]`) as the controller and the other ranks serve worker groups. A
non-zero int that the function returns becomes rank 0's exit status, after the clean shutdown.
Why a separate entry: the launcher does not know the algorithm and the algorithm does not
know how it was launched; a program may equally call `hpcrl.controller.run(main)` itself.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heartbeat-timeout", type=float, help="seconds before a silent rank is declared lost")
    parser.add_argument("--heartbeat-interval", type=float, help="seconds between heartbeats")
    parser.add_argument("--no-torch-dist", action="store_true", help="do not build torch.distributed")
    parser.add_argument("target", help="prog.py[:func] or package.module[:func]")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if importlib.util.find_spec("hpcrl") is None:
        sys.path.insert(0, _REPO)

    # before MPI starts: segments that killed jobs left in /dev/shm (see hpcrl/launch/shm.py)
    from hpcrl.launch.shm import remove_stale_segments

    removed = remove_stale_segments()
    if removed:
        print(f"[hpcrl entry] removed {len(removed)} shared-memory segment(s) that killed jobs left in "
              f"{removed[0].parent} ({', '.join(p.name for p in removed[:3])}{', ...' if len(removed) > 3 else ''})",
              file=sys.stderr, flush=True)

    from hpcrl.controller.app import RuntimeOptions, run

    opts = RuntimeOptions.from_env()
    if ns.heartbeat_timeout is not None:
        opts.heartbeat_timeout_s = ns.heartbeat_timeout
    if ns.heartbeat_interval is not None:
        opts.heartbeat_interval_s = ns.heartbeat_interval
    if ns.no_torch_dist:
        opts.torch_dist = False
    sys.argv = [ns.target, *ns.args]
    try:
        fn = _load(ns.target)
    except BaseException:
        from hpcrl.launch.world import abort

        traceback.print_exc()
        print(f"[hpcrl entry] cannot load {ns.target!r}; aborting the job", file=sys.stderr, flush=True)
        abort(1)
    result = run(fn, opts)
    # rank 0, after the clean shutdown: the program's exit status (e.g. 3 when the trainer stopped
    # on non-finite steps), so that mpiexec / srun and Slurm see the run as failed
    if isinstance(result, int) and not isinstance(result, bool) and result != 0:
        sys.exit(result)


if __name__ == "__main__":
    main()
