"""Controller program for tests/test_megatron_engine.py: one 1 + 4 rank world, every check.

    python launchers/hpcrl_entry.py tests/programs/megatron_checks.py OUT.json   (under the command
    hpcrl.launch.mpiexec_command(4, ...) builds: see tests/test_megatron_engine.py)

Rank 0 drives the Megatron roles through worker groups, compares against HuggingFace
transformers on the controller, and writes what it measured to OUT.json.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "models" / "tiny-qwen2")
SMOLLM2 = str(REPO / "models" / "smollm2-135m-instruct")


def make_cfg(model: str, tp: int, pp: int, **actor: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from hpcrl.config import load_config

    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"model.path={model}", f"actor.parallel.tensor_parallel={tp}", f"actor.parallel.pipeline_parallel={pp}",
        "actor.micro_batch_tokens=400", "actor.optim.lr=1e-5", "actor.optim.clip_grad=1.0",
        "critic.parallel.tensor_parallel=2", "critic.optim.lr=3e-3", "critic.micro_batch_tokens=400",
        *[f"actor.{k}={v}" for k, v in actor.items()]])
    return OmegaConf.to_container(cfg, resolve=True)


def text_batch(model: str, n: int):
    """Chat-formatted arithmetic prompts with answers: real text, right-padded."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from hpcrl.controller import Batch

    tok = AutoTokenizer.from_pretrained(model)
    rows = pq.read_table(REPO / "data" / "arith" / "train.parquet").slice(0, n).to_pylist()
    seqs, prompt_lens = [], []
    for r in rows:
        prompt = tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        p = tok(prompt)["input_ids"]
        a = tok(r["extra_info"]["answer"])["input_ids"]
        seqs.append(p + a)
        prompt_lens.append(len(p))
    s = max(map(len, seqs))
    ids = torch.zeros(n, s, dtype=torch.long)
    attn = torch.zeros(n, s, dtype=torch.long)
    resp = torch.zeros(n, s)
    for i, (q, pl) in enumerate(zip(seqs, prompt_lens)):
        ids[i, :len(q)] = torch.tensor(q)
        attn[i, :len(q)] = 1
        resp[i, pl:len(q)] = 1
    return Batch({"input_ids": ids, "attention_mask": attn, "response_mask": resp})


def hf_logprobs(model: str, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i in range(len(batch)):
            n = int(batch["attention_mask"][i].sum())
            ids = batch["input_ids"][i, :n]
            lp = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)
            out[i, 1:n] = lp[:-1].gather(-1, ids[1:, None])[:, 0]
    return out


