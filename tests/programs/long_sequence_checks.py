"""Long-sequence layouts in the Megatron world of tests/programs/megatron_checks.py (no world of their
own): context parallel (CP), sequence parallel (SP) and activation recompute against CP = 1 and
against each other; tests/test_megatron_engine.py asserts on what `long_sequence_checks` measures.
The actor update at CP = 2 (and CP = 2 x TP = 2 with SP) against the independent reference step is
one of megatron_checks.REFERENCE_CASES.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from megatron_checks import TINY, delta, make_cfg, merged, rel_diff, text_batch

from hpcrl.controller.dispatch import Collect, Dispatch, register
from hpcrl.workers.batching import arrange_minibatches, sequences, to_token_aligned
from hpcrl.workers.megatron_roles import MegatronRole
from hpcrl.workers.reward_model import RewardModelRole

# (TP, CP, SP): the plain layout (DP 4), CP 2 (DP 2), CP 2 x TP 2 with SP (DP 1)
LONG_LAYOUTS = [(1, 1, False), (1, 2, False), (2, 2, True)]
LONG_TOKENS = 2048  # per sequence of the recompute memory check (tiny model: 2 layers, hidden 128)


class PeakRole(MegatronRole):
    """MegatronRole with an actor update that measures its peak resident memory: the heap's free
    pages handed back first, then the high-water mark from the resident set at the start."""

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.ALL)
    def update_measuring_peak(self, batch: Any) -> dict[str, Any]:
        from hpcrl.workers.memory import peak_memory, return_free_heap

        return_free_heap()
        peak_memory(reset=True)
        start = peak_memory(reset=True)["rss_gb"]  # the mark since the reset just above: now
        metrics = self.update_actor(batch)
        return {"peak_above_start_gb": peak_memory(reset=True)["rss_gb"] - start, "metrics": metrics}


class TokenValuesRole(RewardModelRole):
    """The reward model's engine (a value head read from score.weight) with its per-token values
    exposed: the values path of a critic with a non-zero head, at any layout."""

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def token_values(self, batch: Any) -> torch.Tensor | None:
        vals = self.engine.compute_values(sequences(batch))
        if vals is None or not self.engine.is_output_rank:
            return None
        return to_token_aligned(vals, tuple(batch["input_ids"].shape))


def odd_length_batch(n: int) -> tuple[Any, list[int]]:
    """Real text rows cut to odd lengths (never a multiple of 2 x CP), each keeping part of its answer."""
    b = text_batch(TINY, n)
    lengths = []
    for i in range(len(b)):
        full = int(b["attention_mask"][i].sum())
        prompt = int(torch.nonzero(b["response_mask"][i])[0])
        cut = full if full % 2 else full - 1
        if cut <= prompt + 1:
            cut = full  # (kept whole: only a short answer)
        b["input_ids"][i, cut:] = 0
        b["attention_mask"][i, cut:] = 0
        b["response_mask"][i, cut:] = 0
        lengths.append(cut)
    return b, lengths


def layout_cfg(tp: int, cp: int, sp: bool, **actor: Any) -> dict[str, Any]:
    cfg = make_cfg(TINY, tp, 1, **actor)
    cfg["actor"]["parallel"].update(context_parallel=cp, sequence_parallel=sp)
    cfg["critic"]["parallel"] = dict(cfg["actor"]["parallel"])
    return cfg


def long_batch(n: int, length: int, seed: int) -> Any:
    """n random-token sequences of `length` tokens (the last 3/4 the response), advantages drawn."""
    from hpcrl.controller import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (n, length), generator=g)
    resp = torch.zeros(n, length)
    resp[:, length // 4:] = 1
    b = Batch({"input_ids": ids, "attention_mask": torch.ones(n, length, dtype=torch.long), "response_mask": resp,
               "prompt_index": torch.arange(n)})
    b["advantages"] = torch.randn(ids.shape, generator=g)
    return b


def long_sequence_checks(workers: int, res: dict[str, Any], tmp: Path, timed: Any) -> None:
    from megatron_checks import hf_logprobs, make_tiny_reward_model

    from hpcrl.checkpoint import CheckpointStore
    from hpcrl.controller import WorkerGroup

    if workers % 4:
        res["long"] = {"skipped": f"{workers} workers cannot hold CP 2 x TP 2"}
        return
    out: dict[str, Any] = {}
    res["long"] = out

    # 1. log-probs, entropies and values at every long layout against the plain one
    batch, out["lengths"] = odd_length_batch(6)
    mask = batch["attention_mask"].clone()
    mask[:, 0] = 0
    rm_path = make_tiny_reward_model(tmp / "long-rm")
    got: dict[str, dict[str, torch.Tensor]] = {}
    out["layouts"] = {}
    for tp, cp, sp in LONG_LAYOUTS:
        t0 = time.time()
        name = f"tp{tp}-cp{cp}" + ("-sp" if sp else "")
        cfg = layout_cfg(tp, cp, sp)
        actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg, "role": "actor"}, name=f"long-{name}")
        d = actor.describe()
        got[name] = {"logprob": actor.compute_logprob(batch), "entropy": actor.compute_entropy(batch)}
        actor.close()
        cfg["reward"]["model_path"] = rm_path
        values = WorkerGroup(TokenValuesRole, init_kwargs={"cfg": cfg}, name=f"long-values-{name}")
        got[name]["values"] = values.token_values(batch)
        values.close()
        out["layouts"][name] = {k: d[k] for k in ("tp", "cp", "dp", "sequence_parallel")}
        timed(f"long layout {name}", t0)
    base = got["tp1-cp1"]
    out["vs_cp1"] = {name: {k: float(((v - base[k]).abs() * mask).max()) for k, v in g.items()}
                     for name, g in got.items() if name != "tp1-cp1"}
    out["logprob_cp1_vs_hf"] = float(((base["logprob"] - hf_logprobs(TINY, batch)).abs() * mask).max())
    # how far apart the quantities are between rows: an all-zero or constant result would match itself
    out["spread"] = {k: float((v * mask).std()) for k, v in base.items()}
    out["largest"] = {k: float((v * mask).abs().max()) for k, v in base.items()}

    # 2. activation recompute: the gradients of `none` and a lower peak on long sequences. The
    # per-sequence attention (the CPU default) runs PyTorch's flash kernel, which keeps no
    # [heads, T, T] probabilities, so `selective` has nothing to drop there; it is measured where it
    # does, with megatron's dense attention (model.local_attention=dense), and `full` on the default.
    t0 = time.time()
    grads, peaks, metrics = {}, {}, {}
    lb = long_batch(workers, LONG_TOKENS, seed=3)
    for attention, modes in (("per_sequence", ("none", "selective", "full")), ("dense", ("none", "selective"))):
        for mode in modes:
            key = f"{attention}/{mode}"
            cfg = layout_cfg(1, 1, False, recompute=mode, micro_batch_tokens=LONG_TOKENS,
                             ppo_mini_batch_size=workers)
            cfg["model"]["local_attention"] = attention
            actor = WorkerGroup(PeakRole, init_kwargs={"cfg": cfg, "role": "actor"}, name=f"long-recompute-{mode}")
            arranged = arrange_minibatches(copy.copy(lb), 1, actor.layout.dp_size, "token-mean")
            actor.update_measuring_peak(copy.copy(arranged))  # warm-up: caches and pools at their size
            actor.record_gradients(True)
            measured = actor.update_measuring_peak(arranged)
            peaks[key] = [m["peak_above_start_gb"] for m in measured]
            metrics[key] = measured[0]["metrics"]
            grads[key] = merged([r[0] for r in actor.recorded_gradients() if r])
            actor.close()
    base = {a: grads[f"{a}/none"] for a in ("per_sequence", "dense")}
    out["recompute"] = {
        "grad_max_abs": {k: max(float((g[n] - base[k.split("/")[0]][n]).abs().max()) for n in g)
                         for k, g in grads.items() if not k.endswith("/none")},
        "grad_scale": max(float(v.abs().max()) for v in base["per_sequence"].values()),
        "peak": peaks, "pg_loss": {k: m["pg_loss"] for k, m in metrics.items()}}
    timed("long recompute", t0)

    # 3. a checkpoint saved at CP 2 resumes at CP 1 to the next step of an uninterrupted CP 1 run
    t0 = time.time()
    ub = text_batch(TINY, 8)
    g = torch.Generator().manual_seed(5)
    ub["old_logprob"] = hf_logprobs(TINY, ub) - 0.05 * torch.rand(ub["input_ids"].shape, generator=g)
    ub["advantages"] = torch.randn(ub["input_ids"].shape, generator=g)
    ub2 = copy.copy(ub)
    ub2["advantages"] = torch.randn(ub["input_ids"].shape, generator=g)

    def step(group: Any, b: Any) -> dict[str, float]:
        return group.update_actor(arrange_minibatches(copy.copy(b), 2, group.layout.dp_size, "token-mean"),
                                  num_minibatches=2)

    from omegaconf import OmegaConf

    cfg2 = layout_cfg(1, 2, False, ppo_mini_batch_size=8)
    cfg2["actor"]["optim"]["lr"] = 1e-3  # steps well above fp32 noise
    store = CheckpointStore(tmp / "long-ckpt" / "checkpoints")
    a = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg2, "role": "actor"}, name="long-ckpt-cp2")
    first_cp2 = step(a, ub)
    part = store.begin(1)
    ck = store.commit(part, 1, a.save_checkpoint(str(part)), {"step": 1, "sampler": {"epoch": 0, "index": 8}},
                      OmegaConf.to_yaml(OmegaConf.create(cfg2)))
    a.close()
    cfg1 = layout_cfg(1, 1, False, ppo_mini_batch_size=8)
    cfg1["actor"]["optim"]["lr"] = 1e-3
    b = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg1, "role": "actor"}, name="long-ckpt-cp1-resumed")
    b.load_checkpoint(str(ck))
    resumed = step(b, ub2)
    w_resumed = merged(b.hf_weights())
    b.close()
    c = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg1, "role": "actor"}, name="long-ckpt-cp1")
    first_cp1 = step(c, ub)
    part = store.begin(2)  # (a step number of its own: the same store)
    ck1 = store.commit(part, 2, c.save_checkpoint(str(part)), {"step": 1, "sampler": {"epoch": 0, "index": 8}},
                       OmegaConf.to_yaml(OmegaConf.create(cfg1)))
    straight = step(c, ub2)
    w_straight = merged(c.hf_weights())
    c.close()
    # and the reverse: CP 1's checkpoint resumed at CP 2
    d = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg2, "role": "actor"}, name="long-ckpt-cp2-resumed")
    d.load_checkpoint(str(ck1))
    resumed_at_cp2 = step(d, ub2)
    w_resumed_at_cp2 = merged(d.hf_weights())
    d.close()
    keys = ("pg_loss", "pg_clipfrac", "ppo_kl", "grad_norm", "entropy")
    w_init = merged_initial(w_straight)
    out["resume_cp2_at_cp1"] = {
        "first": {k: (first_cp2[k], first_cp1[k]) for k in keys},
        "next": {k: (resumed[k], straight[k]) for k in keys},
        "weights_max_abs": max(float((w_resumed[k] - w_straight[k]).abs().max()) for k in w_straight),
        "weights_change": max(float((w_straight[k] - w0).abs().max()) for k, w0 in w_init.items()),
        # ||resumed update - straight update|| / ||straight update||: Adam's first steps move an element
        # by ~lr whatever its gradient's size, so where a gradient is ~0 rounding can flip a sign; the
        # norm over the whole update is what fp32 rounding bounds
        "update_rel": rel_diff(delta(w_resumed, w_init), delta(w_straight, w_init), sorted(w_init))}
    out["resume_cp1_at_cp2"] = {
        "next": {k: (resumed_at_cp2[k], straight[k]) for k in keys},
        "update_rel": rel_diff(delta(w_resumed_at_cp2, w_init), delta(w_straight, w_init), sorted(w_init))}
    timed("long checkpoint CP 2 -> CP 1 -> CP 2", t0)


def merged_initial(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from megatron_checks import load_safetensors_dir

    w0 = load_safetensors_dir(TINY)
    return {k: w0[k] for k in like if k in w0}
