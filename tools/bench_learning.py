"""Learning benchmark (not CI): GRPO on SmolLM2-135M-Instruct over the arithmetic set, hpcrl and TRL's
GRPOTrainer side by side from one run, same model, data, batch and hyper-parameters.

    .venv/bin/python tools/bench_learning.py --trl-python .venv-trl/bin/python [--steps 5 --val-samples 32]

Prints the per-step mean training reward of both (the learning curves), greedy validation accuracy on
the same first K validation prompts before and after N steps, and training throughput (prompt +
generated tokens per second of training-step wall time, model loading, start-up and validation
excluded) with the hpcrl / TRL ratio. The goals it checks: hpcrl's tokens/s >= 1.5x TRL's (median of
the rounds), and, as a mean over the rounds, hpcrl's training reward over the second half of the steps
(6-10 of 10) and its validation reward after training not below TRL's (and the accuracy gain, per round).
`--engine fsdp` trains hpcrl's side on the FSDP engine (actor.engine=fsdp) instead of Megatron-core.
`--seeds 1 2 3` runs one round per seed; `--report DIR/round1 ...` prints that summary again from runs
kept with `--keep`, running nothing.

hpcrl: `hpcrl run configs/grpo_smollm2.yaml` with overrides (2 CPU workers, fp32, Megatron-core
trainer + vLLM rollout colocated). TRL: GRPOTrainer in its own venv (tools/setup_trl_venv.sh makes
.venv-trl), CPU torch, generating with HF generate, in one process with as many torch threads as
hpcrl has worker processes. The two run in alternating rounds (--rounds, default 3: hpcrl, TRL,
hpcrl, TRL, ...), each round printed with its load average and the host's steal time; the result is
the median of the rounds' tokens/s ratios. Both score with hpcrl's builtin scorer
(hpcrl.rewards.builtin.compute_score, imported in the TRL process: it needs neither torch nor omegaconf).

Matched settings (TRL's names in brackets): 8 prompts x G=4 samples per step [generation_batch_size 32,
num_generations 4]; 2 optimizer steps of 16 samples per step, old log-probs from before the first
[per_device_train_batch_size 16, gradient_accumulation_steps 1, steps_per_generation 2,
num_iterations 1; one hpcrl step = two TRL optimizer steps]; max_new_tokens 64 [max_completion_length];
temperature 1.0, top_p 1, no top-k; AdamW lr 1e-5 constant, no warm-up, betas (0.9, 0.999), eps 1e-8,
weight decay 0, grad-norm clip 1.0; KL beta 0 (no reference model); PPO clip 0.2 both sides, no dual
clip; token-mean loss over each 16-sample mini-batch [loss_type "bnpo": sum of token losses / token
count of the local batch, which with one process and no gradient accumulation is exactly that
mini-batch; "dapo" divides by the generation batch's token count / 2, equal only on average], the
mini-batches cut from a shuffle of the samples [TRL's way; hpcrl's actor.minibatch_by=sample, which
--minibatch-by prompt turns back to hpcrl's default]; group
std-normalised advantages [scale_rewards "group"]; fp32 [bf16 False]; no gradient checkpointing
(TRL's default is on); same prompts in the same order (the bench hands TRL the train rows in the
order hpcrl's sampler draws them, shuffle_dataset False); same chat template (prompt token ids
checked equal, and each step's prompt ids in GRPOTrainer's loss inputs checked against hpcrl's);
reward = acc + 0.2 x format, with format 0 for a completion cut at max_new_tokens.
What differs is listed under "settings that differ" in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/grpo_smollm2.yaml"
nan = float("nan")
STEP_LINE = re.compile(r"(step \d+/\d+|validation after|worker groups ready|Traceback|Error)")

OPTIMIZER = {
    "megatron": "Megatron-core's Adam (fp32 main params) vs torch AdamW; same betas, eps, lr, no decay",
    "fsdp": "torch AdamW on both sides (hpcrl: --engine fsdp, over its FSDP2 fp32 shards, the gradients "
            "reduce-scattered over 2 ranks); same betas, eps, lr, no decay",
}
OLD_LOGPROB = {
    "rollout": "hpcrl takes vLLM's (--old-logprob rollout, the demo config's actor.old_logprob; equal to the "
               "actor's within ~1e-5 in fp32), TRL computes them with a forward of its model",
    "recompute": "both compute them with a forward of the model being trained (hpcrl: --old-logprob recompute)",
}
MINIBATCH = {
    "sample": "both cut them from a shuffle of the samples, with different random streams (hpcrl: "
              "--minibatch-by sample); inside a mini-batch hpcrl puts a prompt's samples on one rank, where it "
              "packs the prompt once (the order inside a mini-batch does not change the update)",
    "prompt": "hpcrl cuts them from a seeded shuffle of the prompts, each prompt's samples together "
              "(--minibatch-by prompt, hpcrl's default); TRL from a shuffle of the samples",
}
DIFFERENCES = [
    "generation: hpcrl samples with vLLM (CPU), TRL with HF generate; different random streams, so the "
    "sampled completions (and the curves) differ even from the same weights",
    "mini-batches: {minibatch}",
    "old log-probs: {old_logprob}",
    "advantage epsilon: (r - mean) / (std + 1e-6) in hpcrl, (std + 1e-4) in TRL (unbiased std in both)",
    "optimizer: {optimizer}",
    "transformers: {hpcrl_tf} in .venv (hpcrl, vLLM's pin) vs {trl_tf} in .venv-trl (what TRL installs)",
    "validation generation: vLLM greedy (hpcrl) vs HF generate greedy with left padding (TRL); the "
    "'before' accuracies of the same initial model can differ by float rounding on near ties",
    "threads: hpcrl runs 2 worker processes x 1 thread (+ controller); TRL one process x 2 threads",
]


# ---------------------------------------------------------------- shared helpers (stdlib only)
def _score(compute_score, data_source: str, text: str, truth: str, ids: list[int], eos: int, max_new: int,
           format_weight: float) -> dict:
    """hpcrl's rule: truncated = hit max_new_tokens without ending on EOS (as PPOTrainer.score)."""
    truncated = len(ids) >= max_new and (not ids or ids[-1] != eos)
    return compute_score(data_source, text, truth, format_weight=format_weight, truncated=truncated)


