#!/bin/bash
# Does this cluster give hpcrl its launch route? One MPI world over a heterogeneous job: het group 0
# is the controller (one task), het group 1 the workers, joined by `srun --mpi=pmi2 --het-group=0,1`,
# started by the same launcher as a training job.
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
# the trainer's own launcher (hpcrl/launch/allocation.py): it removes stale /dev/shm segments on every
# node, sets MPICH's netmod for Slurm's pmi2 and forwards USR1/TERM, then starts the world's srun step
exec "$PY" launchers/slurm_entry.py --target launchers/check_world.py --no-config "$@"
