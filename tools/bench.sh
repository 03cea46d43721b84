#!/usr/bin/env bash
# `make bench`: the benchmarks, one after the other (not run by CI). Each prints hpcrl and its
# baseline side by side from one run, with the ratio.
#   tools/bench_controller.py  hpcrl runtime vs Ray actors (Ray in its own venv, .venv-ray)
#   tools/bench_packing.py     packed vs padded Megatron updates
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
  case $b in tools/bench_controller.py|tools/bench_packing.py) continue ;; esac
  echo "[bench] === $b"
  .venv/bin/python "$b"
done