def _trl_grad_norms(steps: list[dict], logs: list[dict], per: int) -> None:
    """Each step's gradient norm before clipping from TRL's log records (one per optimizer step): the
    mean over the step's `per` optimizer steps, as hpcrl's actor/grad_norm."""
    norms = [x["grad_norm"] for x in logs if "grad_norm" in x]
    for k, st in enumerate(steps):
        mine = norms[k * per:(k + 1) * per]
        st["grad_norm"] = statistics.fmean(mine) if len(mine) == per else nan


# ---------------------------------------------------------------- TRL side (runs in .venv-trl)
def trl_child(spec: dict) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, REPO)
    from hpcrl.rewards.builtin import compute_score

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    h = spec["hparams"]
    t_load = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    eos = tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    load_s = time.perf_counter() - t_load

    def ids_of(messages: list[dict]) -> list[int]:
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    mismatched = sum(ids_of(r["prompt"]) != r["hpcrl_prompt_ids"] for r in spec["train"] + spec["val"])

    def validate(label: str) -> dict:
        """Greedy answers on the validation rows, scored like hpcrl's validate()."""
        t = time.perf_counter()
        model.eval()
        gen = GenerationConfig(do_sample=False, max_new_tokens=h["max_new_tokens"], eos_token_id=eos,
                               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
        accs, scores = [], []
        rows = spec["val"]
        for i in range(0, len(rows), h["val_batch_size"]):
            chunk = rows[i:i + h["val_batch_size"]]
            prompts = [ids_of(r["prompt"]) for r in chunk]
            width = max(len(p) for p in prompts)
            input_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen)
            for r, row in zip(chunk, out[:, width:].tolist(), strict=True):
                ids = row[:row.index(eos) + 1] if eos in row else row
                res = _score(compute_score, r["data_source"], tok.decode(ids, skip_special_tokens=True),
                             r["ground_truth"], ids, eos, h["max_new_tokens"], h["format_weight"])
                accs.append(res["acc"])
                scores.append(res["score"])
        res = {"acc": sum(accs) / len(accs), "reward_mean": sum(scores) / len(scores), "samples": len(accs),
               "time_s": time.perf_counter() - t}
        print(f"[trl] validation {label}: acc {res['acc']:.4f} reward {res['reward_mean']:.4f} "
              f"({res['time_s']:.1f} s)", flush=True)
        return res

    val_before = validate("before training")

    rollouts: list[dict] = []

    def arith_reward(prompts, completions, completion_ids, data_source, ground_truth, **kwargs):
        scores, accs = [], []
        for ids, src, truth in zip(completion_ids, data_source, ground_truth, strict=True):
            res = _score(compute_score, src, tok.decode(ids, skip_special_tokens=True), truth, list(ids), eos,
                         h["max_new_tokens"], h["format_weight"])
            scores.append(res["score"])
            accs.append(res["acc"])
        rollouts.append({"reward_mean": sum(scores) / len(scores), "acc": sum(accs) / len(accs),
                         "response_length_mean": sum(len(i) for i in completion_ids) / len(completion_ids)})
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.steps: list[dict] = []
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append({"opt_step": state.global_step, "time_s": time.perf_counter() - self.t0,
                               "tokens_seen": int(state.num_input_tokens_seen)})
            if state.global_step % h["opt_steps_per_step"] == 0:
                k = state.global_step // h["opt_steps_per_step"]
                s = self.steps[-h["opt_steps_per_step"]:]
                r = rollouts[-1] if rollouts else {}
                print(f"[trl] step {k}/{spec['steps']} | reward {r.get('reward_mean', float('nan')):.3f} | "
                      f"acc {r.get('acc', float('nan')):.3f} | len {r.get('response_length_mean', 0):.1f} | "
                      f"time {sum(x['time_s'] for x in s):.1f}s", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    train = Dataset.from_list([{"prompt": r["prompt"], "data_source": r["data_source"],
                                "ground_truth": r["ground_truth"]} for r in spec["train"]])
    cfg = GRPOConfig(
        output_dir=os.path.join(spec["tmp"], "trl_out"), max_steps=spec["steps"] * h["opt_steps_per_step"],
        per_device_train_batch_size=h["mini_batch"], gradient_accumulation_steps=1,
        steps_per_generation=h["opt_steps_per_step"], num_iterations=1, num_generations=h["n"],
        max_completion_length=h["max_new_tokens"], temperature=h["temperature"], top_p=1.0, top_k=0,
        learning_rate=h["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=h["clip_grad"], optim="adamw_torch",
        beta=0.0, epsilon=h["clip"], epsilon_high=h["clip"], loss_type="bnpo", scale_rewards="group",
        mask_truncated_completions=False, shuffle_dataset=False, bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none", seed=spec["seed"],
        disable_tqdm=True, dataloader_num_workers=0, use_vllm=False)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=arith_reward, args=cfg, train_dataset=train,
                          processing_class=tok, callbacks=[timer])
    captured: list[dict] = []
    snapshots: dict[int, dict] = {}
    trained_prompts: list[list[tuple]] = []  # each optimizer step's prompt ids, as GRPOTrainer tokenized them
    compute_loss = trainer._compute_loss
    if spec.get("capture"):  # tools/bench_update_trl.py: the weights after the steps it names (and, in
        class Snapshots(TrainerCallback):  # recording_loss, each optimizer step's inputs in TRL's order)
            def on_step_end(self, args, state, control, model=None, **kwargs):
                k, rest = divmod(state.global_step, h["opt_steps_per_step"])
                if not rest and k in spec["capture_steps"]:
                    snapshots[k] = {n: v.detach().clone() for n, v in model.state_dict().items()}

        trainer.add_callback(Snapshots())

    def recording_loss(model, inputs):
        trained_prompts.append([tuple(ids[m.bool()].tolist()) for ids, m in
                                zip(inputs["prompt_ids"], inputs["prompt_mask"], strict=True)])
        if spec.get("capture"):
            captured.append({k: inputs[k].detach().clone() for k in
                             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                              "old_per_token_logps") if inputs.get(k) is not None})
        return compute_loss(model, inputs)

    trainer._compute_loss = recording_loss
    t = time.perf_counter()
    trainer.train()
    train_wall_s = time.perf_counter() - t
    model = trainer.model
    if spec.get("capture"):
        torch.save({"steps": spec["steps"], "minibatches": captured, "weights_after": snapshots,
                    "grad_norms": [x["grad_norm"] for x in timer.logs if "grad_norm" in x]}, spec["capture"])
    val_after = validate(f"after {spec['steps']} steps")

    per = h["opt_steps_per_step"]
    steps, seen = [], 0
    for k in range(spec["steps"]):
        s = timer.steps[k * per:(k + 1) * per]
        tokens = s[-1]["tokens_seen"] - seen
        seen = s[-1]["tokens_seen"]
        steps.append({"step": k + 1, "time_s": sum(x["time_s"] for x in s), "tokens": tokens, **rollouts[k],
                      "phases": {"opt step with generation": s[0]["time_s"],
                                 "opt steps without": sum(x["time_s"] for x in s[1:])}})
    _trl_grad_norms(steps, timer.logs, per)
    # The prompts TRL trained on, as its own tokenizer call made them (not the bench's apply_chat_template):
    # each step's mini-batches must hold the step's hpcrl prompt ids, each n times.
    prompts_per_step = len(spec["train"]) // spec["steps"]
    other_prompts = [k + 1 for k in range(spec["steps"])
                     if sorted(p for mb in trained_prompts[k * per:(k + 1) * per] for p in mb)
                     != sorted(tuple(r["hpcrl_prompt_ids"]) for r in
                               spec["train"][k * prompts_per_step:(k + 1) * prompts_per_step] for _ in range(h["n"]))]
    logged_step_time = [x["step_time"] for x in timer.logs if "step_time" in x]
    return {"versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__},
            "load_s": load_s, "train_wall_s": train_wall_s, "val_before": val_before, "val_after": val_after,
            "steps": steps, "prompt_ids_mismatched": mismatched, "steps_on_other_prompts": other_prompts,
            "threads": torch.get_num_threads(),
            "trl_logged_step_time_sum": sum(logged_step_time), "trl_logged_num_tokens": seen,
            "rollout_calls": len(rollouts), "trl_logs": timer.logs}


