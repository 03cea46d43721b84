"""Controller program for tests/test_dpo.py: one 1 + 4 rank world, the DPO update against an independent step.

    python launchers/hpcrl_entry.py tests/programs/dpo_checks.py OUT.json   (under the command
    hpcrl.launch.mpiexec_command(4, ...) builds: see tests/test_dpo.py)

Rank 0 builds DPO actors (hpcrl.workers.megatron_roles.MegatronRole) in several layouts and
micro-batchings, runs one `update_dpo` on the same 8 preference pairs, and compares the gradient
(before clipping) and the metrics with a plain-PyTorch DPO / IPO step on the HF model written here
from the formulas (nothing of hpcrl's loss is imported): the loss must be exact whether a pair's two
responses share a micro-batch (one pass) or not (the extra forward without gradient), at any DP
size and with pipeline stages. Also: `sequence_logprobs` against HF, including a batch with fewer
rows than DP ranks; the count of non-finite steps in a row across a checkpoint's save and load.
Writes what it measured to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "models" / "tiny-qwen2")
PAIRS = 8
BETA = 0.5
# (name, (TP, PP), actor overrides, loss type, label smoothing): together every way a pair can be
# micro-batched. micro_batch_tokens=40 is shorter than any prompt + both responses (and than most
# sequences): every row gets a micro-batch of its own, so every pair is split.
CASES: list[tuple[str, tuple[int, int], dict[str, Any], str, float]] = [
    ("together-tp2", (2, 1), {}, "sigmoid", 0.0),
    ("split-tp2", (2, 1), {"micro_batch_tokens": 40}, "sigmoid", 0.1),
    # whole sequences, 3 to a micro-batch: some pairs together, some apart
    ("no-share-tp2", (2, 1), {"share_prompt": False, "micro_batch_tokens": 130}, "ipo", 0.0),
    ("padded-tp2", (2, 1), {"packing": False, "micro_batch_size": 3}, "sigmoid", 0.0),
    ("split-pp2", (1, 2), {"micro_batch_tokens": 40}, "sigmoid", 0.1),
    ("together-dp4", (1, 1), {}, "ipo", 0.0),
]


def make_cfg(tp: int, pp: int, **actor: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from hpcrl.config import load_config

    cfg = load_config(REPO / "configs" / "dpo_tiny.yaml", [
        f"actor.parallel.tensor_parallel={tp}", f"actor.parallel.pipeline_parallel={pp}", "actor.optim.lr=1e-4",
        *[f"actor.{k}={v}" for k, v in actor.items()]])
    return OmegaConf.to_container(cfg, resolve=True)


def pairs_and_batch() -> tuple[list[tuple[list[int], list[int], list[int]]], Any]:
    """8 pairs of the generated train set as (prompt, chosen, rejected) ids, and their wire batch."""
    from hpcrl.data import PreferenceDataset
    from hpcrl.trainer.dpo import preference_batch

    data = PreferenceDataset([str(REPO / "data" / "pref" / "train.parquet")], TINY)
    pairs = [data[i] for i in range(PAIRS)]
    return [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in pairs], preference_batch(pairs)


def hf_response_logprob(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response | prompt) = sum over the response tokens of log_softmax(logits)[token], fp32."""
    ids = torch.tensor(prompt + response)
    logits = model(input_ids=ids[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return lp[len(prompt) - 1:].sum()


def reference_step(pairs: list[tuple[list[int], list[int], list[int]]], ref_c: torch.Tensor, ref_r: torch.Tensor,
                   loss_type: str, eps: float) -> dict[str, Any]:
    """The gradient of the mean pair loss on the HF model (HF parameter names; a tied lm_head appears
    only as model.embed_tokens.weight), and the metrics:
      h = (pi_c - ref_c) - (pi_r - ref_r)
      sigmoid: L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (Rafailov et al. 2023; Mitchell 2023)
      ipo:     L = (h_avg - 1 / (2 beta))^2, h_avg = (pi_c - ref_c) / |c| - (pi_r - ref_r) / |r|
               (Azar et al. 2023, each log-ratio averaged over its response's tokens as in TRL's DPOTrainer)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    total = torch.zeros(())
    pcs, prs, losses = [], [], []
    for (p, c, r), rc, rr in zip(pairs, ref_c.tolist(), ref_r.tolist(), strict=True):
        pc, pr = hf_response_logprob(model, p, c), hf_response_logprob(model, p, r)
        h = (pc - rc) - (pr - rr)
        if loss_type == "sigmoid":
            loss = -(1 - eps) * F.logsigmoid(BETA * h) - eps * F.logsigmoid(-BETA * h)
        else:
            h_avg = (pc - rc) / len(c) - (pr - rr) / len(r)
            loss = (h_avg - 1 / (2 * BETA)) ** 2
        total = total + loss / len(pairs)
        pcs.append(float(pc))
        prs.append(float(pr))
        losses.append(float(loss))
    total.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    pc_t, pr_t = torch.tensor(pcs, dtype=torch.float64), torch.tensor(prs, dtype=torch.float64)
    rew_c, rew_r = BETA * (pc_t - ref_c), BETA * (pr_t - ref_r)
    metrics = {"loss": sum(losses) / len(losses), "rewards/chosen": float(rew_c.mean()),
               "rewards/rejected": float(rew_r.mean()), "rewards/margins": float((rew_c - rew_r).mean()),
               "rewards/accuracies": float((rew_c > rew_r).double().mean()), "logps/chosen": float(pc_t.mean()),
               "logps/rejected": float(pr_t.mean()), "logps/accuracies": float((pc_t > pr_t).double().mean())}
    return {"grads": grads, "metrics": metrics, "policy": torch.stack([pc_t, pr_t], 1).reshape(-1)}


def merged(per_rank: list) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for part in per_rank:
        out.update(part or {})
    return out


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].float() - b[k].float()).square().sum()) for k in b)
    den = sum(float(b[k].float().square().sum()) for k in b)
    return (num / max(den, 1e-30)) ** 0.5


def main() -> None:
    from hpcrl.controller import WorkerGroup, get_runtime
    from hpcrl.workers.megatron_roles import MegatronRole

    out_path = sys.argv[1]
    res: dict[str, Any] = {"workers": get_runtime().world.size - 1, "cases": {}, "timings": {}}
    pairs, batch = pairs_and_batch()
    # reference sums away from the policy's, different per pair: the pairs' loss slopes differ
    g = torch.Generator().manual_seed(5)
    ref_c = -40.0 - 10.0 * torch.rand(PAIRS, generator=g, dtype=torch.float64)
    ref_r = -40.0 - 10.0 * torch.rand(PAIRS, generator=g, dtype=torch.float64)
    batch["ref_logp"] = torch.stack([ref_c, ref_r], 1).reshape(-1)
    refs = {(t, e): reference_step(pairs, ref_c, ref_r, t, e) for t, e in {(c[3], c[4]) for c in CASES}}
    for name, (tp, pp), actor_opts, loss_type, eps in CASES:
        t0 = time.time()
        actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": make_cfg(tp, pp, **actor_opts), "role": "actor"},
                            name=f"dpo-{name}")
        policy = actor.sequence_logprobs(batch)
        one_row = actor.sequence_logprobs(batch.select([0])) if name == "together-tp2" else None
        actor.record_gradients(True)
        metrics = actor.update_dpo(batch, num_pairs=PAIRS, beta=BETA, loss_type=loss_type, label_smoothing=eps)
        grads = merged([s[0] if s else None for s in actor.recorded_gradients()])
        ref = refs[(loss_type, eps)]
        case = {"layout": f"{tp}x{pp}", "dp": actor.layout.dp_size, "loss_type": loss_type, "label_smoothing": eps,
                "pairs_split": metrics["pairs_split"], "optimizer_steps": metrics["optimizer_steps"],
                "same_names": sorted(ref["grads"]) == sorted(k for k in grads if k in ref["grads"]),
                "grad_rel": rel_diff({k: grads[k] for k in ref["grads"]}, ref["grads"]),
                "metrics": {k: [metrics[k], v] for k, v in ref["metrics"].items()},  # [hpcrl, reference]
                "policy_vs_hf": float((policy - ref["policy"]).abs().max())}
        if one_row is not None:  # fewer rows than DP ranks: one rank scores nothing
            case["one_row"] = {"rows": len(one_row), "vs_hf": float((one_row - ref["policy"][:1]).abs().max())}
        res["cases"][name] = case
        actor.close()
        res["timings"][name] = round(time.time() - t0, 1)
        print(f"[dpo_checks] {name}: {case} ({res['timings'][name]} s)", flush=True)
    # LoRA (actor.lora) at TP=2: the reference is the actor's base with its adapters off
    t0 = time.time()
    actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": make_cfg(2, 1, **{"lora.rank": 4, "lora.alpha": 8,
                                                                            "optim.lr": 1e-2}), "role": "actor"},
                        name="dpo-lora")
    lora_batch = batch.select(range(len(batch)))
    lora_batch["ref_logp"] = actor.sequence_logprobs(lora_batch, adapters=False)
    first = actor.update_dpo(lora_batch, num_pairs=PAIRS, beta=BETA)
    second = actor.update_dpo(lora_batch, num_pairs=PAIRS, beta=BETA)
    hf_policy = refs[("sigmoid", 0.0)]["policy"]
    res["lora"] = {"ref_vs_hf": float((lora_batch["ref_logp"] - hf_policy).abs().max()),
                   "base_after_vs_hf": float((actor.sequence_logprobs(batch, adapters=False) - hf_policy).abs().max()),
                   "adapted_moved": float((actor.sequence_logprobs(batch) - hf_policy).abs().max()),
                   "loss": [first["loss"], second["loss"]], "accuracies": second["rewards/accuracies"]}
    actor.close()
    res["timings"]["lora"] = round(time.time() - t0, 1)
    print(f"[dpo_checks] lora: {res['lora']} ({res['timings']['lora']} s)", flush=True)
    res["nonfinite_resume"] = nonfinite_count_survives_a_checkpoint(batch, Path(out_path).parent / "nonfinite-ckpt")
    Path(out_path).write_text(json.dumps(res, indent=1))


def nonfinite_count_survives_a_checkpoint(batch: Any, ckpt: Path) -> dict[str, Any]:
    """trainer.max_nonfinite_steps counts NaN/Inf steps in a row across a resume: two skipped steps
    (NaN reference log-probs make the loss NaN), a save, a finite step (the count back to 0), the load
    of the save, one more skipped step: the count goes on from the saved 2, to 3."""
    from hpcrl.controller import WorkerGroup
    from hpcrl.workers.megatron_roles import MegatronRole

    t0 = time.time()
    actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": make_cfg(2, 1), "role": "actor"}, name="dpo-nonfinite")
    nan_batch = batch.select(range(len(batch)))
    nan_batch["ref_logp"] = torch.full_like(batch["ref_logp"], float("nan"))

    def in_a_row(b: Any) -> float:
        return actor.update_dpo(b, num_pairs=PAIRS, beta=BETA)["nonfinite_steps_in_a_row"]

    counts = [in_a_row(nan_batch), in_a_row(nan_batch)]
    actor.save_checkpoint(str(ckpt))
    counts.append(in_a_row(batch))
    actor.load_checkpoint(str(ckpt), seed=1)
    counts.append(in_a_row(nan_batch))
    actor.close()
    print(f"[dpo_checks] non-finite count across a checkpoint: {counts} ({time.time() - t0:.1f} s)", flush=True)
    return {"in_a_row": counts}


if __name__ == "__main__":
    main()
