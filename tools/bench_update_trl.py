"""hpcrl's update and TRL GRPOTrainer's from the same completions (a check, not CI): do the two
trainers move the weights the same way on identical data?

    .venv/bin/python tools/bench_update_trl.py [--seed 1 --steps 10] [--keep DIR]

tools/bench_learning.py compares two runs whose completions differ (vLLM and HF generate draw from
different random streams), so a gap in their learning curves mixes the update with the draw. Here:

1. TRL (in .venv-trl) runs bench_learning's GRPOTrainer for --steps steps and keeps the inputs of
   each optimizer step (prompt and completion ids, masks, advantages: each 16-sample mini-batch in
   the order TRL drew it) and its weights after steps 1, 2, steps/2 and --steps.
2. hpcrl's actor (Megatron-core, configs/grpo_smollm2.yaml with bench_learning's overrides, on
   --workers CPU ranks) starts from the same model and takes the same optimizer steps on those
   mini-batches, in that order, with TRL's advantages and its own old log-probs (hpcrl's
   actor.old_logprob: recompute), as its trainer would.
3. After each kept step: how far the two updates (weights minus the initial weights) are apart,
   |dW_hpcrl - dW_trl| / |dW_trl|, and the gradient norms before clipping of both sides.

A difference in the loss, its normalisation, the clipping or the optimizer shows from step 1 on
(the CI tests bound hpcrl against an independent plain-PyTorch step at 1% in fp32: see
tests/test_megatron_engine.py). Later steps start from weights that already differ by float
rounding, and the PPO ratio clip can turn that into tokens in or out of the loss, so the gap may
grow a little step by step; a growth that keeps the updates' directions (cosine near 1) is rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)


# ---------------------------------------------------------------- hpcrl side (rank 0 of a 1 + W world)
def world_main() -> int:
    """Replays TRL's kept optimizer steps on hpcrl's actor; writes the comparison to OUT."""
    import torch
    from omegaconf import OmegaConf

    sys.path.insert(0, REPO)
    from hpcrl.config import load_config
    from hpcrl.controller import Batch, WorkerGroup
    from hpcrl.workers.batching import arrange_minibatches
    from hpcrl.workers.megatron_roles import MegatronRole

    capture_path, out_path, *overrides = sys.argv[1:]
    cap = torch.load(capture_path, weights_only=False)
    cfg = OmegaConf.to_container(load_config(os.path.join(REPO, "configs", "grpo_smollm2.yaml"), overrides),
                                 resolve=True)
    cfg["actor"]["old_logprob"] = "recompute"
    per = len(cap["minibatches"]) // cap["steps"]
    max_new = cfg["rollout"]["max_new_tokens"]
    actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg, "role": "actor"}, name="actor")
    w0 = first(actor.hf_weights())
    rows = []
    for step in range(1, cap["steps"] + 1):
        mbs = cap["minibatches"][(step - 1) * per:step * per]
        batch = step_batch(mbs, Batch)
        batch["old_logprob"] = actor.compute_logprob(batch, response_only=True)
        arranged = arrange_minibatches(batch, per, actor.layout.dp_size, "token-mean")  # TRL's order, not shuffled
        m = actor.update_actor(arranged, num_minibatches=per, epochs=1)
        trl_norms = cap["grad_norms"][(step - 1) * per:step * per]
        row = {"step": step, "grad_norm_hpcrl": m["grad_norm"], "grad_norm_trl": sum(trl_norms) / len(trl_norms),
               "clipfrac_hpcrl": m.get("pg_clipfrac", math.nan),
               "response_tokens": int(batch["response_mask"].sum()),
               "at_limit": sum(int(n) >= max_new for mb in mbs for n in mb["completion_mask"].sum(-1))}
        if step in cap["weights_after"]:
            row.update(compare(first(actor.hf_weights()), trl_named(cap["weights_after"][step]), w0))
        rows.append(row)
        print(f"[hpcrl] step {step}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in row.items() if k != "step"), flush=True)
    actor.close()
    with open(out_path, "w") as f:
        json.dump(rows, f)
    return 0


def first(per_rank: list) -> dict:
    """The one non-None dict that hf_weights returns (TP rank 0 of DP replica 0; PP 1)."""
    return next(x for x in per_rank if x is not None)


def trl_named(state: dict) -> dict:
    """TRL's model state HF-named as hpcrl exports it (the tied lm_head is the embedding)."""
    return {k: v for k, v in state.items() if k != "lm_head.weight"}


def step_batch(minibatches: list[dict], batch_cls: type):
    """TRL's mini-batches of one step (left-padded prompts, right-padded completions, a mask up to and
    with the first EOS) as hpcrl's right-padded rows: prompt + completion, the completion the response."""
    import torch

    seqs, prompt_lens, advantages = [], [], []
    for mb in minibatches:
        for i in range(len(mb["prompt_ids"])):
            p = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()].tolist()
            c = mb["completion_ids"][i][mb["completion_mask"][i].bool()].tolist()
            seqs.append(p + c)
            prompt_lens.append(len(p))
            advantages.append(float(mb["advantages"][i]))
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    resp = torch.zeros(len(seqs), width)
    adv = torch.zeros(len(seqs), width)
    prompts: dict[tuple, int] = {}
    index = []
    for i, (s, pl) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        resp[i, pl:len(s)] = 1
        adv[i, pl:len(s)] = advantages[i]
        index.append(prompts.setdefault(tuple(s[:pl]), len(prompts)))
    return batch_cls({"input_ids": ids, "attention_mask": attn, "response_mask": resp, "advantages": adv,
                      "prompt_index": torch.tensor(index)})