def make_tiny_reward_model(out: Path) -> str:
    """The tiny model as a one-label sequence classifier with a seeded random score head."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForSequenceClassification

    lm = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    cfg = lm.config
    cfg.num_labels = 1
    rm = Qwen2ForSequenceClassification(cfg).to(torch.float32)
    rm.model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        rm.score.weight.copy_(torch.randn(rm.score.weight.shape, generator=torch.Generator().manual_seed(3)))
    rm.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(out)
    return str(out)


def hf_sequence_scores(model: str, batch) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for i in range(len(batch)):
            n = int(batch["attention_mask"][i].sum())
            out.append(float(hf(batch["input_ids"][i, :n][None]).logits[0, 0]))
    return torch.tensor(out)


def load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def main() -> None:
    from hpcrl.controller import WorkerGroup, get_runtime
    from hpcrl.workers.batching import arrange_minibatches
    from hpcrl.workers.megatron_roles import MegatronRole

    out_path = sys.argv[1]
    workers = get_runtime().world.size - 1
    # 4 CPU workers in CI; on a GPU machine one worker per GPU, so fewer layouts may fit
    layouts = [(tp, pp) for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)] if workers % (tp * pp) == 0]
    res: dict[str, Any] = {"timings": {}, "workers": workers, "cuda": torch.cuda.is_available()}
    tmp = Path(tempfile.mkdtemp(prefix="hpcrl-mcore-"))
    t_all = time.time()

    def timed(name: str, t0: float) -> None:
        res["timings"][name] = round(time.time() - t0, 1)
        print(f"[megatron_checks] {name}: {res['timings'][name]} s", flush=True)

    # 1. log-probs vs HF, every layout, tiny model; packed vs padded at TP=2 PP=2
    batch = text_batch(TINY, 8)
    ref = hf_logprobs(TINY, batch)
    mask = batch["attention_mask"].clone()
    mask[:, 0] = 0
    res["logprob_tiny"] = {}
    for tp, pp in layouts:
        t0 = time.time()
        actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": make_cfg(TINY, tp, pp), "role": "actor"},
                            name=f"tiny-{tp}x{pp}")
        lp = actor.compute_logprob(batch)
        res["logprob_tiny"][f"{tp}x{pp}"] = {"max_abs": float(((lp - ref).abs() * mask).max()),
                                              "dp": actor.layout.dp_size}
        res["engine"] = actor.describe()
        if (tp, pp) == layouts[-1]:
            actor.set_packing(False, 3)
            padded = actor.compute_logprob(batch)
            actor.set_packing(True)
            res["packed_vs_padded"] = {"max_abs": float(((lp - padded).abs() * mask).max()),
                                       "padded_vs_hf": float(((padded - ref).abs() * mask).max())}
            # HF -> Megatron (TP=2 PP=2) -> HF through the real model, bit for bit
            actor.export_hf(str(tmp / "tiny-rt"))
            a, b = load_safetensors_dir(TINY), load_safetensors_dir(str(tmp / "tiny-rt"))
            res["round_trip_tiny"] = {"same_keys": sorted(a) == sorted(b),
                                      "bit_exact": all(torch.equal(a[k], b[k]) for k in a if k in b),
                                      "files": sorted(p.name for p in (tmp / "tiny-rt").iterdir())}
        timed(f"logprob tiny {tp}x{pp}", t0)

    # 2. one update: TP=1 PP=1 (DP=4) vs TP=2 PP=2 (DP=1), same batch and loss
    ub = text_batch(TINY, 16)
    g = torch.Generator().manual_seed(0)
    ub["old_logprob"] = hf_logprobs(TINY, ub) - 0.05 * torch.rand(ub["input_ids"].shape, generator=g)
    ub["advantages"] = torch.randn(ub["input_ids"].shape, generator=g)
    res["update"] = {}
    res["update_layouts"] = ["1x1", "{}x{}".format(*layouts[-1])]
    for tp, pp in [(1, 1), layouts[-1]]:
        t0 = time.time()
        cfg = make_cfg(TINY, tp, pp, entropy_coeff=0.01, ppo_mini_batch_size=8)
        actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg, "role": "actor"}, name=f"upd-{tp}x{pp}")
        arranged = arrange_minibatches(copy.copy(ub), 2, actor.layout.dp_size, "token-mean")
        metrics = actor.update_actor(arranged, num_minibatches=2)
        actor.export_hf(str(tmp / f"upd-{tp}x{pp}"))
        res["update"][f"{tp}x{pp}"] = metrics
        timed(f"update tiny {tp}x{pp}", t0)
    big = "{}x{}".format(*layouts[-1])
    w1, w2 = load_safetensors_dir(str(tmp / "upd-1x1")), load_safetensors_dir(str(tmp / f"upd-{big}"))
    w0 = load_safetensors_dir(TINY)
    res["update_weights"] = {"max_abs_diff": max(float((w1[k] - w2[k]).abs().max()) for k in w1),
                             "max_abs_change": max(float((w1[k] - w0[k]).abs().max()) for k in w1)}

    # 3. critic: zero-initialised value head, then fit constant returns
    t0 = time.time()
    cfg = make_cfg(TINY, 2 if workers % 2 == 0 else 1, 1)
    cfg["critic"]["parallel"]["tensor_parallel"] = cfg["actor"]["parallel"]["tensor_parallel"]
    cfg["critic"]["ppo_mini_batch_size"] = 8
    critic = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg, "role": "critic"}, name="critic")
    vb = text_batch(TINY, 8)
    vb["returns"] = torch.ones(vb["input_ids"].shape)
    rmask = vb["response_mask"].bool()
    v0 = critic.compute_values(vb)
    losses, means = [], []
    for _ in range(6):  # PPO style: old values are re-read before every update
        vb["old_values"] = critic.compute_values(vb)
        means.append(float(vb["old_values"][rmask].mean()))
        losses.append(critic.update_critic(arrange_minibatches(vb, 1, critic.layout.dp_size, "token-mean"))["vf_loss"])
    res["critic"] = {"v0_max_abs": float(v0.abs().max()), "losses": losses, "value_means": means}
    timed("critic tiny", t0)

    # 4. reward model: a sequence-classification head read by the engine's value head, vs HF's score
    t0 = time.time()
    from hpcrl.workers.reward_model import RewardModelRole

    rm_path = make_tiny_reward_model(tmp / "tiny-rm")
    tp, pp = layouts[-1]
    cfg = make_cfg(TINY, tp, pp)
    cfg["reward"]["model_path"] = rm_path
    rm = WorkerGroup(RewardModelRole, init_kwargs={"cfg": cfg}, name="reward-model")
    rb = text_batch(TINY, 6)
    scores = rm.compute_scores(rb)
    ref_scores = hf_sequence_scores(rm_path, rb)
    res["reward_model"] = {"layout": f"{tp}x{pp}", "max_abs": float((scores - ref_scores).abs().max()),
                           "spread": float(ref_scores.max() - ref_scores.min()), "n": int(scores.numel())}
    timed("reward model tiny", t0)

    # 5. SmolLM2-135M: log-probs vs HF (9 heads / 3 KV heads: TP can only be 1 or 3 on 4 workers -> 1)
    sb = text_batch(SMOLLM2, 4)
    sref = hf_logprobs(SMOLLM2, sb)
    smask = sb["attention_mask"].clone()
    smask[:, 0] = 0
    res["logprob_smollm2"] = {}
    for tp, pp in [lay for lay in layouts if lay[0] == 1]:
        t0 = time.time()
        cfg = make_cfg(SMOLLM2, tp, pp)
        cfg["actor"]["micro_batch_tokens"] = 256
        actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg, "role": "actor"}, name=f"smol-{tp}x{pp}")
        lp = actor.compute_logprob(sb)
        res["logprob_smollm2"][f"{tp}x{pp}"] = float(((lp - sref).abs() * smask).max())
        if pp == max(p for t, p in layouts if t == 1):
            actor.export_hf(str(tmp / "smol-rt"))
            a, b = load_safetensors_dir(SMOLLM2), load_safetensors_dir(str(tmp / "smol-rt"))
            res["round_trip_smollm2"] = {"same_keys": sorted(a) == sorted(b),
                                         "bit_exact": all(torch.equal(a[k], b[k]) for k in a if k in b)}
        timed(f"logprob smollm2 {tp}x{pp}", t0)

    res["timings"]["total"] = round(time.time() - t_all, 1)
    Path(out_path).write_text(json.dumps(res, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
