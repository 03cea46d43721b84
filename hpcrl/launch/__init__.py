"""Launch layer: the MPI world (controller + workers) and torch.distributed among workers.

Kept free of model libraries (Megatron, vLLM) so every rank starts in well under a second.
Importing `hpcrl.launch.world` initialises MPI (mpi4py does it at import), so this package
only loads it on first use: building a command line in a plain process must not start MPI.
"""

from __future__ import annotations

import importlib
from typing import Any

from hpcrl.launch.commands import entry_argv, find_mpiexec, mpiexec_command, srun_het_command

_LAZY = {
    "CONTROLLER_RANK": "hpcrl.launch.world",
    "ProcessInfo": "hpcrl.launch.world",
    "World": "hpcrl.launch.world",
    "abort": "hpcrl.launch.world",
    "current_world": "hpcrl.launch.world",
    "init_world": "hpcrl.launch.world",
    "init_torch_distributed": "hpcrl.launch.rendezvous",
    "destroy_torch_distributed": "hpcrl.launch.rendezvous",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpcrl.launch' has no attribute {name!r}")


__all__ = ["entry_argv", "find_mpiexec", "mpiexec_command", "srun_het_command", *_LAZY]
