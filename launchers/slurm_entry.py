"""Batch-side entry of an hpcrl Slurm job: one MPI world over both het groups, signals forwarded.

    exec python launchers/slurm_entry.py CONFIG [KEY=VALUE ...]                  # the trainer
    exec python launchers/slurm_entry.py --target prog.py[:func] CONFIG [KEY=VALUE ...]
    exec python launchers/slurm_entry.py --target prog.py --no-config [ARGS ...]  # arguments as they are

Run it from an sbatch script of a two-component hetjob (group 0: 1 task, the controller; group 1: the
workers), with `exec`, so that `#SBATCH --signal=B:USR1@N` reaches this process. It starts
`srun --mpi=pmi2 --het-group=0,1 python launchers/hpcrl_entry.py TARGET ARGS...` and forwards USR1/TERM
to it; with a CONFIG it first matches `trainer.nnodes` / `trainer.workers_per_node` to the allocation,
pins `trainer.run_dir` to an absolute path, validates (exit 2 naming the key), exports HPCRL_RUN_DIR and
records the job for `hpcrl status`. See hpcrl/launch/allocation.py and docs/slurm.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None,
                        help="controller program prog.py[:func] or package.module[:func] "
                             "(default: the trainer, hpcrl.trainer.main:main)")
    parser.add_argument("--no-config", action="store_true",
                        help="pass ARGS to the program untouched instead of reading them as CONFIG [KEY=VALUE ...]")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="CONFIG [KEY=VALUE ...], or the program's ARGS")
    ns = parser.parse_args(argv)
    if importlib.util.find_spec("hpcrl") is None:
        sys.path.insert(0, _REPO)

    from hpcrl.config import ConfigError
    from hpcrl.launch.allocation import TRAINER_TARGET, AllocationError, launch

    target = ns.target or TRAINER_TARGET
    if target.split(":")[0].endswith(".py"):  # a file: make it absolute, srun's tasks start elsewhere
        path, sep, func = target.partition(":")
        target = os.path.abspath(path) + sep + func
    try:
        return launch(target, ns.args, config_args=not ns.no_config)
    except ConfigError as e:
        print(f"[hpcrl slurm] invalid config ({len(e.problems)} problem(s)):", file=sys.stderr)
        for problem in e.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    except AllocationError as e:
        print(f"[hpcrl slurm] {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