# ---------------------------------------------------------------- driver (runs in .venv)
def _overrides(args: argparse.Namespace, run_dir: str) -> list[str]:
    return [f"trainer.run_dir={run_dir}", f"trainer.total_steps={args.steps}", f"trainer.val_every={args.steps}",
            f"data.val_max_samples={args.val_samples}", f"data.val_batch_size={args.val_batch_size}",
            f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
            "rollout.top_p=1.0", "rollout.top_k=-1", f"actor.optim.lr={args.lr}", "actor.optim.lr_schedule=constant",
            "actor.optim.warmup_steps=0", "actor.optim.weight_decay=0.0", f"actor.optim.clip_grad={args.clip_grad}",
            f"actor.ppo_mini_batch_size={args.mini_batch}", "actor.ppo_epochs=1",
            f"actor.clip_ratio_low={args.clip}", f"actor.clip_ratio_high={args.clip}",
            "actor.loss_agg_mode=token-mean", "actor.entropy_coeff=0.0", "actor.use_kl_loss=false",
            "algorithm.adv_estimator=grpo", "algorithm.policy_loss=ppo_clip", "algorithm.norm_adv_by_std=true",
            "algorithm.use_kl_in_reward=false", "algorithm.dynamic_sampling=false", "algorithm.overlong_buffer=0",
            "reward.function=builtin", f"reward.format_weight={args.format_weight}", "model.dtype=fp32",
            f"trainer.workers_per_node={args.workers}", "trainer.nnodes=1", "trainer.device=cpu",
            f"data.seed={args.seed}", f"trainer.seed={args.seed}", "checkpoint.save_every=0",
            "logging.tensorboard=false",
            f"rollout.cpu_kv_cache_gib={'null' if args.kv_cache_gib is None else args.kv_cache_gib}",
            f"actor.micro_batch_tokens={args.micro_batch_tokens}", f"actor.minibatch_by={args.minibatch_by}",
            f"actor.old_logprob={args.old_logprob}", f"actor.engine={args.engine}"]


