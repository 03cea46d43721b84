"""Command lines that start one hpcrl MPI world (the launch routes verified in docs/controller.md).

Why here: the flags matter for failure semantics and are easy to forget: the controller
must survive a worker's death long enough to name it and abort the job itself. Under Slurm,
`--mpi=pmi2` is the PMI that Debian's Slurm and pip's MPICH share, and `--het-group=0,1`
joins the controller component and the worker component into one MPI world; `srun_env` holds the
MPICH setting that this PMI needs (why: its docstring).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "launchers", "hpcrl_entry.py")


def find_mpiexec() -> str:
    """The mpiexec that belongs to this interpreter's MPI (pip's MPICH puts it beside python)."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(beside):
        return beside
    found = shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("no mpiexec beside the interpreter or on PATH")
    return found


def mpiexec_command(num_workers: int, argv: Sequence[str], mpiexec: str | None = None) -> list[str]:
    """One machine: every rank under its own hydra proxy (rank 0 = controller).

    Why the odd flags (measured with pip's MPICH 5.0.2, see docs/controller.md): a hydra
    proxy SIGKILLs all of its processes as soon as one of them dies from a signal, whatever
    `-disable-auto-cleanup` says. With one proxy per rank (`-launcher fork` plus one made-up
    host name per rank) a killed worker takes only itself down, the others merely get
    SIGUSR1 (ignored by the runtime), and the controller names the dead rank itself.
    MPI then sees each rank as its own node; the runtime derives local ranks from host
    names, so that does not matter.
    """
    hosts = ",".join(["hpcrl-controller:1", *(f"hpcrl-worker{i}:1" for i in range(1, num_workers + 1))])
    return [mpiexec or find_mpiexec(), "-launcher", "fork", "-disable-auto-cleanup", "-hosts", hosts,
            "-n", str(num_workers + 1), *argv]


def srun_het_command(argv: Sequence[str], extra: Sequence[str] = (), groups: int = 2) -> list[str]:
    """Inside a hetjob: one world, component 0 = controller, component 1 = workers (with 3 groups:
    component 1 = the trainer's workers, component 2 = the rollout workers, whose ranks come last)."""
    return ["srun", "--mpi=pmi2", f"--het-group={','.join(map(str, range(groups)))}", *extra, *argv]


# What MPICH needs under `srun --mpi=pmi2` (measured with pip's MPICH 5.0.2 and Debian's Slurm, PMI_DEBUG=1):
# at MPI_Init the UCX netmod puts ~4.6 KB per node into the PMI key-value space, its worker address
# followed by whatever heap memory lies behind it, hex-encoded in lines of up to ~1080 bytes. Slurm's
# pmi2 plugin reads a PMI-1 request into a fixed buffer (lines of up to 1006 bytes passed, longer ones
# were cut), so a line with few zero bytes in it is cut in two: slurmstepd logs `value not properly
# terminated in client request`, the peers unpack a corrupt address (UCX `invalid bandwidth 0.00`)
# and MPI_Init aborts on some ranks and hangs on the others. How dirty the heap is depends on what a
# rank did before MPI_Init, so it came and went with code changes (10 of 10 trainer starts under
# Slurm failed in one CI run, none in the run before; a rank that fills its heap with non-zero bytes
# first fails every time: tests/programs/dirty_heap_world.py). The OFI netmod's address is 16 bytes.
# Its cost (tools/bench_controller.py's hpcrl side in a 1 + 2x2 hetjob here, 2 rounds each): a call
# on 4 workers 0.89-0.95 vs 0.57-0.58 ms, a 64 MB scatter 1.0 vs 1.6-1.7 GB/s, a round trip 0.35 vs
# 0.61 GB/s. MPI carries the controller's calls and batches (token ids, log-probs, rewards); weights
# and gradients travel over torch.distributed. A value the user set wins, and with `slurm.mpi=pmix`
# (an MPI built for PMIx) the launcher sets nothing.
SLURM_PMI2_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi"}


def srun_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` plus SLURM_PMI2_ENV's settings that it does not already have, for `srun_het_command`."""
    return {**SLURM_PMI2_ENV, **env}


def entry_argv(target: str, program_args: Sequence[str] = (), python: str | None = None) -> list[str]:
    """`python launchers/hpcrl_entry.py TARGET ARGS...` for the commands above."""
    return [python or sys.executable, ENTRY, target, *program_args]


def rank_output_env(cfg: Any) -> dict[str, str]:
    """The variables through which launchers/hpcrl_entry.py learns where each rank's output file goes
    ({logging.dir}/rank{R}.{host}.log) and what the terminal shows (quiet unless logging.verbose),
    plus HPCRL_RUN_DIR, for `hpcrl run` and the Slurm launcher."""
    return {"HPCRL_RUN_DIR": os.path.abspath(str(cfg.trainer.run_dir)),
            "HPCRL_LOG_DIR": os.path.abspath(str(cfg.logging.dir)),
            "HPCRL_TERMINAL": "verbose" if cfg.logging.verbose else "quiet"}
