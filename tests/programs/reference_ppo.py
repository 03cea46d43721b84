"""An independent reference for one PPO actor update and one critic update, in plain PyTorch on a HF model.

Written from the formulas, not from hpcrl (nothing of hpcrl is imported), so that hpcrl's Megatron path can be
checked from outside. Sequences run unpadded, one per forward; gradients are accumulated sequence by sequence in
fp32; one AdamW step per mini-batch (`AdamW` below, from the formula: no torch optimizer; constant LR). The
mini-batches are cut by `prompt_minibatches` (the reference's own rule, not hpcrl's code).

Batch convention: a dict of CPU tensors [B, S], right padded: input_ids, attention_mask (1 = real token),
response_mask (1 = a generated token the losses count). Per-token fields are token-aligned: entry t belongs to
token t (e.g. old_logprob[i, t] = log p(ids[t] | ids[<t])); entry 0 is unused.

Sources:
- PPO clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. (7).
- Dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL" (AAAI 2020), sec. 3 (dual-clip PPO).
- KL estimators k1/k2/k3: Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html).
- Token-mean aggregation: Yu et al. 2025, "DAPO: An Open-Source LLM RL System at Scale", sec. 3.3.
- Clipped value loss: the PPO2 baselines implementation (Dhariwal et al. 2017), as in Schulman et al. 2017.
- AdamW: Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2 (the decay multiplies the
  weight by 1 - lr * wd, outside the adaptive step); Kingma & Ba 2015, "Adam", Algorithm 1 (bias correction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def _rows(batch: dict[str, torch.Tensor]) -> list[int]:
    return [int(n) for n in batch["attention_mask"].sum(-1).tolist()]


def prompt_minibatches(prompt_index: Sequence[int], num_minibatches: int, seed: int) -> list[list[int]]:
    """Rows of each mini-batch, cut by prompt: the prompts in the order of their first row are permuted by
    torch.randperm(#prompts) of a generator seeded with `seed`; mini-batch k takes the rows of the k-th run of
    #prompts / num_minibatches permuted prompts, each prompt's rows in batch order (so a prompt's samples share a
    mini-batch). This is the shuffle hpcrl documents for its trainer, written here from that sentence."""
    prompts: dict[int, list[int]] = {}
    for row, p in enumerate(prompt_index):
        prompts.setdefault(int(p), []).append(row)
    groups = list(prompts.values())
    if len(groups) % num_minibatches:
        raise ValueError(f"{len(groups)} prompts do not cut into {num_minibatches} equal mini-batches")
    perm = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    per = len(groups) // num_minibatches
    return [[r for k in perm[j * per:(j + 1) * per] for r in groups[k]] for j in range(num_minibatches)]


class AdamW:
    """AdamW from the formula, in float64 arithmetic on the given fp32 tensors (updated in place). Step t:
      w <- w (1 - lr wd)                                  (decoupled weight decay, Loshchilov & Hutter 2019)
      m <- b1 m + (1 - b1) g,  v <- b2 v + (1 - b2) g^2
      w <- w - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)   (bias correction, Kingma & Ba 2015)"""

    def __init__(self, params: Sequence[torch.Tensor], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float):
        self.params, self.lr, self.betas, self.eps, self.wd = list(params), lr, betas, eps, weight_decay
        self.m = [torch.zeros(p.shape, dtype=torch.float64) for p in self.params]
        self.v = [torch.zeros(p.shape, dtype=torch.float64) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor]) -> None:
        self.t += 1
        b1, b2 = self.betas
        for p, g, m, v in zip(self.params, grads, self.m, self.v, strict=True):
            g = g.double()
            m.mul_(b1).add_((1.0 - b1) * g)
            v.mul_(b2).add_((1.0 - b2) * g * g)
            step = self.lr * (m / (1.0 - b1 ** self.t)) / ((v / (1.0 - b2 ** self.t)).sqrt() + self.eps)
            p.copy_(p.double() * (1.0 - self.lr * self.wd) - step)


def _token_logits(model: torch.nn.Module, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits / temperature in fp32, token-aligned: row t (t >= 1) is the distribution that predicts token t."""
    logits = model(input_ids=ids[None]).logits[0].float() / temperature
    return torch.cat([torch.zeros_like(logits[:1]), logits[:-1]], 0)


def _token_logprob(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]
    return torch.cat([torch.zeros_like(lp[:1]), lp[1:]])


@torch.no_grad()
def logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Token-aligned [B, S] fp32 log p(ids[t] | ids[<t]) = log_softmax(logits[t-1] / T)[ids[t]]; 0 at t=0, padding."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for i, n in enumerate(_rows(batch)):
        ids = batch["input_ids"][i, :n]
        out[i, :n] = _token_logprob(_token_logits(model, ids, temperature), ids)
    return out