def _prepare(args: argparse.Namespace, overrides: list[str]) -> dict:
    """The rows both sides see: the train prompts in the order hpcrl's sampler draws them for the
    first N steps, and the first K validation prompts; with hpcrl's prompt token ids."""
    sys.path.insert(0, REPO)
    from hpcrl.config import load_config
    from hpcrl.data import PromptDataset, ShuffledSampler

    cfg = load_config(os.path.join(REPO, CONFIG), overrides)
    d = cfg.data
    tok = cfg.model.tokenizer_path or cfg.model.path
    train = PromptDataset(list(d.train_files), tok, d.prompt_key, d.max_prompt_length)
    val = PromptDataset(list(d.val_files), tok, d.prompt_key, d.max_prompt_length)
    sampler = ShuffledSampler(len(train), d.train_batch_size, d.seed, d.shuffle)
    order = [i for _ in range(args.steps) for i in sampler.next_batch()]

    import pyarrow.parquet as pq

    def raw(files: list[str]) -> list[dict]:
        return [r for f in files for r in pq.read_table(f).to_pylist()]

    raw_train, raw_val = raw(list(d.train_files)), raw(list(d.val_files))
    if train.num_filtered or val.num_filtered:
        raise SystemExit("bench: some prompts are longer than data.max_prompt_length; row indices would not "
                         "line up with the parquet rows")

    def row(ds, rows: list[dict], i: int) -> dict:
        p = ds[i]
        return {"prompt": rows[i][d.prompt_key], "data_source": p.data_source, "ground_truth": p.ground_truth,
                "hpcrl_prompt_ids": p.prompt_ids}

    return {"model": os.path.abspath(cfg.model.path), "train": [row(train, raw_train, i) for i in order],
            "val": [row(val, raw_val, i) for i in range(min(args.val_samples, len(val)))]}


class LoadSampler:
    """The 1-minute load average every 10 s while one side runs (the machine is shared)."""

    def __init__(self) -> None:
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(10.0):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        s = self.samples or [os.getloadavg()[0]]
        return {"mean": statistics.fmean(s), "max": max(s)}


def steal_seconds() -> float:
    """Host steal time so far, all CPUs (/proc/stat): time the hypervisor gave to others."""
    fields = open("/proc/stat").readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def _stream(cmd: list[str], log_path: str, prefix: str, env: dict, timeout: float | None) -> int:
    """Run cmd with its output in log_path; echo the progress lines."""
    t = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if prefix == "trl" and line.startswith("[trl]"):
                print("  " + line.rstrip(), flush=True)
            elif prefix == "hpcrl" and STEP_LINE.search(line):
                print(f"  [{prefix}] " + line.rstrip()[:240], flush=True)
            if timeout and time.time() - t > timeout:
                proc.kill()
                break
        return proc.wait()


def _run_hpcrl(args: argparse.Namespace, tmp: str, overrides: list[str], env: dict) -> dict:
    run_dir = os.path.join(tmp, "hpcrl")
    cmd = [os.path.join(REPO, ".venv", "bin", "hpcrl"), "run", CONFIG, *overrides]
    print("[bench] hpcrl: " + " ".join(cmd[1:]), flush=True)
    t = time.time()
    load = LoadSampler()
    rc = _stream(cmd, os.path.join(tmp, "hpcrl.log"), "hpcrl", env, args.timeout)
    load = load.stop()
    wall = time.time() - t
    if rc != 0:
        print(open(os.path.join(tmp, "hpcrl.log")).read()[-4000:])
        raise SystemExit(f"bench: hpcrl run failed (exit {rc})")
    return {**_read_hpcrl(run_dir, args.steps), "wall_s": wall, "load": load}


def _read_hpcrl(run_dir: str, n_steps: int) -> dict:
    """hpcrl's per-step records and validations from a finished run directory."""
    import yaml  # .venv's (omegaconf's dependency); the driver runs there, the TRL child does not

    steps = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if x.strip()]
    val: dict[int, dict] = {}
    for x in open(os.path.join(run_dir, "validation.jsonl")):
        if x.strip():
            r = json.loads(x)
            val[r["after_steps"]] = r
    out = []
    for m in steps:
        step_s = m["time/step"]
        out.append({"step": m["step"], "time_s": step_s - m.get("time/validate", 0.0),
                    "tokens": m["throughput/tokens_per_s"] * step_s, "reward_mean": m["reward/mean"],
                    "acc": m.get("reward/acc", float("nan")), "response_length_mean": m["response_length/mean"],
                    "validate_s": m.get("time/validate", 0.0), "grad_norm": m.get("actor/grad_norm", float("nan")),
                    "phases": {k[5:]: v for k, v in m.items() if k.startswith("time/") and k not in
                               ("time/step", "time/validate", "time/to_training")}})
    saved = open(os.path.join(run_dir, "config.yaml")).read()
    cut = re.search(r"^\s*minibatch_by:\s*(\w+)", saved, re.M)
    old = re.search(r"^\s*old_logprob:\s*(\w+)", saved, re.M)
    return {"steps": out, "val_before": val[0], "val_after": val[n_steps],
            "minibatch_by": cut.group(1) if cut else "prompt",  # runs from before the option cut by prompt
            "old_logprob": old.group(1) if old else "rollout",
            "engine": (yaml.safe_load(saved).get("actor") or {}).get("engine") or "megatron"}


