#!/bin/bash
# Does this cluster give hpcrl its launch route? One MPI world over a heterogeneous job: het group 0
# is the controller (one task), het group 1 the workers, joined by `srun --mpi=pmi2 --het-group=0,1`.
#
#   sbatch sbatch/check_world.sh [OUT.json]      # from the repository root, after `make setup`
#
# Worker sizes are the second block below (edit it, or pass e.g. `sbatch --partition=P ...`).
# HPCRL_PYTHON picks another interpreter (e.g. a conda env on a GPU cluster).
#SBATCH --job-name=hpcrl-check-world
#SBATCH --time=5
#SBATCH --output=hpcrl-check-world-%j.out
#SBATCH --nodes=1 --ntasks=1 --mem=500M
#SBATCH hetjob
#SBATCH --nodes=2 --ntasks-per-node=2 --mem=500M
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:?run this with sbatch}"
PY=${HPCRL_PYTHON:-$SLURM_SUBMIT_DIR/.venv/bin/python}
# /dev/shm segments of killed jobs, removed on every node before the world starts (hpcrl/launch/shm.py)
"$PY" -m hpcrl.launch.shm || true
srun --het-group=1 --ntasks="${SLURM_JOB_NUM_NODES_HET_GROUP_1:-1}" --ntasks-per-node=1 "$PY" -m hpcrl.launch.shm || true
# MPICH's UCX netmod overflows Slurm's pmi2 request buffer at MPI_Init; OFI's does not (hpcrl/launch/commands.py)
export MPIR_CVAR_CH4_NETMOD=${MPIR_CVAR_CH4_NETMOD:-ofi}
srun --mpi=pmi2 --het-group=0,1 "$PY" launchers/hpcrl_entry.py launchers/check_world.py "$@"
