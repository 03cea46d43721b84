"""A bare MPI world whose ranks start MPI with a heap full of non-zero bytes (tests/test_controller.py).

    srun --mpi=pmi2 --het-group=0,1 python tests/programs/dirty_heap_world.py OUT.json

Why: MPICH's UCX netmod puts its address through PMI together with the heap memory behind it, and
Slurm's pmi2 plugin cuts PMI lines that are too long (hpcrl/launch/commands.py, SLURM_PMI2_ENV).
A heap left like this (malloc'd chunks filled with 0xA5, every other one freed before MPI is even
loaded) makes those lines as long as they get: with the UCX netmod MPI_Init then fails or hangs on
every run (measured), with the launcher's environment the world starts. Rank 0 writes the world
size and every rank's node to OUT.json.
"""

import ctypes
import json
import os
import sys


def dirty_heap(chunks: int = 20000) -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    ptrs = []
    for i in range(chunks):
        size = (64, 512, 4096, 16384)[i % 4]
        p = libc.malloc(size)
        ctypes.memset(p, 0xA5, size)
        ptrs.append(p)
    for p in ptrs[::2]:
        libc.free(p)


dirty_heap()
from mpi4py import MPI  # noqa: E402  (after the heap is dirty: that is the point)

comm = MPI.COMM_WORLD
nodes = comm.gather(os.environ.get("SLURMD_NODENAME", ""), root=0)
if comm.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"size": comm.size, "nodes": nodes, "netmod": os.environ.get("MPIR_CVAR_CH4_NETMOD", "")}, f)