def _run_trl(args: argparse.Namespace, tmp: str, prepared: dict, env: dict, capture: str | None = None) -> dict:
    spec = {"tmp": tmp, "steps": args.steps, "seed": args.seed, "threads": args.trl_threads, **prepared,
            "capture": capture, "capture_steps": sorted({1, 2, args.steps // 2, args.steps}),
            "hparams": {"n": args.n, "mini_batch": args.mini_batch,
                        "opt_steps_per_step": args.prompts * args.n // args.mini_batch,
                        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "lr": args.lr,
                        "clip": args.clip, "clip_grad": args.clip_grad, "format_weight": args.format_weight,
                        "val_batch_size": args.val_batch_size}}
    spec_path, out_path = os.path.join(tmp, "trl_spec.json"), os.path.join(tmp, "trl.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [args.trl_python, os.path.abspath(__file__), "--trl-child", spec_path, out_path]
    print(f"[bench] TRL: {args.trl_python} (GRPOTrainer, {args.trl_threads} torch threads)", flush=True)
    t = time.time()
    load = LoadSampler()
    rc = _stream(cmd, os.path.join(tmp, "trl.log"), "trl", {**env, "OMP_NUM_THREADS": str(args.trl_threads)},
                 args.timeout)
    load = load.stop()
    if rc != 0:
        print(open(os.path.join(tmp, "trl.log")).read()[-4000:])
        raise SystemExit(f"bench: TRL run failed (exit {rc})")
    with open(out_path) as f:
        res = json.load(f)
    res["wall_s"] = time.time() - t
    res["load"] = load
    return res


def _throughput(steps: list[dict], skip_first: bool) -> float:
    s = steps[1:] if skip_first and len(steps) > 1 else steps
    return sum(x["tokens"] for x in s) / sum(x["time_s"] for x in s)


def _report(args: argparse.Namespace, h: dict, r: dict, load: tuple[float, float]) -> None:
    v = r["versions"]
    print(f"\n=== GRPO learning benchmark: SmolLM2-135M-Instruct, arithmetic, {args.steps} steps x "
          f"{args.prompts} prompts x {args.n} samples, {args.prompts * args.n // args.mini_batch} optimizer steps "
          f"of {args.mini_batch} per step, max_new_tokens {args.max_new_tokens}, lr {args.lr:g}")
    trainer = "FSDP2 over the HF model" if h.get("engine") == "fsdp" else "Megatron-core"
    print(f"hpcrl: {args.workers} CPU workers ({trainer} + vLLM), fp32 | TRL {v['trl']} GRPOTrainer, "
          f"transformers {v['transformers']}, torch {v['torch']}, {r['threads']} threads, fp32")
    print(f"machine: {os.cpu_count()} cores, shared; 1-min load average while hpcrl ran: mean {h['load']['mean']:.1f} "
          f"(max {h['load']['max']:.1f}), while TRL ran: mean {r['load']['mean']:.1f} (max {r['load']['max']:.1f}); "
          f"{load[0]:.1f} at start, {load[1]:.1f} at end. Times are noisy.")
    if r["prompt_ids_mismatched"]:
        print(f"WARNING: {r['prompt_ids_mismatched']} prompts tokenize differently under TRL's transformers")
    if r.get("steps_on_other_prompts"):  # absent in runs kept before the check
        print(f"WARNING: in steps {r['steps_on_other_prompts']} GRPOTrainer's prompt ids were not hpcrl's "
              "(checked from its loss inputs)")
    elif "steps_on_other_prompts" in r:
        print("prompts: TRL trained on hpcrl's prompt token ids in every step (checked from GRPOTrainer's loss inputs)")
    print("\nper-step training rollouts (mean over the step's samples; reward = acc + "
          f"{args.format_weight:g} x format)")
    print("(gnorm: the gradient norm before clipping, mean over the step's optimizer steps)")
    print(f"{'step':>4} | {'hpcrl reward':>12} {'acc':>6} {'len':>5} {'gnorm':>5} {'time s':>7} {'tokens':>6} | "
          f"{'TRL reward':>10} {'acc':>6} {'len':>5} {'gnorm':>5} {'time s':>7} {'tokens':>6}")
    for a, b in zip(h["steps"], r["steps"], strict=True):
        print(f"{a['step']:>4} | {a['reward_mean']:12.3f} {a['acc']:6.3f} {a['response_length_mean']:5.1f} "
              f"{a.get('grad_norm', nan):5.2f} {a['time_s']:7.1f} {a['tokens']:6.0f} | {b['reward_mean']:10.3f} "
              f"{b['acc']:6.3f} {b['response_length_mean']:5.1f} {b.get('grad_norm', nan):5.2f} {b['time_s']:7.1f} "
              f"{b['tokens']:6.0f}")
    mean = lambda s, k: statistics.fmean(x.get(k, nan) for x in s)
    print(f"{'mean':>4} | {mean(h['steps'], 'reward_mean'):12.3f} {mean(h['steps'], 'acc'):6.3f} "
          f"{mean(h['steps'], 'response_length_mean'):5.1f} {mean(h['steps'], 'grad_norm'):5.2f} {'':7} {'':6} | "
          f"{mean(r['steps'], 'reward_mean'):10.3f} {mean(r['steps'], 'acc'):6.3f} "
          f"{mean(r['steps'], 'response_length_mean'):5.1f} {mean(r['steps'], 'grad_norm'):5.2f}")

    hb, ha, tb, ta = h["val_before"]["acc"], h["val_after"]["acc"], r["val_before"]["acc"], r["val_after"]["acc"]
    k = int(h["val_before"].get("samples", args.val_samples))
    print(f"\nvalidation: greedy accuracy on the first {k} validation prompts (same prompts, same scorer)")
    print(f"{'':24}{'hpcrl':>10}{'TRL':>10}")
    print(f"{'before training':24}{hb:10.3f}{tb:10.3f}")
    print(f"{f'after {args.steps} steps':24}{ha:10.3f}{ta:10.3f}")
    print(f"{'gain':24}{ha - hb:+10.3f}{ta - tb:+10.3f}")
    print(f"{'mean val reward before':24}{h['val_before']['reward_mean']:10.3f}{r['val_before']['reward_mean']:10.3f}")
    print(f"{'mean val reward after':24}{h['val_after']['reward_mean']:10.3f}{r['val_after']['reward_mean']:10.3f}")

    print("\nthroughput: (prompt + generated) tokens / training-step wall time (no loading, start-up or validation)")
    print(f"{'':32}{'hpcrl':>10}{'TRL':>10}{'ratio':>9}")
    for label, skip in ((f"all {args.steps} steps", False), ("steps 2.. (no first-step warm-up)", True)):
        if skip and args.steps < 2:
            continue
        th, tt = _throughput(h["steps"], skip), _throughput(r["steps"], skip)
        print(f"{label:32}{th:10.1f}{tt:10.1f}{th / tt:8.2f}x")
    ts_h, ts_r = sum(x["time_s"] for x in h["steps"]), sum(x["time_s"] for x in r["steps"])
    print(f"{'training time (s)':32}{ts_h:10.1f}{ts_r:10.1f}")
    print(f"{'whole run incl. start-up (s)':32}{h['wall_s']:10.1f}{r['wall_s']:10.1f}")
    for name, side in (("hpcrl", h), ("TRL", r)):
        phases: dict[str, float] = {}
        for x in side["steps"]:
            for key, secs in x["phases"].items():
                phases[key] = phases.get(key, 0.0) + secs
        print(f"{name} time by phase (s, all steps): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    print(f"(TRL's own step_time metric sums to {r['trl_logged_step_time_sum']:.1f} s; TRL counted "
          f"{r['trl_logged_num_tokens']} tokens, hpcrl {sum(x['tokens'] for x in h['steps']):.0f})")

    ratio = _throughput(h["steps"], False) / _throughput(r["steps"], False)
    lh, lr = _learning(h), _learning(r)
    print("\ngoals (this round; over several seeds see the summary at the end)")
    print(f"  accuracy gain >= TRL's : {ha - hb:+.3f} vs {ta - tb:+.3f} -> "
          f"{'met' if ha - hb >= ta - tb else 'NOT met'}")
    print(f"  training reward, {_tail_label(h)} >= TRL's : {lh['train_reward']:.3f} vs {lr['train_reward']:.3f} -> "
          f"{'met' if lh['train_reward'] >= lr['train_reward'] else 'NOT met'}")
    print(f"  validation reward after training >= TRL's : {lh['val_reward_after']:.3f} vs "
          f"{lr['val_reward_after']:.3f} -> {'met' if lh['val_reward_after'] >= lr['val_reward_after'] else 'NOT met'}")
    print(f"  tokens/s >= 1.5x TRL's : {ratio:.2f}x -> {'met' if ratio >= 1.5 else 'NOT met'}")
    print(f"  (with {args.steps} steps and {k} validation prompts one answer is {1 / k:.3f} of accuracy: "
          "small runs are noisy; scale with --steps / --val-samples)")
    print("\nsettings that differ (could not be removed):")
    import transformers

    for line in DIFFERENCES:
        print(f"  - {line}".format(hpcrl_tf=transformers.__version__, trl_tf=v["transformers"],
                                   minibatch=MINIBATCH[h["minibatch_by"]],
                                   old_logprob=OLD_LOGPROB[h.get("old_logprob", "rollout")],
                                   optimizer=OPTIMIZER[h.get("engine", "megatron")]))


def _tail(side: dict) -> list[dict]:
    """The second half of the steps (6-10 of 10): the training reward once learning has had time."""
    steps = side["steps"]
    return steps[len(steps) // 2:]


def _tail_label(side: dict) -> str:
    t = _tail(side)
    return f"steps {t[0]['step']}-{t[-1]['step']}"


def _learning(side: dict) -> dict:
    return {"train_reward": statistics.fmean(x["reward_mean"] for x in _tail(side)),
            "val_acc_before": side["val_before"]["acc"], "val_acc_after": side["val_after"]["acc"],
            "val_reward_before": side["val_before"]["reward_mean"],
            "val_reward_after": side["val_after"]["reward_mean"]}


def _summary(rounds: list[dict]) -> None:
    """Per round (seed) and mean over rounds: the learning numbers the goals compare, and the median
    tokens/s ratio. Each round: {"seed", "hpcrl", "trl", "ratio"} (tokens/s without step 1)."""
    h0 = rounds[0]["hpcrl"]
    print(f"\n=== summary over {len(rounds)} round(s): training reward = mean over {_tail_label(h0)}; "
          f"validation greedy on {int(h0['val_before'].get('samples', 0))} prompts")
    print(f"{'seed':>4} | {'hpcrl train':>11} {'val acc':>13} {'val reward':>13} | "
          f"{'TRL train':>9} {'val acc':>13} {'val reward':>13} | tokens/s ratio")
    rows = []
    for rd in rounds:
        lh, lr = _learning(rd["hpcrl"]), _learning(rd["trl"])
        rows.append((lh, lr))
        ratio = f"{rd['ratio']:.2f}x" if rd.get("ratio") else "-"
        print(f"{rd['seed']:>4} | {lh['train_reward']:11.3f} {lh['val_acc_before']:6.3f}->{lh['val_acc_after']:.3f} "
              f"{lh['val_reward_before']:6.3f}->{lh['val_reward_after']:.3f} | {lr['train_reward']:9.3f} "
              f"{lr['val_acc_before']:6.3f}->{lr['val_acc_after']:.3f} "
              f"{lr['val_reward_before']:6.3f}->{lr['val_reward_after']:.3f} | {ratio}")
    m = lambda side, k: statistics.fmean(row[side][k] for row in rows)
    print(f"{'mean':>4} | {m(0, 'train_reward'):11.3f} {m(0, 'val_acc_before'):6.3f}->{m(0, 'val_acc_after'):.3f} "
          f"{m(0, 'val_reward_before'):6.3f}->{m(0, 'val_reward_after'):.3f} | {m(1, 'train_reward'):9.3f} "
          f"{m(1, 'val_acc_before'):6.3f}->{m(1, 'val_acc_after'):.3f} "
          f"{m(1, 'val_reward_before'):6.3f}->{m(1, 'val_reward_after'):.3f} |")
    if len(rows) > 1:
        # the rounds pair the two sides by seed (same prompts, same validation rows): the mean of the
        # per-seed differences with its standard error tells a real difference from seed-to-seed noise
        print("hpcrl - TRL per seed, mean +- standard error (a mean within 2 standard errors of 0 is not a "
              "difference these seeds can show):")
        for key, label in (("train_reward", "training reward"), ("val_reward_after", "validation reward after")):
            d = [row[0][key] - row[1][key] for row in rows]
            se = statistics.stdev(d) / len(d) ** 0.5
            print(f"  {label}: " + " ".join(f"{x:+.3f}" for x in d) + f" -> {statistics.fmean(d):+.3f} +- {se:.3f}")
    norms = [[x.get("grad_norm", nan) for rd in rounds for x in rd[side]["steps"]] for side in ("hpcrl", "trl")]
    print("gradient norm before clipping, mean over the steps of all rounds (a check of the loss scale): "
          f"hpcrl {statistics.fmean(norms[0]):.3f}, TRL {statistics.fmean(norms[1]):.3f}")
    print(f"goals (mean of {len(rows)} round(s))")
    for key, label in (("train_reward", f"training reward, {_tail_label(h0)}"),
                       ("val_reward_after", "validation reward after training")):
        a, b = m(0, key), m(1, key)
        print(f"  {label} >= TRL's : {a:.3f} vs {b:.3f} -> {'met' if a >= b else 'NOT met'}")
    ratios = [rd["ratio"] for rd in rounds if rd.get("ratio")]
    if ratios:
        med = statistics.median(ratios)
        print(f"  tokens/s >= 1.5x TRL's (median of {len(ratios)} round(s), without step 1): {med:.2f}x -> "
              f"{'met' if med >= 1.5 else 'NOT met'}")


def _read_kept(round_dir: str) -> dict:
    """A round kept with --keep (ROUND_DIR holds hpcrl/ and trl.json), for --report."""
    spec_path = os.path.join(round_dir, "trl_spec.json")
    need = (spec_path, os.path.join(round_dir, "trl.json"), os.path.join(round_dir, "hpcrl", "metrics.jsonl"))
    if not all(os.path.isfile(x) for x in need):
        raise SystemExit(f"bench: {round_dir} is not a finished round kept with --keep "
                         "(it needs trl_spec.json, trl.json and hpcrl/metrics.jsonl)")
    with open(spec_path) as f:
        spec = json.load(f)
    with open(os.path.join(round_dir, "trl.json")) as f:
        r = json.load(f)
    if "trl_logs" in r:  # rounds kept before the per-step norms were recorded
        _trl_grad_norms(r["steps"], r["trl_logs"], spec["hparams"]["opt_steps_per_step"])
    h = _read_hpcrl(os.path.join(round_dir, "hpcrl"), spec["steps"])
    return {"seed": spec["seed"], "hpcrl": h, "trl": r,
            "ratio": _throughput(h["steps"], True) / _throughput(r["steps"], True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="training steps (rollout + updates) on both sides")
    p.add_argument("--val-samples", type=int, default=32, help="first K validation prompts, greedy")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (G)")
    p.add_argument("--mini-batch", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--format-weight", type=float, default=0.2)
    p.add_argument("--val-batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="hpcrl CPU workers")
    p.add_argument("--micro-batch-tokens", type=int, default=512,
                   help="hpcrl's packed micro-batch budget (memory only: the loss weights are per mini-batch); "
                        "at the config's 1024 a worker reached 8.9 GB in the update and was OOM-killed here")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="hpcrl's vLLM CPU KV cache per worker in GiB (default: sized to the step by hpcrl)")
    p.add_argument("--minibatch-by", choices=("sample", "prompt"), default="sample",
                   help="hpcrl's actor.minibatch_by: sample (default: TRL's cut) or prompt (hpcrl's default: each "
                        "prompt's samples in one mini-batch; faster, and no different in learning over 12 seeds)")
    p.add_argument("--old-logprob", choices=("rollout", "recompute"), nargs="+", default=["rollout"],
                   help="hpcrl's actor.old_logprob: rollout (vLLM's log-probs, the demo's) or recompute (a forward "
                        "of the actor, as TRL does); both (`--old-logprob rollout recompute`) run one hpcrl side "
                        "per mode in every round, their order alternating, and report a ratio per mode")
    p.add_argument("--engine", choices=("megatron", "fsdp"), default="megatron",
                   help="hpcrl's training engine (actor.engine): Megatron-core or FSDP2 over the HF model")
    p.add_argument("--trl-threads", type=int, default=0, help="TRL torch threads (default: = --workers)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--seeds", type=int, nargs="+", metavar="SEED",
                   help="one alternating hpcrl / TRL round per seed (overrides --seed and --rounds); the summary "
                        "gives each seed's learning numbers, their mean and the median tokens/s ratio")
    p.add_argument("--rounds", type=int, default=3, help="alternating hpcrl / TRL rounds (the full report is "
                   "printed for the first; the tokens/s ratio of every round and their median at the end)")
    p.add_argument("--report", nargs="+", metavar="ROUND_DIR",
                   help="run nothing: print the summary of rounds kept with --keep (e.g. DIR/round1 of several "
                        "seeds' runs)")
    p.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", os.path.join(REPO, ".venv-trl/bin/python")))
    p.add_argument("--timeout", type=float, default=None, help="seconds per side (default: none)")
    p.add_argument("--keep", metavar="DIR", help="keep the runs' files (logs, metrics) in DIR")
    p.add_argument("--trl-child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        with open(args.trl_child[0]) as f:
            spec = json.load(f)
        res = trl_child(spec)
        with open(args.trl_child[1], "w") as f:
            json.dump(res, f)
        return
    if args.report:
        _summary([_read_kept(d) for d in args.report])
        return
    if (args.prompts * args.n) % args.mini_batch:
        p.error("--prompts x --n must be a multiple of --mini-batch")
    args.trl_threads = args.trl_threads or args.workers
    if not os.path.isfile(args.trl_python):
        p.error(f"{args.trl_python}: no TRL interpreter; run `bash tools/setup_trl_venv.sh` (makes .venv-trl)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    tmp = args.keep or tempfile.mkdtemp(prefix="hpcrl-bench-learning-")
    os.makedirs(tmp, exist_ok=True)
    load0 = os.getloadavg()[0]
    seeds = args.seeds or [args.seed] * args.rounds
    try:
        # Alternating rounds (hpcrl, TRL, hpcrl, TRL, ...): a host's speed drifts over minutes (steal
        # time, other tenants), so one half of each cannot tell a change from the weather. Every
        # round is printed with its load and steal time; the median ratio is the result.
        modes = list(dict.fromkeys(args.old_logprob))
        rounds: dict[str, list[dict]] = {m: [] for m in modes}
        prepared_seed = None
        for k, seed in enumerate(seeds):
            args.seed = seed
            if seed != prepared_seed:  # the seed orders the prompts
                args.old_logprob = modes[0]
                prepared = _prepare(args, _overrides(args, os.path.join(tmp, "hpcrl")))
                prepared_seed = seed
                print(f"[bench] seed {seed}: {args.steps} steps x {args.prompts} prompts, "
                      f"{len(prepared['val'])} validation prompts; files in {tmp}", flush=True)
            rtmp = os.path.join(tmp, f"round{k + 1}")
            os.makedirs(rtmp, exist_ok=True)
            # with several modes each round runs them in turn, the order reversed every other round, then TRL
            order = modes if k % 2 == 0 else modes[::-1]
            sides, steals = {}, {}
            for mode in order:
                args.old_logprob = mode
                mtmp = rtmp if len(modes) == 1 else os.path.join(rtmp, f"old-{mode}")
                os.makedirs(mtmp, exist_ok=True)
                steal0 = steal_seconds()
                sides[mode] = _run_hpcrl(args, mtmp, _overrides(args, os.path.join(mtmp, "hpcrl")), env)
                shutil.rmtree(os.path.join(mtmp, "hpcrl", "checkpoints"), ignore_errors=True)  # ~2 GB of weights
                steals[mode] = steal_seconds() - steal0
            steal1 = steal_seconds()
            r = _run_trl(args, rtmp, prepared, env)
            steal_trl = steal_seconds() - steal1
            tt = _throughput(r["steps"], True)
            lr = _learning(r)
            for mode in modes:
                h = sides[mode]
                th = _throughput(h["steps"], True)
                rounds[mode].append({"seed": seed, "hpcrl": h, "trl": r, "ratio": th / tt})
                lh = _learning(h)
                print(f"[bench] round {k + 1}/{len(seeds)} (seed {seed}, hpcrl engine={args.engine} "
                      f"old_logprob={mode}): tokens/s (without step 1) hpcrl {th:.1f}, TRL {tt:.1f}, "
                      f"ratio {th / tt:.2f}x; training reward "
                      f"{_tail_label(h)} hpcrl {lh['train_reward']:.3f} / TRL {lr['train_reward']:.3f}; validation "
                      f"reward after hpcrl {lh['val_reward_after']:.3f} / TRL {lr['val_reward_after']:.3f}; load "
                      f"hpcrl {h['load']['mean']:.2f} / TRL {r['load']['mean']:.2f}; steal hpcrl "
                      f"{steals[mode]:.1f} s / TRL {steal_trl:.1f} s", flush=True)
                if k == 0:
                    _report(args, h, r, (load0, os.getloadavg()[0]))
        for mode in modes:
            ratios = [rd["ratio"] for rd in rounds[mode]]
            print(f"\n[bench] tokens/s ratio hpcrl (old_logprob={mode}) / TRL (without step 1) per round: "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}x "
                  f"(goal >= 1.5x: {'met' if statistics.median(ratios) >= 1.5 else 'NOT met'})")
        for mode in modes:
            if len(modes) > 1:
                print(f"\n### hpcrl with actor.old_logprob={mode}")
            _summary(rounds[mode])
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
