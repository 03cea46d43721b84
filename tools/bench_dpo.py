"""DPO benchmark (not CI): hpcrl and TRL's DPOTrainer side by side on SmolLM2-135M-Instruct, the same
preference pairs, beta, learning rate, batch and number of steps, fp32 on CPU.

    .venv/bin/python tools/bench_dpo.py [--rounds 3 --steps 10 --pairs 8] [--trl-python .venv-trl/bin/python]

(`make models data` and `bash tools/setup_trl_venv.sh` first.) The two sides run in alternating rounds
(hpcrl, TRL, hpcrl, TRL, ...: a shared host's speed drifts over minutes, so one run of each cannot tell
a difference from the weather). Each round prints, for each side:

- the wall time of the training steps: the sum of the per-step times, model loading and start-up
  excluded. hpcrl: `time/step` of metrics.jsonl (batch assembly, the reference's log-probs, the
  actor's forward, backward and optimizer step, collecting the metrics) minus the validation that
  step 1 begins with. TRL: on_step_begin to on_step_end of each optimizer step (the reference's and
  the policy's forwards, backward, clipping, optimizer step; the collation of the step's batch,
  milliseconds, comes before on_step_begin and is not included);
- training tokens/s: the prompt + chosen + rejected tokens of the step's pairs (each prompt counted
  once, from the data as tokenised below: the same count for both sides) per second of that time;
  over all steps and over steps 2.. (without the first step's warm-up);
- the preference accuracy on the held-out pairs (data/pref/val.jsonl) after the last step: the share of
  pairs whose policy margin (logp chosen - logp rejected) exceeds the reference's (DPO's
  rewards/accuracies). Both sides are scored by the same code here, with HF transformers in .venv, on
  their final weights: hpcrl's last checkpoint exported by `hpcrl ckpt export-hf`, TRL's model as
  save_pretrained writes it. With it the held-out rewards/margins and DPO loss (the initial model
  already ranks chosen first on all 64 pairs, so the accuracy reaches 1 within a few steps and the
  margin tells more). hpcrl's own val/rewards/accuracies and margins of the run are printed next to
  them as a check of the export and the scorer;
- the 1-minute load average (every 10 s while the side runs: mean and max) and the host's steal time
  (/proc/stat, all CPUs) over the side's whole run.

The table at the end has every round, the median hpcrl / TRL tokens/s ratio and the held-out metrics.

The pairs: hpcrl's PreferenceDataset tokenises data/pref (the prompt with the chat template and the
generation prompt; each response as the chat template renders it, cut after its EOS). TRL is handed
these very token ids (prompt_ids / chosen_ids / rejected_ids, its collator's input), in the order
hpcrl's sampler draws the pairs, with a sequential sampler, so both sides train on the same
sequences in the same batches. TRL's own tokenisation of the same rows is run as a check and its
differences printed (TRL keeps the chat template's newline after <|im_end|> in each response).

hpcrl: `hpcrl run configs/dpo_tiny.yaml` with overrides (SmolLM2, 2 CPU workers of one torch thread
each, TP = PP = 1, DP = 2, the demo's layout), saving one checkpoint at the end. TRL: DPOTrainer in
its own venv (tools/setup_trl_venv.sh makes .venv-trl), one process with as many torch threads as
hpcrl has worker processes (as tools/bench_learning.py does: the same number of compute threads; on
a 2-core machine that is its cores).

Matched settings (TRL's names in brackets): sigmoid DPO loss, beta, no label smoothing; one optimizer
step per `--pairs` pairs, the loss the mean over them [per_device_train_batch_size = pairs,
gradient_accumulation_steps 1]; Adam(W) with constant lr, no warm-up, betas (0.9, 0.999), eps 1e-8,
weight decay 0, grad-norm clip 1.0 [lr_scheduler_type constant, optim adamw_torch, max_grad_norm];
the reference's log-probs computed every step by a frozen copy of the initial model
[precompute_ref_log_probs False]; log-probs summed over each response's tokens, EOS included; fp32
[bf16 False]; no gradient checkpointing (TRL's default is on); no truncation [max_length None].
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/dpo_tiny.yaml"
MODEL = "models/smollm2-135m-instruct"
TRAIN_FILE = "data/pref/train.parquet"
VAL_FILE = "data/pref/val.jsonl"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: the shared helpers below
from bench_learning import LoadSampler, _stream, steal_seconds  # noqa: E402  (stdlib only)

DIFFERENCES = [
    "engine: hpcrl packs each pair's prompt once with both responses after it (Megatron-core, no padding); "
    "TRL pads prompt+chosen and prompt+rejected rows to the batch's longest and runs them as one batch",
    "optimizer: torch AdamW on both sides (hpcrl's fused=True over its Megatron shard, TRL's adamw_torch); "
    "same betas, eps, lr, weight decay 0, clip",
    "parallelism: hpcrl {workers} worker processes x 1 torch thread, data-parallel ({pairs_per_worker} pairs each, "
    "gradients all-reduced) + a controller process; TRL 1 process x {trl_threads} torch threads, the {pairs} pairs "
    "in one batch",
    "step time: hpcrl's includes sending the batch to the workers and collecting their metrics; TRL's starts "
    "after its dataloader has collated the batch",
    "transformers: {hpcrl_tf} in .venv (hpcrl, vLLM's pin; the scorer) vs {trl_tf} in .venv-trl (what TRL "
    "installs)",
]


# ---------------------------------------------------------------- TRL side (runs in .venv-trl)
def trl_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Train with TRL's DPOTrainer on the spec's pre-tokenised pairs; save the final model; return timings."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    h = spec["hparams"]
    t_load = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    load_s = time.perf_counter() - t_load

    class PreTokenizedDPOTrainer(DPOTrainer):
        """DPOTrainer on rows that already hold prompt_ids / chosen_ids / rejected_ids (hpcrl's tokens):
        its collator's input, so both sides train on the same sequences."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.step_s: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            if "loss" in logs:  # a training step's log (not the summary train() ends with)
                self.logs.append(logs)
                print(f"[trl] step {state.global_step}/{spec['steps']} | loss {logs['loss']:.4f} | "
                      f"acc {logs.get('rewards/accuracies', float('nan')):.3f} | "
                      f"margin {logs.get('rewards/margins', float('nan')):.4f} | "
                      f"time {self.step_s[-1] if self.step_s else float('nan'):.2f}s", flush=True)

    train = Dataset.from_list([{"prompt_ids": r["prompt_ids"], "chosen_ids": r["chosen_ids"],
                                "rejected_ids": r["rejected_ids"]} for r in spec["train"]])
    cfg = DPOConfig(
        output_dir=os.path.join(spec["tmp"], "trl_out"), max_steps=spec["steps"],
        per_device_train_batch_size=h["pairs"], gradient_accumulation_steps=1,
        learning_rate=h["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=h["clip_grad"], optim="adamw_torch",
        beta=h["beta"], loss_type=["sigmoid"], label_smoothing=0.0, precompute_ref_log_probs=False,
        max_length=None, bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", report_to="none",
        seed=spec["seed"], disable_tqdm=True, dataloader_num_workers=0)
    timer = StepTimer()
    t_setup = time.perf_counter()
    trainer = PreTokenizedDPOTrainer(model=model, args=cfg, train_dataset=train, processing_class=tok,
                                     callbacks=[timer])
    setup_s = time.perf_counter() - t_setup  # includes loading the reference model

    # TRL's own tokenisation of the same rows, as a check (not what it trains on)
    raw = Dataset.from_list([{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
                             for r in spec["train"]])
    own = DPOTrainer._prepare_dataset(trainer, raw, tok, cfg, "tokenization check")
    differ, example = 0, ""
    for mine, theirs in zip(spec["train"], own, strict=True):
        diff = [k for k in ("prompt_ids", "chosen_ids", "rejected_ids") if mine[k] != list(theirs[k])]
        if diff:
            differ += 1
            if not example:
                k = diff[0]
                example = f"{k}: hpcrl {tok.decode(mine[k])!r} vs TRL {tok.decode(list(theirs[k]))!r}"

    t = time.perf_counter()
    trainer.train()
    train_wall_s = time.perf_counter() - t
    trainer.model.save_pretrained(spec["out_model"])
    return {"versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__},
            "threads": torch.get_num_threads(), "load_s": load_s, "setup_s": setup_s, "train_wall_s": train_wall_s,
            "step_s": timer.step_s, "loss": [x["loss"] for x in timer.logs],
            "train_acc": [x.get("rewards/accuracies", float("nan")) for x in timer.logs],
            "tokenization_differs": differ, "tokenization_example": example}


# ---------------------------------------------------------------- driver (runs in .venv)
def _overrides(args: argparse.Namespace, run_dir: str) -> list[str]:
    """configs/dpo_tiny.yaml turned into the SmolLM2 run: every setting the comparison depends on is set here."""
    return [f"model.path={MODEL}", "model.dtype=fp32", "actor.parallel.tensor_parallel=1",
            "actor.parallel.pipeline_parallel=1", f"actor.micro_batch_tokens={args.micro_batch_tokens}",
            f"actor.optim.lr={args.lr}", "actor.optim.lr_schedule=constant", "actor.optim.warmup_steps=0",
            "actor.optim.weight_decay=0.0", "actor.optim.adam_beta1=0.9", "actor.optim.adam_beta2=0.999",
            "actor.optim.adam_eps=1e-8", f"actor.optim.clip_grad={args.clip_grad}",
            "algorithm.name=dpo", f"algorithm.dpo.beta={args.beta}", "algorithm.dpo.loss_type=sigmoid",
            "algorithm.dpo.label_smoothing=0.0", f"data.train_files=[{TRAIN_FILE}]", f"data.val_files=[{VAL_FILE}]",
            f"data.train_batch_size={args.pairs}", f"data.val_batch_size={args.val_pairs}",
            f"data.val_max_samples={args.val_pairs}", "data.max_prompt_length=256", "data.max_response_length=64",
            "data.shuffle=true", f"data.seed={args.seed}", f"trainer.seed={args.seed}",
            f"trainer.run_dir={run_dir}", f"trainer.total_steps={args.steps}",
            # validation before step 1 and after the last (hpcrl's own accuracy, a check of the scorer)
            f"trainer.val_every={args.steps}", "trainer.nnodes=1", f"trainer.workers_per_node={args.workers}",
            "trainer.device=cpu", "checkpoint.save_every=0", "checkpoint.keep_last=1", "logging.tensorboard=false"]


def _prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The pairs both sides see, tokenised by hpcrl: the training pairs in the order hpcrl's sampler
    draws them for `args.steps` steps (with the raw rows, for TRL's tokenisation check), and the
    first `args.val_pairs` held-out pairs."""
    sys.path.insert(0, REPO)
    import pyarrow.parquet as pq

    from hpcrl.config import load_config
    from hpcrl.data import PreferenceDataset, ShuffledSampler

    cfg = load_config(os.path.join(REPO, CONFIG), _overrides(args, os.path.join(REPO, "runs", "unused")))
    d = cfg.data

    def load(files: list[str]) -> PreferenceDataset:
        return PreferenceDataset(files, cfg.model.path, d.prompt_key, d.chosen_key, d.rejected_key,
                                 d.max_prompt_length, d.max_response_length, d.max_skipped_row_share)

    train, val = load(list(d.train_files)), load(list(d.val_files))
    if train.num_filtered or train.num_skipped:
        raise SystemExit("bench: some training pairs were dropped; row indices would not line up with the file")
    sampler = ShuffledSampler(len(train), d.train_batch_size, d.seed, d.shuffle)
    steps = [sampler.next_batch() for _ in range(args.steps)]
    raw = pq.read_table(os.path.join(REPO, TRAIN_FILE)).to_pylist()

    def row(i: int) -> dict[str, Any]:
        p = train[i]
        return {"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids,
                **{k: raw[i][k] for k in ("prompt", "chosen", "rejected")}}

    step_tokens = [sum(len(train[i].prompt_ids) + len(train[i].chosen_ids) + len(train[i].rejected_ids)
                       for i in idx) for idx in steps]
    held_out = [val[i] for i in range(min(args.val_pairs, len(val)))]
    return {"model": os.path.join(REPO, MODEL), "train": [row(int(i)) for idx in steps for i in idx],
            "step_tokens": step_tokens, "val": held_out}


class HeldOutScorer:
    """Log-probs of the held-out responses under a model, summed over each response's tokens (EOS
    included, prompt excluded), with HF transformers: the same code for both sides' final weights."""

    def __init__(self, base_model: str, pairs: list[Any], beta: float):
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(os.cpu_count() or 1)
        hf_logging.disable_progress_bar()  # a "Loading weights" bar per model would clutter the report
        self.beta = beta
        self.base_model = base_model
        self.rows = [(p.prompt_ids, resp) for p in pairs for resp in (p.chosen_ids, p.rejected_ids)]
        self.ref_chosen, self.ref_rejected = self.logprobs(None)  # the reference: the initial model

    def _model(self, weights_dir: str | None) -> Any:
        """The base model's architecture with the weights of weights_dir (every *.safetensors there)."""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.base_model, dtype=torch.float32)
        if weights_dir is not None:
            state: dict[str, torch.Tensor] = {}
            for f in sorted(Path(weights_dir).glob("*.safetensors")):
                state.update(load_file(str(f)))
            missing, unexpected = model.load_state_dict(state, strict=False)
            tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
            if unexpected or set(missing) - tied or not state:
                raise SystemExit(f"bench: {weights_dir} does not hold the model's weights (missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}, {len(state)} tensors)")
        return model.eval()

    def logprobs(self, weights_dir: str | None, rows_per_batch: int = 16) -> tuple[Any, Any]:
        """(chosen, rejected) summed response log-probs, one entry per held-out pair (float64)."""
        import torch

        model = self._model(weights_dir)
        sums = []
        with torch.no_grad():
            for b in range(0, len(self.rows), rows_per_batch):
                chunk = self.rows[b:b + rows_per_batch]
                width = max(len(q) + len(r) for q, r in chunk)
                ids = torch.zeros(len(chunk), width, dtype=torch.long)
                attn = torch.zeros(len(chunk), width, dtype=torch.long)
                resp = torch.zeros(len(chunk), width, dtype=torch.bool)
                for i, (q, r) in enumerate(chunk):
                    ids[i, :len(q) + len(r)] = torch.tensor(q + r)
                    attn[i, :len(q) + len(r)] = 1
                    resp[i, len(q):len(q) + len(r)] = True
                logits = model(input_ids=ids, attention_mask=attn).logits.double()
                # token t is predicted by the logits at t - 1
                token_logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
                sums.append((token_logp * resp[:, 1:]).sum(-1))
        s = torch.cat(sums)
        del model
        return s[0::2], s[1::2]

    def accuracy(self, weights_dir: str) -> dict[str, float]:
        """DPO's held-out metrics (TRL's names): rewards/accuracies (the policy's margin above the
        reference's), rewards/margins (beta times the mean log-ratio margin), the sigmoid DPO loss, and
        logps/accuracies (the policy alone prefers chosen)."""
        import torch

        chosen, rejected = self.logprobs(weights_dir)
        h = (chosen - self.ref_chosen) - (rejected - self.ref_rejected)
        return {"acc": float((h > 0).double().mean()), "margin": float(self.beta * h.mean()),
                "loss": float(-torch.nn.functional.logsigmoid(self.beta * h).mean()),
                "logps_acc": float((chosen > rejected).double().mean())}

    def reference_logps_accuracy(self) -> float:
        return float((self.ref_chosen > self.ref_rejected).double().mean())


def _tokens_per_s(step_tokens: list[int], step_s: list[float], skip_first: bool) -> float:
    k = 1 if skip_first and len(step_s) > 1 else 0
    return sum(step_tokens[k:]) / sum(step_s[k:])


def _timed(cmd: list[str], log_path: str, label: str, env: dict[str, str], timeout: float | None
           ) -> tuple[float, float, Any]:
    """Run one side: (wall seconds, host steal seconds, load samples); exits with the log's tail if it fails."""
    t = time.time()
    steal0 = steal_seconds()
    sampler = LoadSampler()
    rc = _stream(cmd, log_path, label, env, timeout)
    load = sampler.stop()
    wall, steal = time.time() - t, steal_seconds() - steal0
    if rc != 0:
        print(open(log_path).read()[-4000:])
        raise SystemExit(f"bench: {label} run failed (exit {rc})")
    return wall, steal, load


def _run_hpcrl(args: argparse.Namespace, tmp: str, env: dict[str, str]) -> dict[str, Any]:
    """One `hpcrl run`, then its final checkpoint exported to HF (the checkpoint removed: ~2 GB)."""
    run_dir = os.path.join(tmp, "hpcrl")
    hpcrl = os.path.join(REPO, ".venv", "bin", "hpcrl")
    cmd = [hpcrl, "run", CONFIG, *_overrides(args, run_dir)]
    print("[bench] hpcrl: " + " ".join(cmd[1:]), flush=True)
    wall, steal, load = _timed(cmd, os.path.join(tmp, "hpcrl.log"), "hpcrl", env, args.timeout)
    steps = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if x.strip()]
    val = {}
    for x in open(os.path.join(run_dir, "validation.jsonl")):
        if x.strip():
            r = json.loads(x)
            val[r["after_steps"]] = r
    export_dir = os.path.join(tmp, "hpcrl_export")
    out = subprocess.run([hpcrl, "ckpt", "export-hf", run_dir, "--out", export_dir], cwd=REPO, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench: hpcrl ckpt export-hf failed (exit {out.returncode}): {out.stderr[-2000:]}")
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    return {"step_s": [m["time/step"] - m.get("time/validate", 0.0) for m in steps],
            "loss": [m["dpo/loss"] for m in steps], "train_acc": [m["dpo/rewards/accuracies"] for m in steps],
            "phases": {k: sum(m.get(f"time/{k}", 0.0) for m in steps) for k in ("ref_logprob", "update_actor")},
            "own_val_acc": val.get(args.steps, {}).get("rewards/accuracies", float("nan")),
            "own_val_margin": val.get(args.steps, {}).get("rewards/margins", float("nan")),
            "wall_s": wall, "load": load, "steal_s": steal, "weights": export_dir}


def _run_trl(args: argparse.Namespace, tmp: str, prepared: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One TRL DPOTrainer run in .venv-trl (this file with --trl-child)."""
    spec = {"tmp": tmp, "steps": args.steps, "seed": args.seed, "threads": args.trl_threads,
            "model": prepared["model"], "train": prepared["train"], "out_model": os.path.join(tmp, "trl_model"),
            "hparams": {"pairs": args.pairs, "lr": args.lr, "beta": args.beta, "clip_grad": args.clip_grad}}
    spec_path, out_path = os.path.join(tmp, "trl_spec.json"), os.path.join(tmp, "trl.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [args.trl_python, os.path.abspath(__file__), "--trl-child", spec_path, out_path]
    print(f"[bench] TRL: {args.trl_python} (DPOTrainer, 1 process, {args.trl_threads} torch threads)", flush=True)
    wall, steal, load = _timed(cmd, os.path.join(tmp, "trl.log"), "trl",
                               {**env, "OMP_NUM_THREADS": str(args.trl_threads)}, args.timeout)
    with open(out_path) as f:
        res = json.load(f)
    if len(res["step_s"]) != args.steps:
        raise SystemExit(f"bench: TRL ran {len(res['step_s'])} optimizer steps, expected {args.steps}")
    return {**res, "wall_s": wall, "load": load, "steal_s": steal, "weights": spec["out_model"]}


def _side_line(name: str, side: dict[str, Any], step_tokens: list[int]) -> str:
    cpu_s = side["wall_s"] * (os.cpu_count() or 1)
    return (f"  {name:5} | {sum(side['step_s']):8.1f} {_tokens_per_s(step_tokens, side['step_s'], False):9.1f} "
            f"{_tokens_per_s(step_tokens, side['step_s'], True):10.1f} | {side['score']['acc']:7.3f} "
            f"{side['score']['margin']:+8.4f} {side['score']['loss']:8.4f} {side['score']['logps_acc']:7.3f} | "
            f"{side['wall_s']:7.1f} | "
            f"{side['load']['mean']:4.2f}/{side['load']['max']:4.2f} | {side['steal_s']:6.1f} "
            f"({100 * side['steal_s'] / cpu_s:4.1f}%)")


def _round_report(k: int, args: argparse.Namespace, h: dict[str, Any], r: dict[str, Any],
                  step_tokens: list[int]) -> None:
    print(f"\n[bench] round {k}/{args.rounds}: {args.steps} steps x {args.pairs} pairs, {sum(step_tokens)} tokens")
    print(f"  {'side':5} | {'train s':>8} {'tokens/s':>9} {'steps 2..':>10} | {'acc':>7} {'margin':>8} "
          f"{'loss':>8} {'logpacc':>7} | {'run s':>7} | load mean/max | steal s (% CPU)")
    print(_side_line("hpcrl", h, step_tokens))
    print(_side_line("TRL", r, step_tokens))
    ratio_all = _tokens_per_s(step_tokens, h["step_s"], False) / _tokens_per_s(step_tokens, r["step_s"], False)
    ratio_steady = _tokens_per_s(step_tokens, h["step_s"], True) / _tokens_per_s(step_tokens, r["step_s"], True)
    print(f"  tokens/s hpcrl / TRL: {ratio_all:.2f}x (all steps), {ratio_steady:.2f}x (steps 2..)")
    print(f"  train loss per step, hpcrl: {' '.join(f'{x:.4f}' for x in h['loss'])}")
    print(f"  train loss per step, TRL:   {' '.join(f'{x:.4f}' for x in r['loss'])}")
    print(f"  hpcrl's own validation: rewards/accuracies {h['own_val_acc']:.3f}, rewards/margins "
          f"{h['own_val_margin']:+.4f} (this scorer: {h['score']['acc']:.3f}, {h['score']['margin']:+.4f}); "
          "phases (s, all steps): "
          + ", ".join(f"{p} {s:.1f}" for p, s in h["phases"].items()))
    print(f"  TRL: model load {r['load_s']:.1f} s, trainer set-up (+ reference model) {r['setup_s']:.1f} s, "
          f"train() {r['train_wall_s']:.1f} s (steps {sum(r['step_s']):.1f} s)", flush=True)


def _final_report(args: argparse.Namespace, rounds: list[dict[str, Any]], ref_logps_acc: float, n_val: int) -> None:
    import transformers

    r0 = rounds[0]["trl"]
    v = r0["versions"]
    print(f"\n=== DPO benchmark: SmolLM2-135M-Instruct on {TRAIN_FILE}, {args.steps} steps x {args.pairs} pairs, "
          f"beta {args.beta:g}, lr {args.lr:g} constant, clip {args.clip_grad:g}, fp32, CPU")
    print(f"hpcrl: {args.workers} worker processes x 1 torch thread (Megatron-core, DP={args.workers}) + controller | "
          f"TRL {v['trl']} DPOTrainer: 1 process x {r0['threads']} torch threads, transformers {v['transformers']}, "
          f"torch {v['torch']} | machine: {os.cpu_count()} cores, shared")
    print("train s: sum of the training steps' wall time (no model load, start-up, validation or save); tokens/s: "
          "prompt + chosen + rejected tokens of the steps' pairs per train s (the same count for both sides)")
    print(f"held-out ({n_val} pairs, one = {1 / n_val:.3f}): acc = rewards/accuracies (policy margin > reference "
          "margin), margin = rewards/margins, loss = DPO's sigmoid loss; one HF transformers scorer on each side's "
          f"final weights. The initial model ranks chosen first on {ref_logps_acc:.3f} of them (logps/accuracies)"
          + ("; acc then reaches 1 within a few steps, and margin and loss tell the sides apart"
             if ref_logps_acc >= 0.9 else ""))
    print(f"\n{'round':>6} | {'hpcrl tok/s':>11} {'TRL tok/s':>9} {'ratio':>6} {'steps 2..':>9} | "
          f"{'acc hpcrl/TRL':>13} | {'margin hpcrl/TRL':>17} | {'loss hpcrl/TRL':>15} | {'load hpcrl/TRL':>14} | "
          "steal s hpcrl/TRL")
    ratios, steady = [], []
    score: dict[str, dict[str, list[float]]] = {"hpcrl": {}, "trl": {}}
    for k, rd in enumerate(rounds, 1):
        h, r, tokens = rd["hpcrl"], rd["trl"], rd["step_tokens"]
        th, tr = _tokens_per_s(tokens, h["step_s"], False), _tokens_per_s(tokens, r["step_s"], False)
        sh, sr = _tokens_per_s(tokens, h["step_s"], True), _tokens_per_s(tokens, r["step_s"], True)
        ratios.append(th / tr)
        steady.append(sh / sr)
        for side in ("hpcrl", "trl"):
            for key, value in rd[side]["score"].items():
                score[side].setdefault(key, []).append(value)
        print(f"{k:>6} | {th:11.1f} {tr:9.1f} {th / tr:5.2f}x {sh / sr:8.2f}x | "
              f"{h['score']['acc']:6.3f}/{r['score']['acc']:<6.3f} | "
              f"{h['score']['margin']:+8.4f}/{r['score']['margin']:<+8.4f} | "
              f"{h['score']['loss']:7.4f}/{r['score']['loss']:<7.4f} | "
              f"{h['load']['mean']:6.2f}/{r['load']['mean']:<7.2f} | {h['steal_s']:.1f}/{r['steal_s']:.1f}")
    med = {side: {key: statistics.median(v) for key, v in d.items()} for side, d in score.items()}
    print(f"{'median':>6} | {'':11} {'':9} {statistics.median(ratios):5.2f}x {statistics.median(steady):8.2f}x | "
          f"{med['hpcrl']['acc']:6.3f}/{med['trl']['acc']:<6.3f} | "
          f"{med['hpcrl']['margin']:+8.4f}/{med['trl']['margin']:<+8.4f} | "
          f"{med['hpcrl']['loss']:7.4f}/{med['trl']['loss']:<7.4f} |")
    print(f"\n[bench] median tokens/s ratio hpcrl / TRL: {statistics.median(ratios):.2f}x over all steps, "
          f"{statistics.median(steady):.2f}x over steps 2.. ({len(rounds)} round(s)); held-out accuracy after "
          f"{args.steps} steps (median): hpcrl {med['hpcrl']['acc']:.3f}, TRL {med['trl']['acc']:.3f}")
    if r0["tokenization_differs"]:
        print(f"note: TRL's own tokenisation of the same rows differs from hpcrl's for {r0['tokenization_differs']} "
              f"of {len(rounds[0]['trl_rows'])} training pairs (both sides train on hpcrl's ids), e.g. "
              f"{r0['tokenization_example']}")
    print("settings that differ:")
    for line in DIFFERENCES:
        print("  - " + line.format(trl_threads=r0["threads"], hpcrl_tf=transformers.__version__,
                                   trl_tf=v["transformers"], workers=args.workers, pairs=args.pairs,
                                   pairs_per_worker=args.pairs // args.workers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating hpcrl / TRL rounds")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per side and round")
    p.add_argument("--pairs", type=int, default=8, help="preference pairs per optimizer step (a multiple of --workers)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--val-pairs", type=int, default=64, help="held-out pairs scored (the first K of data/pref/val)")
    p.add_argument("--workers", type=int, default=2, help="hpcrl CPU worker processes (the demo's 2)")
    p.add_argument("--micro-batch-tokens", type=int, default=2048,
                   help="hpcrl's packed micro-batch budget (a step's 4 pairs per worker, ~230 tokens, fit in one)")
    p.add_argument("--trl-threads", type=int, default=0,
                   help="TRL's torch threads (default: --workers, hpcrl's compute threads)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", os.path.join(REPO, ".venv-trl/bin/python")))
    p.add_argument("--timeout", type=float, default=None, help="seconds per side and round (default: none)")
    p.add_argument("--keep", metavar="DIR", help="keep the runs' files (logs, metrics, exported weights) in DIR")
    p.add_argument("--trl-child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        with open(args.trl_child[0]) as f:
            spec = json.load(f)
        res = trl_child(spec)
        with open(args.trl_child[1], "w") as f:
            json.dump(res, f)
        return
    if args.pairs % args.workers:
        p.error("--pairs must be a multiple of --workers (every DP rank gets whole pairs)")
    args.trl_threads = args.trl_threads or args.workers
    if not os.path.isfile(args.trl_python):
        p.error(f"{args.trl_python}: no TRL interpreter; run `bash tools/setup_trl_venv.sh` (makes .venv-trl)")
    for need in (os.path.join(MODEL, "config.json"), TRAIN_FILE, VAL_FILE):
        if not os.path.isfile(os.path.join(REPO, need)):
            p.error(f"{need} is missing: run `make models data`")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    os.environ.update({k: env[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM")})
    tmp = args.keep or tempfile.mkdtemp(prefix="hpcrl-bench-dpo-")
    os.makedirs(tmp, exist_ok=True)
    try:
        prepared = _prepare(args)
        scorer = HeldOutScorer(prepared["model"], prepared["val"], args.beta)
        print(f"[bench] {args.steps} steps x {args.pairs} pairs ({sum(prepared['step_tokens'])} prompt + chosen + "
              f"rejected tokens), {len(prepared['val'])} held-out pairs; files in {tmp}", flush=True)
        rounds = []
        for k in range(1, args.rounds + 1):
            rtmp = os.path.join(tmp, f"round{k}")
            os.makedirs(rtmp, exist_ok=True)
            h = _run_hpcrl(args, rtmp, env)
            h["score"] = scorer.accuracy(h["weights"])
            r = _run_trl(args, rtmp, prepared, env)
            r["score"] = scorer.accuracy(r["weights"])
            if not args.keep:  # ~0.5 GB of weights per side and round
                shutil.rmtree(h["weights"], ignore_errors=True)
                shutil.rmtree(r["weights"], ignore_errors=True)
            rounds.append({"hpcrl": h, "trl": r, "step_tokens": prepared["step_tokens"], "trl_rows": prepared["train"]})
            _round_report(k, args, h, r, prepared["step_tokens"])
        _final_report(args, rounds, scorer.reference_logps_accuracy(), len(prepared["val"]))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