def _kl(lp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) with samples from pi (Schulman 2020): k1 = log(pi/ref),
    k2 = 0.5 (log(pi/ref))^2, k3 = ref/pi - 1 - log(ref/pi) (x = log(ref/pi) clamped to [-20, 20], k3 to [-10, 10])."""
    if kind in ("k1", "kl"):
        return lp - ref
    if kind in ("k2", "mse"):
        return 0.5 * (lp - ref).square()
    if kind == "abs":
        return (lp - ref).abs()
    if kind in ("k3", "low_var_kl"):
        x = (ref - lp).clamp(-20.0, 20.0)
        return (x.exp() - x - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_type {kind!r}")


def _seq_weights(masks: list[torch.Tensor], mode: str) -> list[float]:
    """Weight w_i such that agg(x) = sum_i w_i * sum_t m_it x_it over the mini-batch's sequences:
    token-mean (DAPO): w_i = 1 / sum_j |m_j|; seq-mean-token-mean: w_i = 1 / (n_seq |m_i|);
    seq-mean-token-sum: w_i = 1 / n_seq. n_seq counts every row of the mini-batch; a row without response
    tokens contributes 0."""
    counts = [float(m.sum()) for m in masks]
    if mode == "token-mean":
        return [1.0 / max(sum(counts), 1.0)] * len(masks)
    if mode == "seq-mean-token-mean":
        return [1.0 / (len(masks) * max(c, 1.0)) for c in counts]
    if mode == "seq-mean-token-sum":
        return [1.0 / len(masks)] * len(masks)
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def _train(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], minibatches: Sequence[Sequence[int]],
           seq_loss: Callable[[int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]], loss_agg_mode: str,
           masters_fp32: bool, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
           clip_grad: float) -> dict:
    """One AdamW step per mini-batch. seq_loss(i, n) is the per-token loss of row i (length n, token-aligned) and
    per-token counts (0/1) to aggregate like it; the mini-batch loss sum_i w_i sum_t m_it loss_it is
    backpropagated row by row and accumulated in fp32. Before the step: global L2 norm g over all params; if
    clip_grad > 0 and g > clip_grad, grads *= clip_grad / (g + 1e-6). The optimizer updates fp32 copies of the
    weights; with masters_fp32 they are copied (rounded) into the model after every step, else the fp32 model's
    own weights are updated."""
    names = list(params)
    masters = [params[k].detach().float().clone() if masters_fp32 else params[k] for k in names]
    opt = AdamW(masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    lens = _rows(batch)
    out: dict = {"grads": [], "grad_norms": [], "losses": [], "counts": []}
    for rows in minibatches:
        masks = [batch["response_mask"][i, : lens[i]].float().clone() for i in rows]
        for m in masks:
            m[0] = 0.0  # token 0 has no prediction
        bufs = [torch.zeros(p.shape, dtype=torch.float32) for p in masters]
        total = 0.0
        counts: dict[str, float] = {}
        for i, m, w in zip(rows, masks, _seq_weights(masks, loss_agg_mode)):
            per_token, flags = seq_loss(i, lens[i])
            loss = w * (per_token * m).sum()
            loss.backward()
            total += float(loss.detach())
            for k, f in flags.items():
                counts[k] = counts.get(k, 0.0) + w * float((f.float() * m).sum())
            for b, k in zip(bufs, names):
                p = params[k]
                if p.grad is not None:
                    b += p.grad.float()
                    p.grad = None
        norm = float(torch.sqrt(sum(b.double().square().sum() for b in bufs)))
        out["grads"].append({k: b.clone() for k, b in zip(names, bufs)})
        out["grad_norms"].append(norm)
        out["losses"].append(total)
        out["counts"].append(counts)
        if clip_grad > 0 and norm > clip_grad:
            for b in bufs:
                b.mul_(clip_grad / (norm + 1e-6))
        opt.step(bufs)
        if masters_fp32:
            with torch.no_grad():
                for k, m in zip(names, masters):
                    params[k].data.copy_(m)
    out["weights"] = {k: m.detach().float().clone() for k, m in zip(names, masters)}
    out["model_weights"] = {k: params[k].detach().clone() for k in names}
    return out


def actor_update(model: torch.nn.Module, batch: dict[str, torch.Tensor], minibatches: Sequence[Sequence[int]], *,
                 temperature: float, clip_low: float, clip_high: float, dual_clip_c: float | None,
                 kl_type: str | None, kl_coef: float, entropy_coeff: float, loss_agg_mode: str, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, clip_grad: float,
                 masters_fp32: bool) -> dict:
    """PPO actor update, one optimizer step per list of row indices in `minibatches`; `model` changes in place.

    Per response token, with lp = log_softmax(logits[t-1].float() / T)[ids[t]] and r = exp(lp - old_logprob):
      pg = max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high))          (Schulman 2017; clip_high != clip_low: DAPO)
      pg = min(pg, -A c) where A < 0, if dual_clip_c = c is given        (Ye et al. 2020)
      pg = w pg, if the batch has is_weight = w                           (decoupled PPO's behaviour weight:
                                                                          truncated (tis) or masked (mis) IS)
      kl = k1 | k2 | k3(lp, ref_logprob) by kl_type                      (Schulman 2020), if kl_coef != 0
      H  = -sum_v p_v log p_v of softmax(logits[t-1].float() / T), if entropy_coeff != 0
    loss = agg(pg) + kl_coef agg(kl) - entropy_coeff agg(H), agg = loss_agg_mode (see _seq_weights).
    Returns grads (per step, before clipping, HF names as in model.named_parameters(): a tied lm_head appears only
    as model.embed_tokens.weight), grad_norms, losses, counts (per step, aggregated like the loss: "clip", the
    share of tokens where the ratio clip is active, clamp(r) A < r A; "dual_clip", where the dual clip is, A < 0 and
    r > c), weights (fp32; the masters for masters_fp32) and model_weights (the model's own dtype). Only the
    parameters that require a gradient train (all of them, or a PEFT model's LoRA adapters)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    use_kl = kl_coef != 0.0 and kl_type is not None

    def seq_loss(i: int, n: int) -> torch.Tensor:
        ids = batch["input_ids"][i, :n]
        logits = _token_logits(model, ids, temperature)
        lp = _token_logprob(logits, ids)
        adv = batch["advantages"][i, :n].float()
        ratio = torch.exp(lp - batch["old_logprob"][i, :n].float())
        clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        loss = torch.maximum(-adv * ratio, -adv * clipped)
        flags = {"clip": (-adv * clipped > -adv * ratio).detach()}
        if dual_clip_c is not None:
            loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip_c), loss)
            flags["dual_clip"] = ((adv < 0) & (ratio > dual_clip_c)).detach()
        if "is_weight" in batch:
            loss = loss * batch["is_weight"][i, :n].float()
        if use_kl:
            loss = loss + kl_coef * _kl(lp, batch["ref_logprob"][i, :n].float(), kl_type)
        if entropy_coeff != 0.0:
            logp = torch.log_softmax(logits, -1)
            loss = loss - entropy_coeff * -(logp.exp() * logp).sum(-1)
        return loss, flags

    return _train(params, batch, minibatches, seq_loss, loss_agg_mode, masters_fp32, lr, betas, eps,
                  weight_decay, clip_grad)


