"""Qwen3 and Qwen3-MoE checks, run in the Megatron world of tests/programs/megatron_checks.py (its 4
workers; `HPCRL_CHECKS=moe` runs only these). Results go to res["moe"]; tests/test_megatron_engine.py
asserts on them.

- log-probs against HF transformers for the tiny Qwen3 and Qwen3-MoE at 1x1, TP=2, PP=2 and EP=2
  (and EP=4), packed rows of several sequences;
- HF -> Megatron -> HF round trip of the MoE model at TP=2 x EP=2 (every expert from its EP rank);
- one update of the MoE model at EP=1 (DP=4), EP=2 (DP=4) and TP=2 SP x EP=2 (DP=2): the same weights
  after it, with the routing metrics, and the load-balancing term seen in the router's update;
- the dense Qwen3 through the independent reference PPO step (fp32, 1x1 and 2x1).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from megatron_checks import (
    REF_CLIP_GRAD,
    REF_EPOCHS,
    REF_LR,
    REF_MINI,
    REF_SEED,
    REF_T,
    REPO,
    hf_logprobs,
    load_safetensors_dir,
    make_cfg,
    merged,
    reference_batch,
    reference_errors,
    run_reference,
    text_batch,
)

QWEN3 = str(REPO / "models" / "tiny-qwen3")
QWEN3_MOE = str(REPO / "models" / "tiny-qwen3-moe")


def moe_cfg(model: str, tp: int, pp: int, ep: int = 1, sp: bool = False, **actor: Any) -> dict[str, Any]:
    cfg = make_cfg(model, tp, pp, **actor)
    cfg["actor"]["parallel"].update(expert_parallel=ep, sequence_parallel=sp)
    return cfg


def logprob_checks(workers: int, res: dict[str, Any], tmp: Path, timed: Any) -> None:
    from hpcrl.controller import WorkerGroup
    from hpcrl.workers.megatron_roles import MegatronRole

    res["logprob"] = {}
    for model, name in ((QWEN3, "qwen3"), (QWEN3_MOE, "qwen3-moe")):
        batch = text_batch(model, 4, samples=2)
        ref = hf_logprobs(model, batch)
        mask = batch["attention_mask"].clone()
        mask[:, 0] = 0
        layouts = [(1, 1, 1), (2, 1, 1), (1, 2, 1)]
        if model == QWEN3_MOE:
            layouts += [(1, 1, 2), (2, 1, 2), (1, 1, 4)]
        for tp, pp, ep in layouts:
            if workers % (tp * pp) or (workers // (tp * pp)) % ep:
                continue
            t0 = time.time()
            key = f"{name}-{tp}x{pp}" + (f"-ep{ep}" if ep > 1 else "")
            actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": moe_cfg(model, tp, pp, ep), "role": "actor"},
                                name=key)
            lp = actor.compute_logprob(batch)
            res["logprob"][key] = {"max_abs": float(((lp - ref).abs() * mask).max()),
                                   "engine": {k: v for k, v in actor.describe().items()
                                              if k in ("tp", "pp", "dp", "ep", "experts")}}
            if (model, tp, ep) == (QWEN3_MOE, 2, 2):
                # HF -> Megatron (TP=2, EP=2: each rank 4 of the 8 experts, half of each) -> HF, bit for bit
                actor.export_hf(str(tmp / "moe-rt"))
                a, b = load_safetensors_dir(model), load_safetensors_dir(str(tmp / "moe-rt"))
                res["round_trip"] = {"same_keys": sorted(a) == sorted(b), "keys": len(a),
                                     "bit_exact": all(torch.equal(a[k], b[k]) for k in a if k in b)}
            actor.close()
            timed(f"moe log-probs {key}", t0)


def update_checks(workers: int, res: dict[str, Any], tmp: Path, timed: Any) -> None:
    """One update (2 mini-batches) of the MoE model at three expert layouts: the same weights."""
    from hpcrl.controller import WorkerGroup
    from hpcrl.workers.batching import arrange_minibatches
    from hpcrl.workers.megatron_roles import MegatronRole

    ub = text_batch(QWEN3_MOE, 16)
    g = torch.Generator().manual_seed(0)
    ub["old_logprob"] = hf_logprobs(QWEN3_MOE, ub) - 0.05 * torch.rand(ub["input_ids"].shape, generator=g)
    ub["advantages"] = torch.randn(ub["input_ids"].shape, generator=g)
    w0 = load_safetensors_dir(QWEN3_MOE)
    res["update"] = {}
    weights = {}
    layouts = [("ep1", 1, 1, False, 0.0), ("ep2", 1, 2, False, 0.0), ("tp2-sp-ep2", 2, 2, True, 0.0),
               # the same update with the load-balancing loss: only the routers (and what they feed) differ
               ("ep2-aux", 1, 2, False, 0.5), ("ep1-aux", 1, 1, False, 0.5)]
    layouts.append(("ep2-z", 1, 2, False, 0.0))  # the router z-loss alone (coefficient below)
    for name, tp, ep, sp, aux in layouts:
        if workers % tp or (workers // tp) % ep:
            continue
        t0 = time.time()
        cfg = moe_cfg(QWEN3_MOE, tp, 1, ep, sp, ppo_mini_batch_size=8, entropy_coeff=0.01)
        cfg["actor"]["moe"] = {"aux_loss_coeff": aux, "z_loss_coeff": 0.05 if name == "ep2-z" else 0.0}
        cfg["actor"]["optim"]["lr"] = 1e-3
        actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg, "role": "actor"}, name=f"moe-upd-{name}")
        arranged = arrange_minibatches(copy.copy(ub), 2, actor.layout.dp_size, "token-mean")
        metrics = actor.update_actor(arranged, num_minibatches=2)
        weights[name] = merged(actor.hf_weights())
        res["update"][name] = {k: v for k, v in metrics.items()
                               if k.startswith("moe/") or k in ("grad_norm", "pg_loss")}
        actor.close()
        timed(f"moe update {name}", t0)
    base = weights["ep1"]

    def norm(d: dict[str, torch.Tensor], keys: list[str]) -> float:
        return float(torch.stack([d[k].double().norm() for k in keys]).norm())

    def max_rel(a: dict[str, torch.Tensor], keys: list[str]) -> float:
        """|w - w_ep1| / |w_ep1 - w0| over these tensors together."""
        return (norm({k: a[k] - base[k] for k in keys}, keys) / norm({k: base[k] - w0[k] for k in keys}, keys))

    routers = [k for k in base if k.endswith("mlp.gate.weight")]
    experts = [k for k in base if ".mlp.experts." in k]
    res["update_compare"] = {
        "keys": len(base), "routers": len(routers), "experts": len(experts),
        "change_rel": norm({k: base[k] - w0[k] for k in base}, list(base)) / norm(w0, list(base)),
        **{name: {"update_rel": max_rel(w, list(base)), "router_update_rel": max_rel(w, routers)}
           for name, w in weights.items() if name not in ("ep1", "ep1-aux")}}
    # the z-loss pulls the router logits towards 0: the routers' weights end smaller than without it
    res["update_compare"]["router_norm_z_vs_none"] = norm(weights["ep2-z"], routers) / norm(weights["ep2"], routers)
    # the load-balancing term at EP=2 against EP=1 (the same DP=4 micro-batches: megatron's aux_loss is a
    # micro-batch's, so only layouts that cut the same micro-batches give the same term)
    a, b = weights["ep2-aux"], weights["ep1-aux"]
    res["update_compare"]["aux_ep2_vs_ep1"] = (norm({k: a[k] - b[k] for k in b}, list(b))
                                               / norm({k: b[k] - w0[k] for k in b}, list(b)))


def reference_checks(workers: int, res: dict[str, Any], timed: Any) -> None:
    """The dense Qwen3 (q/k norms) through the independent reference step, fp32."""
    import reference_ppo

    from hpcrl.controller import WorkerGroup
    from hpcrl.workers.batching import arrange_minibatches
    from hpcrl.workers.megatron_roles import MegatronRole

    batch = reference_batch(8, QWEN3)
    plain = {k: batch[k] for k in batch.keys()}
    rows = reference_ppo.prompt_minibatches(batch["prompt_index"].tolist(), REF_MINI, REF_SEED) * REF_EPOCHS
    w0 = load_safetensors_dir(QWEN3)
    res["reference_step"] = {}
    for tp in (1, 2):
        t0 = time.time()
        cfg = make_cfg(QWEN3, tp, 1, entropy_coeff=0.01, ppo_mini_batch_size=len(batch) // REF_MINI,
                       ppo_epochs=REF_EPOCHS, loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.1,
                       kl_loss_type="k3", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
        cfg["actor"]["optim"].update(lr=REF_LR, clip_grad=REF_CLIP_GRAD, weight_decay=0.01)
        cfg["model"]["dtype"] = "fp32"
        cfg["rollout"]["temperature"] = REF_T
        cfg["algorithm"]["policy_loss"] = "dual_clip"
        actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg, "role": "actor"}, name=f"qwen3-ref-{tp}")
        actor.record_gradients(True)
        arranged = arrange_minibatches(copy.copy(batch), REF_MINI, actor.layout.dp_size, "token-mean",
                                       shuffle_seed=REF_SEED)
        actor.update_actor(arranged, num_minibatches=REF_MINI, epochs=REF_EPOCHS)
        steps = [merged(list(s)) for s in zip(*[r for r in actor.recorded_gradients() if r is not None])]
        got = merged(actor.hf_weights())
        actor.close()
        o = cfg["actor"]["optim"]
        settings = dict(temperature=REF_T, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, kl_type="k3", kl_coef=0.1,
                        entropy_coeff=0.01, loss_agg_mode="token-mean", lr=REF_LR,
                        betas=(o["adam_beta1"], o["adam_beta2"]), eps=o["adam_eps"], weight_decay=0.01,
                        clip_grad=REF_CLIP_GRAD, masters_fp32=False)
        ref = run_reference(plain, rows, settings, QWEN3)
        res["reference_step"][f"fp32-{tp}x1"] = reference_errors(ref, steps, got, w0)
        if tp == 1:  # control: the reference without the q/k norms' gradients must be seen
            frozen = {k: v for k, v in ref["grads"][0].items() if "_norm." in k and "self_attn" in k}
            res["reference_qk_norm_grad"] = max(float(v.abs().max()) for v in frozen.values())
        timed(f"qwen3 reference step {tp}x1", t0)


def moe_checks(workers: int, res: dict[str, Any], tmp: Path, timed: Any) -> None:
    out: dict[str, Any] = {}
    logprob_checks(workers, out, tmp, timed)
    update_checks(workers, out, tmp, timed)
    reference_checks(workers, out, timed)
    res["moe"] = out
