#!/bin/bash
# PPO with a critic on a Llama-3-70B-class model (configs/ppo_70b.yaml): 32 worker nodes x 8 GPUs + 1 controller.
#
#   sbatch sbatch/ppo_70b.sh [KEY=VALUE ...]          # from the repository root; arguments override the config
#   sbatch --test-only sbatch/ppo_70b.sh              # does this cluster accept the allocation?
#
# Layout (configs/ppo_70b.yaml has the same in config form):
# - het group 0: the controller, 1 task on its own node. It runs the PPO algorithm (advantages, rewards,
#   batching) and holds no model; CPU and memory only, so it asks for no GPU. Other jobs may share its node.
# - het group 1: 32 nodes x 8 tasks, one worker per GPU = 256 workers, all colocated roles on every GPU:
#   - actor and critic Megatron TP=8: one node's NVLink domain; 64 heads and 8 KV groups split evenly (8 each).
#   - PP=8: 80 layers -> 10 per stage. Actor and critic each keep 18 bytes a parameter on their GPUs (bf16
#     weights, fp32 gradients, fp32 masters, 2 fp32 Adam moments): at PP=4 that is 76 GiB of 80 before any
#     activation, at PP=8 40 GiB (`hpcrl plan configs/ppo_70b.yaml --skip-path-checks --model-config
#     configs/models/llama3-70b.json --gpu-mem 80`, docs/planner.md).
#   - DP = 256 / (8 x 8) = 4 replicas of actor and critic; the reference policy uses the actor's layout.
#   - rollout (vLLM) TP=8: one engine per node = 32 engines; generation needs no PP and no cross-node traffic.
#   - --mem=0 and all 8 GPUs per node, --exclusive: nothing else on a worker node (NCCL and NVLink to ourselves).
# - --time=2-00:00:00 and --signal=B:USR1@600: ten minutes before the limit Slurm sends USR1 to this script's
#   process, which forwards it to srun and so to every task; the controller saves a checkpoint at the next step
#   boundary (a 70B distributed save takes minutes), runs `scontrol requeue` and exits 0. With --requeue the job
#   comes back (also after preemption or a node failure), SLURM_RESTART_COUNT > 0, and the run resumes from
#   {trainer.run_dir}/checkpoints by itself. --open-mode=append keeps one log across restarts.
# - What the resume logic needs is exported by launchers/slurm_entry.py: trainer.run_dir is pinned to an absolute
#   path (relative ones resolve against the submit directory, where the job always runs) and HPCRL_RUN_DIR is set.
#
# Edit --partition (and --account / --qos) for your site. The tools/slurm_up.sh cluster has a partition `gpu` of
# simulated 8-GPU nodes that accepts `--test-only` and never runs anything.
#
# Other sizes, e.g. the tiny model on the local 4-node CPU cluster: sbatch options before a ':' replace this script's
# directives for het group 0, options after it those of het group 1 (option by option; options given without any ':'
# apply to every group; measured with Slurm 22.05). Arguments after the script are config overrides:
#
#   sbatch --partition=normal --cpus-per-task=1 --mem=3G --time=30 \
#        : --partition=normal --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --mem=3G --gpus-per-node=0 \
#          --oversubscribe \
#        sbatch/ppo_70b.sh model.path=models/tiny-qwen2 model.dtype=fp32 trainer.device=cpu trainer.total_steps=2 ...
#
# (the whole override list is in docs/slurm.md). trainer.nnodes / trainer.workers_per_node follow the allocation.
# HPCRL_PYTHON picks the interpreter (default: the repository's .venv); HPCRL_MODEL_DIR / HPCRL_DATA_DIR are read by
# the config (defaults /models, /data).
#SBATCH --job-name=hpcrl-ppo-70b
#SBATCH --time=2-00:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=hpcrl-%x-%j.out
#SBATCH --partition=gpu
#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=16 --mem=64G
#SBATCH hetjob
#SBATCH --partition=gpu
#SBATCH --nodes=32 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=12 --mem=0 --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:?submit this script with sbatch}"
PY=${HPCRL_PYTHON:-$SLURM_SUBMIT_DIR/.venv/bin/python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}                            # compute nodes never reach a model hub
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron TP overlap needs ordered kernels
# exec: this process must be the one that receives --signal=B:USR1 (slurm_entry forwards it to srun)
exec "$PY" launchers/slurm_entry.py configs/ppo_70b.yaml "$@"
