"""Advantage estimators of the PPO / GRPO family, on the token-aligned wire format.

Every tensor here is laid out like a rollout `Batch` (see `hpcrl.workers.batching`): right-padded
rows [B, S], per-token quantities token-aligned (entry t belongs to token t), and a response mask
[B, S] (float or bool, 1 = a generated token that the losses count). Prompt tokens, padding and any
other unmasked position are ignored on input and are exactly 0 in every output, so junk there
(e.g. values computed over the prompt) never leaks into a loss. Sample-level scores are [B]; group
ids are [B] long (`prompt_index`: the n samples of one prompt share it; ids need not be contiguous
or sorted).

Conventions the caller relies on:
- Sign: an advantage > 0 makes its tokens more likely; the KL penalty is *subtracted* from the reward.
- Whitening (`masked_whiten`) uses the mean and the *biased* (population, divide by N) variance over
  all masked tokens of the batch, and adds 1e-8 to the variance. It is per token, so a long response
  weighs more than a short one, as in the token-level formulation of REINFORCE++ and PPO.
- GRPO's group std is the *unbiased* (Bessel-corrected, divide by n-1) sample std, i.e. what
  `torch.std` computes by default. In every group estimator (grpo, rloo, reinforce_plus_plus_baseline)
  a group of one sample, or one whose scores are all equal (`sampling.groups_with_signal` is False),
  gets exactly 0 before any normalisation.
- Sequential estimators (GAE, REINFORCE++ return-to-go) run over the masked tokens of a row in
  order, skipping unmasked positions: the "next token" of a response token is the next masked
  token of the same row, and after the last one the bootstrap value is 0.
- KL in the reward (`token_level_rewards` with a KL term) reaches every estimator through the
  token rewards, as in verl (`compute_advantages`): gae and reinforce_plus_plus run over them; the
  group estimators (grpo, rloo, reinforce_plus_plus_baseline) take each sample's score as the sum of
  its token rewards, r - kl_coef * sum_t kl_t; remax takes the return-to-go of the token rewards on
  each token, minus the greedy baseline's score (without KL, the score on every token).
"""

from __future__ import annotations

import torch

from hpcrl.algos.sampling import groups_with_signal

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")

# Added to the variance before the square root when whitening, so a batch whose masked values
# are all equal whitens to zeros instead of NaN.
WHITEN_EPS = 1e-8


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask as 0/1 floats of `like`'s dtype (floating point), so it can multiply values."""
    dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
    return mask.to(dtype)


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where the mask is 1, exactly 0 elsewhere. A `where`, not a product: inf or NaN at prompt or
    padding positions (e.g. log-probs of padding) must not leak in as NaN through 0 * inf."""
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (a 0-dim tensor; 0 when the mask is empty).

    A plain `x.mean()` would count prompt and padding positions; this is the batch statistic that
    the whitening and the logged metrics need."""
    m = _float_mask(mask, x)
    return _zero_outside(x, mask).sum() / m.sum().clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked positions of the whole tensor; 0 elsewhere.

    The statistics are over *all* masked tokens of the batch (not per row): mean = sum(m x) / N,
    var = sum(m (x - mean)^2) / N (biased, population variance, so whitened values have exactly
    unit variance over the masked tokens). shift_mean=False keeps the mean (only rescales), which
    some callers want for returns. With one masked token or all-equal values the result is 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    centred = x - mean if shift_mean else x
    return _zero_outside(centred * torch.rsqrt(var + WHITEN_EPS), mask)


