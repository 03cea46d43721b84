"""Controller program for the Slurm hetjob test: where did every rank land, and does it work?

    srun --mpi=pmi2 --het-group=0,1 python launchers/hpcrl_entry.py tests/programs/ctrl_slurm.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from hpcrl.controller import Batch, Collect, Dispatch, Worker, WorkerGroup, register


def _slurm_env() -> dict[str, str]:
    keys = ("SLURMD_NODENAME", "SLURM_HET_SIZE", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_ID")
    return {k: os.environ.get(k, "") for k in keys}


class Probe(Worker):
    def where(self) -> dict[str, Any]:
        x = torch.tensor([1.0])
        dist.all_reduce(x)
        return {**self.process_info(), "mpi_size": MPI.COMM_WORLD.Get_size(), "gloo_world": x.item(),
                "slurm": _slurm_env()}

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def plus_rank(self, batch: Batch) -> Batch:
        batch["y"] = batch["x"] + 1000 * self.group_rank
        return batch


def main() -> None:
    g = WorkerGroup(Probe)
    out: dict[str, Any] = {
        "controller": {"mpi_size": MPI.COMM_WORLD.Get_size(), "pid": os.getpid(), "slurm": _slurm_env()},
        "workers": g.where(),
        "y": g.plus_rank(Batch({"x": torch.arange(8)}))["y"].tolist(),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
