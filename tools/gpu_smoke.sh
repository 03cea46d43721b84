#!/usr/bin/env bash
# GPU smoke test of the whole slice on the visible GPUs, in two parts:
# 1. the Megatron checks of tests/test_megatron_engine.py with one worker per GPU: CUDA, NCCL and
#    (when it installs) the Transformer Engine spec; log-probs vs HF (tiny Qwen2, SmolLM2-135M),
#    packed vs padded, HF round trip, updates across layouts, the critic, and the independent
#    reference PPO step (fp32 and bf16 with fp32 masters, T=0.7, 2 mini-batches x 2 epochs);
# 2. with CUDA vLLM: a 3-step bf16 GRPO run on SmolLM2-135M (`hpcrl run configs/grpo_smollm2.yaml`,
#    one worker per GPU): vLLM rollout, reshard with sleep/wake and trainer offload, then it prints
#    the reshard time, rollout tokens/s and the rollout-vs-actor log-prob gap of every step, and fails
#    unless all 3 steps ran with a mean gap under 0.05 nats.
#    Without vLLM (it does not install offline, and its wheel is too big to carry) part 2 is
#    skipped with a message.
# The budget is 10 minutes on a fresh GPU machine, install included.
#
#   bash tools/gpu_smoke.sh            # builds .venv-gpu (CUDA torch from PyPI), models, data; then tests
# Env: GPU_VENV (.venv-gpu), SKIP_TE=1 (do not try Transformer Engine), SKIP_VLLM=1 (no part 2),
#      PYTHON (python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}
log() { echo "[gpu-smoke] $*" >&2; }
command -v nvidia-smi >/dev/null || { log "no nvidia-smi: this is not a GPU machine"; exit 2; }
nvidia-smi -L
ngpu=$(nvidia-smi -L | grep -c '^GPU')
start=$SECONDS
if [[ ! -x $VENV/bin/python ]]; then
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install "torch>=2.6" "megatron-core==0.16.1" mpi4py mpich "transformers>=5.16.1,<5.20" safetensors \
  omegaconf submitit pyarrow pytest accelerate gguf
"${pip[@]}" install --no-deps --no-build-isolation -e .
if [[ ${SKIP_TE:-0} != 1 ]]; then
  log "installing transformer-engine[pytorch] (up to 5 min; the local spec is used if it fails)"
  timeout 300 "${pip[@]}" install --no-build-isolation "transformer-engine[pytorch]" \
    || log "Transformer Engine did not install: the checks run with megatron's local spec on CUDA"
fi
"$VENV/bin/python" - <<'PY'
import torch
print(f"[gpu-smoke] torch {torch.__version__} cuda {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
      f"{torch.cuda.get_device_name(0)}")
try:
    import transformer_engine.pytorch as te  # noqa: F401
    import transformer_engine
    print(f"[gpu-smoke] transformer-engine {transformer_engine.__version__}")
except Exception as e:
    print(f"[gpu-smoke] no transformer-engine: {type(e).__name__}: {str(e)[:200]}")
PY
log "set-up took $((SECONDS - start)) s"
"$VENV/bin/python" tools/make_tiny_model.py --out models/tiny-qwen2
"$VENV/bin/python" tools/build_smollm2.py --out models/smollm2-135m-instruct --cache models/.cache
"$VENV/bin/python" tools/make_arith_data.py --out data/arith
log "running the Megatron checks on $ngpu GPU worker(s)"
rc=0
layouts=$(for l in 1x1 2x1 1x2 2x2; do (( ngpu % (${l%x*} * ${l#*x}) == 0 )) && printf '%s ' "$l"; done)
log "layouts that $ngpu GPU(s) can hold: $layouts"
wide=$( (( ngpu % 4 == 0 )) && echo "long moe" || true)
log "checks that need 4 GPUs (long sequences at CP 2 x TP 2, MoE at EP 4): ${wide:-none on $ngpu GPU(s)}"
HPCRL_TEST_WORKERS=$ngpu HPCRL_TEST_LAYOUTS=$layouts HPCRL_TEST_WIDE=$wide "$VENV/bin/python" -m pytest -v -rA tests/test_megatron_engine.py "$@" || rc=$?
log "Megatron checks: exit $rc after $((SECONDS - start)) s"
if [[ ${SKIP_VLLM:-0} != 1 ]] && ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  log "installing vllm (CUDA) for the rollout part"
  timeout 240 "${pip[@]}" install vllm || log "vLLM did not install"
fi
if [[ ${SKIP_VLLM:-0} != 1 ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  run_dir=runs/gpu-smoke-grpo
  rm -rf "$run_dir"
  log "GRPO: 3 bf16 steps on SmolLM2-135M, $ngpu GPU worker(s), rollout with sleep/wake and offload"
  HF_HUB_OFFLINE=1 "$VENV/bin/hpcrl" run configs/grpo_smollm2.yaml model.dtype=bf16 trainer.device=cuda \
    trainer.workers_per_node="$ngpu" trainer.total_steps=3 trainer.val_every=0 actor.old_logprob=recompute actor.offload=true \
    trainer.run_dir="$run_dir" checkpoint.save_every=0 logging.tensorboard=false || rc=$?
  "$VENV/bin/python" - "$run_dir/metrics.jsonl" <<'PY' || rc=$?
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for m in steps:
    tps = m.get("throughput/rollout_tokens_per_s", 0.0)
    print(f"[gpu-smoke] step {m['step']}: reshard {m.get('time/reshard', 0):.2f} s, rollout {tps:.0f} tokens/s, "
          f"log-prob gap mean {m['rollout_actor_logprob_gap_mean']:.2e} max {m['rollout_actor_logprob_gap_max']:.2e}, "
          f"step {m['time/step']:.1f} s")
# every step ran, and vLLM generated with weights close to the trainer's after each reshard. The bound is
# not yet measured on a GPU (bf16 on both sides, different attention kernels): 0.05 nats of mean gap fails a
# weight lost, transposed or misplaced by the reshard, not a reload one step stale (tests/test_rollout.py
# checks that on the CPU, in fp32). Tighten it to ~10x what a GPU run measures.
problems = []
if [m["step"] for m in steps] != [1, 2, 3]:
    problems.append(f"steps {[m['step'] for m in steps]}, expected [1, 2, 3]")
worst = max((m["rollout_actor_logprob_gap_mean"] for m in steps), default=float("inf"))
if not worst < 0.05:
    problems.append(f"rollout-vs-actor log-prob gap mean {worst:.3g} >= 0.05")
for p in problems:
    print(f"[gpu-smoke] FAILED: {p}")
sys.exit(1 if problems else 0)
PY
else
  log "no vLLM: the rollout / GRPO part is skipped"
fi
log "total $((SECONDS - start)) s"
exit "$rc"