def _last_masked_index(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the last masked position, or -1 for a row without one."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values


def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                        kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards [B, S]: the sample score on the last response token of each row, minus
    kl_coef * kl on every response token.

    This is the KL-in-reward shaping of Ziegler et al. 2019 / Ouyang et al. 2022 (InstructGPT):
    R(x, y) = r(x, y) - beta * KL, with the KL spread per token (kl is a per-token estimate of
    KL(pi || ref), e.g. `losses.kl_estimate(logprob, ref_logprob, "k1")`) and the sequence score
    paid at the end, where the whole response is known. A row without response tokens gets zeros."""
    m = _float_mask(mask, scores)
    out = torch.zeros_like(m)
    last = _last_masked_index(mask)
    rows = torch.nonzero(last >= 0, as_tuple=True)[0]
    out[rows, last[rows]] = scores[rows].to(out.dtype)
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * _zero_outside(kl.to(out.dtype), mask)
    return out


def _reverse_scan(token_rewards: torch.Tensor, values: torch.Tensor | None, mask: torch.Tensor,
                  gamma: float, lam: float) -> torch.Tensor:
    """Backward recursion over the masked tokens of each row, skipping unmasked positions.

    With values: GAE, delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next.
    Without (values=None, lam=1): the discounted return-to-go G_t = r_t + gamma G_next.
    "next" is the next masked token of the row; after the last one V_next = A_next = 0."""
    m = mask.bool()
    r = token_rewards
    v = values if values is not None else torch.zeros_like(r)
    out = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])
    next_a = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        here = m[:, t]
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        out[:, t] = torch.where(here, a, torch.zeros_like(a))
        next_v = torch.where(here, v[:, t], next_v)
        next_a = torch.where(here, a, next_a)
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation", eq. 16) over the response tokens only.

    values[t] is V of the state just before token t (the critic's token-aligned output), so
    delta_t = r_t + gamma * V(next response token) - V_t, with V = 0 after the last response token
    (the episode ends there), and A_t = sum_l (gamma lam)^l delta_{t+l}.

    Returns (advantages, returns): returns = the *un-whitened* A + V (the lambda-return, the critic's
    target); advantages = A whitened over all masked tokens of the batch (`masked_whiten`: masked
    mean and biased std), as PPO implementations do to keep the policy step size independent of the
    reward scale. Both are 0 outside the mask."""
    r = _zero_outside(token_rewards, mask)
    v = _zero_outside(values.to(r.dtype), mask)
    raw = _reverse_scan(r, v, mask, gamma, lam)
    returns = _zero_outside(raw + v, mask)
    return masked_whiten(raw, mask), returns


def _group_index(group: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to 0..G-1 (so scatter ops can use them); returns (index, G)."""
    uniq, inverse = torch.unique(group, return_inverse=True)
    return inverse, int(uniq.numel())


def _group_stats(scores: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: (size of its group, sum of its group's scores, sum of squared deviations from the
    group mean). Computed with index_add, so groups may be interleaved in the batch."""
    idx, n_groups = _group_index(group)
    x = scores.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, idx, torch.ones_like(x))
    total = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, idx, x)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, idx, (x - mean[idx]).square())
    return count[idx], total[idx], sq[idx]


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [B] sample-level advantage on every response token of its row, 0 elsewhere."""
    m = _float_mask(mask, like)
    return per_sample.to(m.dtype)[:, None] * m


def _result_dtype(scores: torch.Tensor) -> torch.Tensor:
    """A tensor carrying the output dtype: the scores' float dtype, or the default float dtype."""
    return scores if scores.is_floating_point() else scores.to(torch.get_default_dtype())


def grpo(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, norm_by_std: bool = True,
         eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath, sec. 4.1.2):
    A_i = (r_i - mean(group)) / (std(group) + eps) on every response token of sample i.

    std is the unbiased (Bessel-corrected, n-1) sample std of the group, matching `torch.std`'s
    default; the paper writes std(r) without fixing the estimator. norm_by_std=False gives
    r_i - mean(group) (Dr. GRPO, Liu et al. 2025, which argues the std division biases towards
    too-easy/too-hard prompts). A group of one sample has no baseline and gets 0, and so does a
    group whose scores are all equal: set to exactly 0, not computed as 0 / (0 + eps), which with
    eps = 0 would be NaN, or an O(1) value made of float rounding in the group mean."""
    count, total, sq = _group_stats(scores, group)
    x = scores.to(torch.float64)
    centred = x - total / count
    if norm_by_std:
        std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
        centred = centred / (std + eps)
    adv = torch.where(groups_with_signal(scores, group), centred, torch.zeros_like(centred))
    return _broadcast(adv, mask, _result_dtype(scores))


def rloo(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", eq. 5; Kool et al. 2019):
    A_i = r_i - mean_{j != i} r_j = (n r_i - sum_j r_j) / (n - 1), broadcast over the response.

    The baseline excludes the sample itself, so it is unbiased. A group of one sample has no
    other sample to compare with and gets 0; a group whose scores all agree gets exactly 0."""
    count, total, _ = _group_stats(scores, group)
    x = scores.to(torch.float64)
    adv = (count * x - total) / (count - 1).clamp(min=1.0)
    adv = torch.where(groups_with_signal(scores, group), adv, torch.zeros_like(adv))
    return _broadcast(adv, mask, _result_dtype(scores))


