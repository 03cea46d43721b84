#!/bin/bash
# GRPO on the tiny random Qwen2 (configs/grpo_tiny.yaml) with the split placement, on the local CPU cluster of
# tools/slurm_up.sh: the trainer and the vLLM engines on nodes of their own, one batch generated ahead.
#
#   sbatch sbatch/grpo_split.sh [KEY=VALUE ...]       # from the repository root, after `make setup models data`
#   sbatch sbatch/grpo_split.sh trainer.total_steps=3 rollout.max_staleness=0
#
# Het group 0: the controller (1 task, its own node); het group 1: the trainer, 1 node x 2 CPU workers (actor
# TP=2); het group 2: the rollout, 1 node x 2 CPU workers (2 vLLM engines). launchers/slurm_entry.py sees the
# third group and sets trainer.placement=split and trainer.rollout_workers to its tasks; the rollout ranks are
# the last of the world (srun --het-group=0,1,2). Both worker groups need the same tasks per node. Preemption
# and time limits work as in sbatch/grpo_tiny.sh; the batch generated ahead is part of every checkpoint.
#SBATCH --job-name=hpcrl-grpo-split
#SBATCH --time=00:20:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=hpcrl-%x-%j.out
#SBATCH --partition=normal
#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=1 --mem=3G
#SBATCH hetjob
#SBATCH --partition=normal
#SBATCH --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --mem=3G
#SBATCH hetjob
#SBATCH --partition=normal
#SBATCH --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --mem=3G
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:?submit this script with sbatch}"
PY=${HPCRL_PYTHON:-$SLURM_SUBMIT_DIR/.venv/bin/python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
# exec: this process must be the one that receives --signal=B:USR1 (slurm_entry forwards it to srun)
exec "$PY" launchers/slurm_entry.py configs/grpo_tiny.yaml "$@"
