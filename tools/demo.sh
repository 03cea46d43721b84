#!/usr/bin/env bash
# `make demo`: GRPO on SmolLM2-135M-Instruct over generated arithmetic, locally, no cluster.
# make has already built the venv, the model (models/) and the data (data/arith).
# Extra arguments are config overrides, e.g. `make demo ARGS="trainer.total_steps=2"`.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
CONFIG=${DEMO_CONFIG:-configs/grpo_smollm2.yaml}
RUN_DIR=$(.venv/bin/hpcrl config --skip-path-checks "$CONFIG" "$@" --format json | .venv/bin/python -c \
  'import json, sys; print(json.load(sys.stdin)["trainer"]["run_dir"])')
# a fresh demo every time: the run would otherwise resume from its last checkpoint and do nothing (and
# the checks refuse to resume one written with other settings, e.g. another actor.engine)
rm -rf -- "$RUN_DIR"
echo "[demo] config $CONFIG (validated; the run plan follows)"
.venv/bin/hpcrl plan "$CONFIG" "$@"
.venv/bin/hpcrl run "$CONFIG" "$@"
.venv/bin/python - "$RUN_DIR" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
print("\n[demo] per step: reward mean, response length, step time")
for m in steps:
    print(f"  step {m['step']:>3}  reward {m['reward/mean']:.3f}  len {m['response_length/mean']:6.1f}  "
          f"{m['time/step']:6.1f} s")
val = run / "validation.jsonl"
if val.exists():
    last = {}
    for line in val.read_text().splitlines():
        r = json.loads(line)
        last[r["after_steps"]] = r
    print("[demo] validation (greedy) accuracy by optimizer steps done:",
          ", ".join(f"after {k}: {v.get('acc', float('nan')):.3f}" for k, v in sorted(last.items())))
print(f"[demo] metrics   {run / 'metrics.jsonl'} (one JSON line per step), TensorBoard: {run / 'tensorboard'}")
print(f"[demo] logs      {run / 'logs' / 'controller.log'}")
print(f"[demo] weights   {run / 'checkpoints'} (export: hpcrl ckpt export-hf {run} --out DIR)")
PY
echo "[demo] plots     (hpcrl plot $RUN_DIR)"
.venv/bin/hpcrl plot "$RUN_DIR" | sed 's/^/  /'