def compare(hpcrl_w: dict, trl_w: dict, w0: dict) -> dict:
    """|dW_h - dW_t| / |dW_t| over all weights, the cosine of the two updates, and |dW_t| / |W0|."""

    if sorted(hpcrl_w) != sorted(trl_w):
        raise SystemExit(f"weight names differ: {sorted(set(hpcrl_w) ^ set(trl_w))[:6]}")
    diff = dot = nh = nt = n0 = 0.0
    for k in trl_w:
        dh = (hpcrl_w[k].double() - w0[k].double())
        dt = (trl_w[k].double() - w0[k].double())
        diff += float((dh - dt).pow(2).sum())
        dot += float((dh * dt).sum())
        nh += float(dh.pow(2).sum())
        nt += float(dt.pow(2).sum())
        n0 += float(w0[k].double().pow(2).sum())
    return {"update_rel_diff": math.sqrt(diff / nt), "update_cosine": dot / math.sqrt(nh * nt),
            "update_norm_ratio": math.sqrt(nh / nt), "trl_update_size": math.sqrt(nt / n0)}


# ---------------------------------------------------------------- driver (runs in .venv)
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--workers", type=int, default=2, help="hpcrl CPU ranks (data parallel)")
    p.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", os.path.join(REPO, ".venv-trl/bin/python")))
    p.add_argument("--keep", metavar="DIR", help="keep the TRL capture, logs and results in DIR")
    args = p.parse_args()
    if not os.path.isfile(args.trl_python):
        p.error(f"{args.trl_python}: no TRL interpreter; run `bash tools/setup_trl_venv.sh` (makes .venv-trl)")
    sys.path.insert(0, TOOLS)
    import bench_learning as bl

    from hpcrl.launch import entry_argv, mpiexec_command

    # bench_learning's defaults (its argparse), this run's seed, steps and workers
    a = types.SimpleNamespace(steps=args.steps, val_samples=32, val_batch_size=32, prompts=8, n=4, max_new_tokens=64,
                              temperature=1.0, lr=1e-5, clip_grad=1.0, mini_batch=16, clip=0.2, format_weight=0.2,
                              workers=args.workers, seed=args.seed, kv_cache_gib=None, micro_batch_tokens=512,
                              minibatch_by="sample", trl_threads=args.workers, trl_python=args.trl_python,
                              timeout=None)
    tmp = args.keep or tempfile.mkdtemp(prefix="hpcrl-bench-update-")
    os.makedirs(tmp, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    try:
        overrides = bl._overrides(a, os.path.join(tmp, "hpcrl"))
        prepared = bl._prepare(a, overrides)
        capture = os.path.join(tmp, "trl_capture.pt")
        t = time.time()
        steal0 = bl.steal_seconds()
        trl = bl._run_trl(a, tmp, prepared, env, capture=capture)
        print(f"[bench] TRL: {args.steps} steps in {time.time() - t:.0f} s, validation reward "
              f"{trl['val_before']['reward_mean']:.3f} -> {trl['val_after']['reward_mean']:.3f}; load "
              f"{trl['load']['mean']:.2f}, steal {bl.steal_seconds() - steal0:.1f} s", flush=True)
        out = os.path.join(tmp, "hpcrl_replay.json")
        cmd = mpiexec_command(args.workers, entry_argv(os.path.abspath(__file__) + ":world_main",
                                                       [capture, out, *overrides],
                                                       python=os.path.join(REPO, ".venv", "bin", "python")))
        t, steal0 = time.time(), bl.steal_seconds()
        load = bl.LoadSampler()
        log_path = os.path.join(tmp, "hpcrl_replay.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                log.write(line)
                if line.startswith("[hpcrl]"):
                    print("  " + line.rstrip(), flush=True)
            rc = proc.wait()
        load = load.stop()
        if rc:
            print(open(log_path).read()[-4000:])
            raise SystemExit(f"bench: the hpcrl replay failed (exit {rc}); its log: {log_path}")
        rows = json.load(open(out))
        print(f"[bench] hpcrl replayed {args.steps} steps in {time.time() - t:.0f} s; load {load['mean']:.2f}, "
              f"steal {bl.steal_seconds() - steal0:.1f} s\n")
        _report(rows, trl)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _report(rows: list[dict], trl: dict) -> None:
    print("step | responses: tokens at limit | grad norm before clip: hpcrl   TRL | update vs TRL's: rel diff "
          "cosine norm ratio | TRL's |dW|/|W0|")
    for r in rows:
        tail = (f"{r['update_rel_diff']:8.4f} {r['update_cosine']:8.5f} {r['update_norm_ratio']:8.4f} | "
                f"{r['trl_update_size']:.2e}" if "update_rel_diff" in r else "")
        print(f"{r['step']:4d} | {r['response_tokens']:10d} {r['at_limit']:8d} | {r['grad_norm_hpcrl']:22.4f} "
              f"{r['grad_norm_trl']:7.4f} | {tail}")


if __name__ == "__main__":
    main()
