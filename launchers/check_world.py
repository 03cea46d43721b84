"""Controller program of sbatch/check_world.sh: does this allocation give hpcrl one MPI world?

    srun --mpi=pmi2 --het-group=0,1 python launchers/hpcrl_entry.py launchers/check_world.py [OUT.json]

Prints where every rank landed (node, het group, pid), checks that the controller and all workers
share one MPI world, that torch.distributed works among the workers (an all_reduce) and that a
DP-split call comes back in order. Exits 1 with the reason when any of that fails; OUT.json gets
the raw findings.
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
    size = MPI.COMM_WORLD.Get_size()
    workers = g.where()
    n = len(workers)
    x = torch.arange(2 * n)
    out: dict[str, Any] = {
        "controller": {"mpi_size": size, "pid": os.getpid(), "slurm": _slurm_env()},
        "workers": workers,
        "y": g.plus_rank(Batch({"x": x}))["y"].tolist(),
    }
    expected_y = [int(v) + 1000 * (i // 2) for i, v in enumerate(x)]
    problems = []
    if any(w["mpi_size"] != size for w in workers) or size != n + 1:
        problems.append(f"not one MPI world: sizes {sorted({w['mpi_size'] for w in workers} | {size})}; "
                        "check that srun uses --mpi=pmi2 and mpi4py is built against an MPI with PMI-2")
    if any(w["gloo_world"] != n for w in workers):
        problems.append(f"torch.distributed all_reduce over {n} workers gave {[w['gloo_world'] for w in workers]}")
    if out["y"] != expected_y:
        problems.append(f"DP round trip out of order: {out['y']} != {expected_y}")
    ctrl_node = out["controller"]["slurm"]["SLURMD_NODENAME"] or "?"
    print(f"[check_world] one world of {size}: controller on {ctrl_node} "
          f"(het group size {out['controller']['slurm']['SLURM_HET_SIZE'] or '?'})")
    for w in workers:
        print(f"[check_world]   worker rank {w['mpi_rank']} on {w['node'] or w['host']} pid {w['pid']}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    if problems:
        for p in problems:
            print(f"[check_world] FAILED: {p}", file=sys.stderr)
        raise SystemExit(1)
    print("[check_world] OK: one MPI world, torch.distributed among the workers, DP calls in order")
