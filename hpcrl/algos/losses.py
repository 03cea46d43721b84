"""Token-level policy and value losses of the PPO family, and KL estimators.

Every function here returns per-token terms; aggregation (token-mean, sequence-mean, ...) is done
by per-token weights that the caller computes over the *whole* mini-batch, so the loss does not
depend on how the batch was split across data-parallel ranks or micro-batches.
"""

from __future__ import annotations

import torch


def ppo_policy_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip_c: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate (Schulman et al. 2017), with DAPO's decoupled clip-higher (clip_low !=
    clip_high) and dual clip (Ye et al. 2020: for negative advantages, at most c * |A|).

    Returns (per-token loss, per-token bool: the clip was active)."""
    ratio = torch.exp(logprob - old_logprob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip_c is not None:
        # for A < 0 the surrogate grows without bound in the ratio; cap it at c * |A|
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip_c), loss)
    return loss, was_clipped


def kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimators of KL(pi || ref) from samples of pi (Schulman, "Approximating KL
    Divergence", 2020): k1 = log r, k2 = (log r)^2 / 2, k3 = (r' - 1) - log r' with r' = ref/pi.

    k3 grows exponentially in log r': one token the reference finds very unlikely would dominate
    the loss, so log r' is bounded to [-20, 20] and k3 to [-10, 10] (the bounds verl uses)."""
    log_ratio = logprob - ref_logprob
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        neg = torch.clamp(-log_ratio, -20.0, 20.0)
        return torch.clamp(torch.exp(neg) - 1.0 - neg, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}: use k1, k2 or k3")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2): 0.5 * max((v - R)^2, (v_clipped - R)^2). Returns (loss, clipped)."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    a, b = (values - returns).square(), (v_clipped - returns).square()
    return 0.5 * torch.maximum(a, b), b > a


def token_weights(response_masks: list[torch.Tensor], mode: str) -> list[torch.Tensor]:
    """Per-token weights whose weighted sum aggregates a mini-batch's token losses.

    token-mean: every response token counts equally (DAPO); seq-mean-token-mean: mean over tokens,
    then over sequences (GRPO paper); seq-mean-token-sum: sum over tokens, mean over sequences."""
    n_seq = len(response_masks)
    if mode == "token-mean":
        total = sum(float(m.sum()) for m in response_masks)
        return [m.float() / max(total, 1.0) for m in response_masks]
    if mode == "seq-mean-token-mean":
        return [m.float() / max(float(m.sum()), 1.0) / n_seq for m in response_masks]
    if mode == "seq-mean-token-sum":
        return [m.float() / n_seq for m in response_masks]
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def truncated_is_weights(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                         cap: float, mode: str = "tis") -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights for samples drawn by the rollout engine's policy (the behaviour policy),
    with the trainer's recomputed log-probs as the proximal policy: the decoupled PPO objective
    (Hilton et al. 2022; AReaL) is the clipped surrogate against the proximal policy, each token's
    term multiplied by this weight. Per token, with ratio = pi_old / pi_rollout
    = exp(old_logprob - rollout_logprob), 0 outside `mask`:

      tis (truncated, Yao et al. 2025): w = min(ratio, cap)
      mis (masked, AReaL's behaviour-weight cap): w = ratio where ratio <= cap, else 0 (the token
          still counts in the loss's normalisation, it just teaches nothing)

    Metrics over the masked tokens: the weights' mean, the largest ratio, the share above the cap."""
    if mode not in ("tis", "mis"):
        raise ValueError(f"importance weights: mode {mode!r}, expected tis or mis")
    m = mask.bool()
    ratio = torch.exp(old_logprob.double() - rollout_logprob.double())
    kept = ratio.clamp(max=cap) if mode == "tis" else torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    weights = torch.where(m, kept, torch.zeros_like(ratio)).float()
    r = ratio[m]
    return weights, {"rollout_is/weight_mean": float(weights[m].mean()) if r.numel() else 1.0,
                     "rollout_is/ratio_max": float(r.max()) if r.numel() else 1.0,
                     "rollout_is/truncated_frac": float((r > cap).double().mean()) if r.numel() else 0.0}
