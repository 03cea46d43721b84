#!/usr/bin/env bash
# `make bench`: the benchmarks, one after the other (not run by CI). Each prints hpcrl and its
# baseline side by side from one run, with the ratio.
#   tools/bench_controller.py  hpcrl runtime vs Ray actors (Ray in its own venv, .venv-ray)
#   tools/bench_packing.py     packed vs padded Megatron updates
#   tools/bench_learning.py    GRPO learning curves + tokens/s vs TRL's GRPOTrainer (TRL in .venv-trl)
#   tools/bench_dpo.py         DPO tokens/s + held-out preference accuracy vs TRL's DPOTrainer (.venv-trl)
#   tools/bench_async.py       colocated vs split vs split one-step-off steps/s, with a timeline PNG
#   tools/bench_sampler.py     hpcrl's rollout sampler vs HF generate, both against the model's distribution
#   tools/bench_update_trl.py  hpcrl's update vs TRL's on the same completions (.venv-trl; with bench_learning)
# BENCH_LEARNING_ARGS: extra flags for bench_learning.py (e.g. "--steps 10 --val-samples 64");
# BENCH_LEARNING=0 skips it (the long one: --steps 3 --val-samples 16 took 22 min on 2 busy cores;
# the defaults, 5 steps and 32 prompts, need about twice that) and bench_update_trl.py (10 TRL steps
# and hpcrl's replay of them: 20 min alone on 2 cores).
# BENCH_DPO_ARGS: extra flags for bench_dpo.py (e.g. "--rounds 5 --steps 20"); BENCH_DPO=0 skips it
# (the defaults, 3 rounds of 10 steps x 8 pairs a side, take a few minutes a round).
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_VENV=${RAY_VENV:-.venv-ray}
if [[ ! -x $RAY_VENV/bin/python ]] || ! "$RAY_VENV/bin/python" -c "import ray, numpy" 2>/dev/null; then
  echo "[bench] creating $RAY_VENV (ray + numpy; kept out of the project's venv)"
  python3 -m venv "$RAY_VENV"
  "$RAY_VENV/bin/python" -m pip install --quiet --disable-pip-version-check ray numpy
fi
echo "[bench] === controller runtime vs Ray"
.venv/bin/python tools/bench_controller.py --ray-python "$RAY_VENV/bin/python"
echo "[bench] === packed vs padded Megatron update"
.venv/bin/python tools/bench_packing.py
shopt -s nullglob
for b in tools/bench_*.py; do
  case $b in tools/bench_controller.py|tools/bench_packing.py|tools/bench_learning.py|tools/bench_dpo.py|\
             tools/bench_update_trl.py) continue ;; esac
  echo "[bench] === $b"
  .venv/bin/python "$b"
done
if [[ ${BENCH_LEARNING:-1} != 0 ]]; then
  echo "[bench] === GRPO learning vs TRL"
  export TRL_VENV=${TRL_VENV:-.venv-trl}
  bash tools/setup_trl_venv.sh   # TRL + CPU torch in their own venv (idempotent)
  # shellcheck disable=SC2086  # word splitting of the extra flags is intended
  .venv/bin/python tools/bench_learning.py --trl-python "$TRL_VENV/bin/python" ${BENCH_LEARNING_ARGS:-}
  echo "[bench] === hpcrl's update vs TRL's on the same completions"
  .venv/bin/python tools/bench_update_trl.py --trl-python "$TRL_VENV/bin/python"
fi
if [[ ${BENCH_DPO:-1} != 0 ]]; then
  echo "[bench] === DPO vs TRL"
  export TRL_VENV=${TRL_VENV:-.venv-trl}
  bash tools/setup_trl_venv.sh   # idempotent
  # shellcheck disable=SC2086  # word splitting of the extra flags is intended
  .venv/bin/python tools/bench_dpo.py --trl-python "$TRL_VENV/bin/python" ${BENCH_DPO_ARGS:-}
fi