def reinforce_plus_plus(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs"):
    the discounted return-to-go G_t = sum_{s >= t} gamma^(s-t) r_s over the response tokens
    (token_rewards usually carry the KL-in-reward penalty per token and the score on the last
    token, see `token_level_rewards`), then whitened over all masked tokens of the batch (global
    batch normalisation instead of a critic or a per-prompt baseline)."""
    returns = _reverse_scan(_zero_outside(token_rewards, mask), None, mask, gamma, 1.0)
    return masked_whiten(returns, mask)


def reinforce_plus_plus_baseline(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean of the scores (the n samples of a
    prompt), broadcast over the response tokens, then whiten over all masked tokens of the batch.

    The group mean removes the prompt difficulty; the global whitening then fixes the scale without
    GRPO's per-group std division. A group of one sample, or one whose scores all agree, is set to
    exactly 0 before whitening (not left at the float rounding of its mean)."""
    count, total, _ = _group_stats(scores, group)
    centred = scores.to(torch.float64) - total / count
    centred = torch.where(groups_with_signal(scores, group), centred, torch.zeros_like(centred))
    per_token = _broadcast(centred, mask, _result_dtype(scores))
    return masked_whiten(per_token, mask)


def remax(scores: torch.Tensor, baseline_scores: torch.Tensor, mask: torch.Tensor,
          token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning LLMs", Algorithm 1): A_i = r(x, y_i) - r(x, y_greedy), the score of the
    greedy response to the same prompt as baseline, broadcast over the response tokens.

    With token_rewards (the KL in the reward, `token_level_rewards`): on token t the undiscounted
    return-to-go sum_{s >= t} r_s of the row's token rewards, minus the baseline, as verl's ReMax
    does; without a KL term that is the score on every token, the same as above."""
    if token_rewards is None:
        adv = scores.to(torch.float64) - baseline_scores.to(torch.float64)
        return _broadcast(adv, mask, _result_dtype(scores))
    like = _result_dtype(scores)
    returns = _reverse_scan(_zero_outside(token_rewards.to(torch.float64), mask), None, mask, 1.0, 1.0)
    adv = returns - baseline_scores.to(torch.float64)[:, None]
    return _zero_outside(adv, mask).to(like.dtype)


def summed_scores(scores: torch.Tensor, token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sample's score as the sum of its token rewards over the response (with KL in the reward:
    r - kl_coef * sum_t kl_t), the score the group estimators compare (verl sums the token-level
    rewards the same way). A row without response tokens keeps its score (it has no token rewards)."""
    summed = _zero_outside(token_rewards.to(torch.float64), mask).sum(-1)
    return torch.where(mask.bool().any(-1), summed, scores.to(torch.float64)).to(_result_dtype(scores).dtype)


def compute_advantages(estimator: str, *, scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor,
                       token_rewards: torch.Tensor | None = None, values: torch.Tensor | None = None,
                       baseline_scores: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                       norm_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages [B, S] by `algorithm.adv_estimator`, and the critic's returns (gae only, else None).

    token_rewards (`token_level_rewards`: the score on the last token, minus the KL penalty per token
    when the KL is in the reward) feed every estimator when given: gae and reinforce_plus_plus run
    over them, the group estimators compare their per-sample sums (`summed_scores`), remax takes
    their return-to-go. Not given: built from the scores without KL. gae needs values (the critic),
    remax needs baseline_scores (the greedy responses' scores). The outputs are 0 outside the mask."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={estimator!r} is unknown; use one of {', '.join(ESTIMATORS)}")
    if estimator in ("gae", "reinforce_plus_plus") and token_rewards is None:
        token_rewards = token_level_rewards(scores, mask)
    if estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and token_rewards is not None:
        scores = summed_scores(scores, token_rewards, mask)
    if estimator == "gae":
        if values is None:
            raise ValueError("algorithm.adv_estimator=gae needs the critic's values")
        return gae(token_rewards, values, mask, gamma, lam)
    if estimator == "grpo":
        return grpo(scores, group, mask, norm_by_std=norm_by_std), None
    if estimator == "rloo":
        return rloo(scores, group, mask), None
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus(token_rewards, mask, gamma), None
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_baseline(scores, group, mask), None
    if baseline_scores is None:
        raise ValueError("algorithm.adv_estimator=remax needs baseline_scores (the greedy responses' scores)")
    return remax(scores, baseline_scores, mask, token_rewards), None
