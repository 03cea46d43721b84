#!/bin/bash
# GRPO on the tiny random Qwen2 (configs/grpo_tiny.yaml) on the local CPU cluster of tools/slurm_up.sh.
#
#   sbatch sbatch/grpo_tiny.sh [KEY=VALUE ...]        # from the repository root, after `make setup models data`
#   sbatch sbatch/grpo_tiny.sh trainer.total_steps=3 trainer.experiment=try1
#
# Het group 0: the controller (1 task, its own node); het group 1: 1 node x 4 CPU workers (actor TP=2, DP=2,
# 4 vLLM engines), the config's layout. Resize with `sbatch [group 0 options] : [group 1 options] sbatch/grpo_tiny.sh`,
# e.g. `: --nodes=2 --ntasks-per-node=2`; trainer.nnodes / trainer.workers_per_node follow the allocation.
# Preemption and time limits work as in sbatch/ppo_70b.sh (whose comments explain them): USR1 2 minutes before the
# limit, forwarded to every task by launchers/slurm_entry.py; the controller saves, requeues, and the restarted job
# resumes from {trainer.run_dir}/checkpoints (the run dir is pinned absolute; HPCRL_RUN_DIR is exported).
#SBATCH --job-name=hpcrl-grpo-tiny
#SBATCH --time=00:20:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=hpcrl-%x-%j.out
#SBATCH --partition=normal
#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=1 --mem=3G
#SBATCH hetjob
#SBATCH --partition=normal
#SBATCH --nodes=1 --ntasks-per-node=4 --cpus-per-task=1 --mem=3G
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:?submit this script with sbatch}"
PY=${HPCRL_PYTHON:-$SLURM_SUBMIT_DIR/.venv/bin/python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
# exec: this process must be the one that receives --signal=B:USR1 (slurm_entry forwards it to srun)
exec "$PY" launchers/slurm_entry.py configs/grpo_tiny.yaml "$@"