def critic_update(model: torch.nn.Module, head_weight: torch.Tensor, head_bias: torch.Tensor,
                  batch: dict[str, torch.Tensor], minibatches: Sequence[Sequence[int]], *, cliprange_value: float,
                  lr: float, betas: tuple[float, float], eps: float, weight_decay: float, clip_grad: float) -> dict:
    """PPO critic update (fp32), one optimizer step per list of row indices; the base model changes in place.

    v[t] = head(h[t-1]) = h[t-1] . head_weight + head_bias, h = model.model(ids).last_hidden_state (token-aligned).
    Per response token: vc = old_values + clamp(v - old_values, -c, c);
      loss = 0.5 max((v - R)^2, (vc - R)^2), aggregated with token-mean.
    The lm_head takes no part. Params: model.model's (HF names with the "model." prefix) plus value_head.weight
    and value_head.bias (fresh copies of head_weight / head_bias). Returns the same keys as actor_update."""
    params = {f"model.{k}": p for k, p in model.model.named_parameters()}
    params["value_head.weight"] = head_weight.detach().float().clone().requires_grad_(True)
    params["value_head.bias"] = head_bias.detach().float().clone().requires_grad_(True)
    w, b, c = params["value_head.weight"], params["value_head.bias"], cliprange_value

    def seq_loss(i: int, n: int) -> torch.Tensor:
        h = model.model(input_ids=batch["input_ids"][i, :n][None]).last_hidden_state[0].float()
        v = F.linear(h, w, b)[:, 0]
        v = torch.cat([torch.zeros_like(v[:1]), v[:-1]])
        old, ret = batch["old_values"][i, :n].float(), batch["returns"][i, :n].float()
        vc = old + (v - old).clamp(-c, c)
        return 0.5 * torch.maximum((v - ret).square(), (vc - ret).square()), {}

    return _train(params, batch, minibatches, seq_loss, "token-mean", False, lr, betas, eps, weight_decay,
                  clip_grad)
