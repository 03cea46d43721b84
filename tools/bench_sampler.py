"""Sampler check (not CI): are hpcrl's rollouts drawn from the model's own distribution, and are HF
generate's (what TRL's GRPOTrainer samples with on CPU)?

    .venv/bin/python tools/bench_sampler.py [--prompts 32 --n 8 --temperature 1.0 --max-new-tokens 64]

From the demo model (SmolLM2-135M-Instruct, fp32) and the first P training prompts (chat template, as
hpcrl's PromptDataset tokenizes them), it samples n completions per prompt twice: with hpcrl's
RolloutEngine (vLLM, one request per sample with its own seed, prefix caching on, as in training) and
with HF `generate` on the prompts left-padded into one batch (do_sample, top_k 0, top_p 1, as TRL's
GRPOTrainer calls it). Every sample is then scored by one independent HF forward of prompt + completion
without padding: at each completion position t, d_t = -log p_T(x_t | prefix) - H_T(prefix), with p_T the
model's distribution at temperature T and H_T its entropy. For an exact sampler E[d_t | prefix] = 0 at
every position whatever the prefix, so the mean of d over all tokens is 0 within its standard error
(the d_t form a martingale difference sequence: sd / sqrt(tokens) is the standard error). A sampler
that draws from a flatter or sharper distribution shows a mean d above or below 0.
Also printed: mean completion length and the fraction ending in EOS, with standard errors.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _prompts(path: str, model: str, count: int) -> list[list[int]]:
    from hpcrl.data import PromptDataset

    ds = PromptDataset([path], model, "prompt", 256)
    return [list(ds[i].prompt_ids) for i in range(min(count, len(ds)))]


def sample_vllm(model: str, prompts: list[list[int]], n: int, temperature: float, max_new: int,
                seed: int) -> list[list[int]]:
    """hpcrl's rollout path: RolloutEngine.generate in a one-rank torch.distributed world."""
    import torch.distributed as dist

    from hpcrl.engines.vllm.engine import RolloutEngine, SamplingSettings

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rdzv", rank=0, world_size=1)
    engine = RolloutEngine(model, seed=seed, cpu_kv_cache_gib=0.5)
    groups = engine.generate(prompts, SamplingSettings(n=n, temperature=temperature, top_p=1.0, top_k=-1,
                                                       max_new_tokens=max_new, seed=seed))
    return [list(c.token_ids) for g in groups for c in g]


def sample_hf(model, tok, prompts: list[list[int]], n: int, temperature: float, max_new: int,
              seed: int) -> list[list[int]]:
    """HF generate on the left-padded batch, each prompt repeated n times (as TRL's GRPOTrainer)."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    gen = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new,
                           eos_token_id=tok.eos_token_id, pad_token_id=pad, bos_token_id=tok.bos_token_id)
    out = []
    with torch.no_grad():
        for i in range(0, len(rows), 32):  # chunks of whole prompts' samples keep the memory small
            res = model.generate(input_ids=ids[i:i + 32], attention_mask=mask[i:i + 32], generation_config=gen)
            for row in res[:, width:].tolist():
                out.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return out


def score(model, prompts: list[list[int]], completions: list[list[int]], n: int, temperature: float) -> list[float]:
    """d_t = -log p_T(x_t) - H_T at every completion token, one unpadded forward per sequence."""
    import torch

    ds: list[float] = []
    with torch.no_grad():
        for k, c in enumerate(completions):
            p = prompts[k // n]
            if not c:
                continue
            x = torch.tensor([p + c])
            logits = model(input_ids=x).logits[0, len(p) - 1:-1].double() / temperature
            logp = torch.log_softmax(logits, -1)
            ent = -(logp.exp() * logp).sum(-1)
            nll = -logp.gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)
            ds += (nll - ent).tolist()
    return ds


def summary(name: str, comps: list[list[int]], ds: list[float], eos: int, max_new: int) -> dict:
    lens = [len(c) for c in comps]
    ended = [1.0 if c and c[-1] == eos else 0.0 for c in comps]
    se = lambda xs: statistics.stdev(xs) / math.sqrt(len(xs))
    out = {"name": name, "len": statistics.fmean(lens), "len_se": se(lens), "eos": statistics.fmean(ended),
           "eos_se": se(ended), "d": statistics.fmean(ds), "d_se": se(ds), "tokens": len(ds)}
    print(f"{name:>18}: {len(comps)} completions, {len(ds)} tokens | length {out['len']:.2f} +- {out['len_se']:.2f}"
          f" | ended with EOS {out['eos']:.3f} +- {out['eos_se']:.3f} (the rest cut at {max_new}) | "
          f"mean(-log p - H) {out['d']:+.4f} +- {out['d_se']:.4f} ({out['d'] / out['d_se']:+.1f} standard errors)",
          flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(REPO, "models/smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(REPO, "data/arith/train.parquet"))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if not os.path.isdir(args.model):
        raise SystemExit(f"bench_sampler: no model at {args.model} (run `make models`)")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(f"[sampler] load average {os.getloadavg()[0]:.2f}; {args.prompts} prompts x {args.n} samples, "
          f"T={args.temperature}, max_new_tokens {args.max_new_tokens}", flush=True)
    prompts = _prompts(args.data, args.model, args.prompts)
    tok = AutoTokenizer.from_pretrained(args.model)
    t = time.perf_counter()
    v = sample_vllm(args.model, prompts, args.n, args.temperature, args.max_new_tokens, args.seed)
    print(f"[sampler] vLLM (hpcrl's RolloutEngine) sampled in {time.perf_counter() - t:.1f} s", flush=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    t = time.perf_counter()
    h = sample_hf(model, tok, prompts, args.n, args.temperature, args.max_new_tokens, args.seed)
    print(f"[sampler] HF generate sampled in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    dv, dh = (score(model, prompts, c, args.n, args.temperature) for c in (v, h))
    print(f"[sampler] scored in {time.perf_counter() - t:.1f} s (one HF forward per sample, no padding)\n")
    a = summary("hpcrl (vLLM)", v, dv, tok.eos_token_id, args.max_new_tokens)
    b = summary("HF generate", h, dh, tok.eos_token_id, args.max_new_tokens)
    diff = (a["len"] - b["len"]) / math.hypot(a["len_se"], b["len_se"])
    print(f"\nlength difference hpcrl - HF: {a['len'] - b['len']:+.2f} ({diff:+.1f} standard errors); "
          f"EOS rate difference {a['eos'] - b['eos']:+.3f}")
    print("an exact sampler has mean(-log p - H) within about 2 standard errors of 0; "
          f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
