#!/usr/bin/env bash
# `make demo`: GRPO on SmolLM2-135M-Instruct over generated arithmetic, locally, no cluster.
# make has already built the venv, the model (models/) and the data (data/arith).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
CONFIG=${DEMO_CONFIG:-configs/grpo_smollm2.yaml}
echo "[demo] config $CONFIG (validated; the run plan follows)"
.venv/bin/hpcrl plan "$CONFIG" "$@"
if .venv/bin/hpcrl run --help >/dev/null 2>&1; then
  exec .venv/bin/hpcrl run "$CONFIG" "$@"
fi
echo "[demo] model, data and config are ready; the GRPO loop itself (\`hpcrl run\`) is not in this build yet." >&2
exit 1
