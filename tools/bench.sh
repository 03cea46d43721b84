#!/usr/bin/env bash
# `make bench`: every benchmark under tools/bench_*.py, one after the other (not run by CI).
# Each prints hpcrl and its baseline side by side from one run, with the ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
benches=(tools/bench_*.py)
(( ${#benches[@]} )) || { echo "[bench] no benchmarks in tools/"; exit 0; }
for b in "${benches[@]}"; do
  echo "[bench] === $b"
  .venv/bin/python "$b"
done
