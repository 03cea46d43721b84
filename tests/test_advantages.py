"""Advantage estimators, KL controllers and DAPO sampling against hand-computed references.

The batches are token-aligned [B, S] rows as on the wire: prompt tokens first (mask 0), then the
response (mask 1), then right padding (mask 0), with different response lengths per row. Inputs
carry junk (large numbers) at unmasked positions to show they are ignored.
"""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algos.advantages import (
    compute_advantages,
    gae,
    grpo,
    masked_mean,
    masked_whiten,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
    token_level_rewards,
)
from hpcrl.algos.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller
from hpcrl.algos.sampling import groups_with_signal, overlong_penalty
from hpcrl.config.schema import KLControlConfig

J = 99.0  # junk at unmasked positions


def _whiten_ref(xs: list[float]) -> list[float]:
    """Independent reference: (x - mean) / sqrt(biased var + 1e-8) over a flat list."""
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / n
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def _place(mask: torch.Tensor, flat: list[float]) -> torch.Tensor:
    """Put a flat list of per-token values (row-major over the masked positions) into [B, S]."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    k = 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = flat[k]
                k += 1
    assert k == len(flat)
    return out


def _close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape
    assert torch.allclose(actual.double(), expected, atol=atol, rtol=0), f"\n{actual}\n!=\n{expected}"


# --- helpers ----------------------------------------------------------------------------------

def test_masked_mean_and_whiten() -> None:
    x = torch.tensor([[J, 1.0, 2.0, J], [J, J, 3.0, J]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0]], dtype=torch.bool)
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    # mean 2, biased var (1 + 0 + 1) / 3 = 2/3: whitened -1/sqrt(2/3), 0, +1/sqrt(2/3)
    s = 1.0 / math.sqrt(2.0 / 3.0 + 1e-8)
    _close(masked_whiten(x, mask), [[0, -s, 0, 0], [0, 0, s, 0]])
    # shift_mean=False only rescales
    _close(masked_whiten(x, mask, shift_mean=False), [[0, 1 * s, 2 * s, 0], [0, 0, 3 * s, 0]], atol=1e-5)
    # one masked token, or all-equal values: 0 rather than NaN
    _close(masked_whiten(x, torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0]])), torch.zeros(2, 4))
    _close(masked_whiten(torch.full((2, 4), 5.0), mask), torch.zeros(2, 4))
    assert masked_mean(x, torch.zeros(2, 4)).item() == 0.0


# --- KL-in-reward ------------------------------------------------------------------------------

# row 0: prompt 2, response 3 (t=2..4), padding 2; row 1: prompt 3, response 4 (t=3..6), no pad;
# row 2: prompt 1, response 1 (t=1), padding 5; row 3: no response at all.
MASK_A = torch.tensor([[0, 0, 1, 1, 1, 0, 0],
                       [0, 0, 0, 1, 1, 1, 1],
                       [0, 1, 0, 0, 0, 0, 0],
                       [0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)


def test_token_level_rewards_places_score_on_last_response_token() -> None:
    scores = torch.tensor([1.0, -0.5, 2.0, 7.0])
    _close(token_level_rewards(scores, MASK_A),
           [[0, 0, 0, 0, 1.0, 0, 0],
            [0, 0, 0, 0, 0, 0, -0.5],
            [0, 2.0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0]])


def test_token_level_rewards_subtracts_kl_on_response_tokens_only() -> None:
    scores = torch.tensor([1.0, -0.5, 2.0, 7.0])
    kl = torch.tensor([[J, J, 0.5, -0.2, 1.0, J, J],
                       [J, J, J, 0.3, 0.0, 0.4, 2.0],
                       [J, 1.5, J, J, J, J, J],
                       [J, J, J, J, J, J, J]])
    # r_t = score * [t last] - 0.1 * kl_t on response tokens
    _close(token_level_rewards(scores, MASK_A, kl, kl_coef=0.1),
           [[0, 0, -0.05, 0.02, 1.0 - 0.1, 0, 0],
            [0, 0, 0, -0.03, 0.0, -0.04, -0.5 - 0.2],
            [0, 2.0 - 0.15, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0]])
    # kl_coef 0: the KL is not used
    _close(token_level_rewards(scores, MASK_A, kl, kl_coef=0.0), token_level_rewards(scores, MASK_A))


# --- GAE ---------------------------------------------------------------------------------------

# row 0: prompt 1, response 3 (t=1..3), padding 2; row 1: prompt 3, response 2 (t=3..4), padding 1
GAE_MASK = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0]], dtype=torch.float32)
GAE_REWARDS = torch.tensor([[J, 0.1, -0.2, 1.0, J, J], [J, J, J, 0.0, -1.0, J]])
GAE_VALUES = torch.tensor([[J, 0.5, 0.4, 0.6, J, J], [J, J, J, -0.3, 0.2, J]])
# gamma 0.9, lam 0.8 (gamma*lam = 0.72), V = 0 after the last response token:
# row 0: t=3: delta = 1.0 - 0.6 = 0.4                      A = 0.4
#        t=2: delta = -0.2 + 0.9*0.6 - 0.4 = -0.06          A = -0.06 + 0.72*0.4   = 0.228
#        t=1: delta = 0.1 + 0.9*0.4 - 0.5 = -0.04           A = -0.04 + 0.72*0.228 = 0.12416
# row 1: t=4: delta = -1.0 - 0.2 = -1.2                     A = -1.2
#        t=3: delta = 0.0 + 0.9*0.2 + 0.3 = 0.48            A = 0.48 - 0.72*1.2    = -0.384
GAE_RAW = [0.12416, 0.228, 0.4, -0.384, -1.2]
GAE_RETURNS = [[0, 0.12416 + 0.5, 0.228 + 0.4, 0.4 + 0.6, 0, 0], [0, 0, 0, -0.384 - 0.3, -1.2 + 0.2, 0]]


def test_gae_hand_computed_with_gamma_and_lambda() -> None:
    adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.8)
    _close(ret, GAE_RETURNS)
    _close(adv, _place(GAE_MASK, _whiten_ref(GAE_RAW)), atol=1e-5)
    # whitened: zero mean and unit (biased) variance over the 5 masked tokens
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-5)
    assert (adv.square().sum() / 5).item() == pytest.approx(1.0, abs=1e-5)


def test_gae_ignores_nan_and_inf_outside_the_mask() -> None:
    unmasked = GAE_MASK == 0
    rewards = GAE_REWARDS.masked_fill(unmasked, float("nan"))
    values = GAE_VALUES.masked_fill(unmasked, float("inf"))
    adv, ret = gae(rewards, values, GAE_MASK, gamma=0.9, lam=0.8)
    _close(ret, GAE_RETURNS)
    _close(adv, _place(GAE_MASK, _whiten_ref(GAE_RAW)), atol=1e-5)
    kl = torch.full((4, 7), float("nan")).masked_fill(MASK_A.bool(), 1.0)
    _close(token_level_rewards(torch.tensor([1.0, -0.5, 2.0, 7.0]), MASK_A, kl, kl_coef=0.1),
           [[0, 0, -0.1, -0.1, 0.9, 0, 0], [0, 0, 0, -0.1, -0.1, -0.1, -0.6], [0, 1.9, 0, 0, 0, 0, 0], [0] * 7])


def test_gae_gamma_lambda_one_zero_values_is_reward_to_go() -> None:
    # with gamma = lam = 1 and V = 0, the return (un-whitened A + V) is the sum of the rewards from t on
    returns = compute_advantages("gae", scores=torch.zeros(2), group=torch.arange(2), mask=GAE_MASK,
                                        token_rewards=GAE_REWARDS, values=torch.zeros(2, 6))[1]
    _close(returns, [[0, 0.9, 0.8, 1.0, 0, 0], [0, 0, 0, -1.0, -1.0, 0]])


def test_gae_skips_unmasked_tokens_inside_a_response() -> None:
    # a masked-out hole at t=2 (e.g. a tool's output in a multi-turn response) is skipped:
    # t=3: delta = 1.0 - 0.6 = 0.4, A = 0.4; t=1: delta = 0.1 + 0.5*0.6 - 0.5 = -0.1, A = -0.1 + 0.5*0.4 = 0.1
    mask = torch.tensor([[0, 1, 0, 1, 0, 0]])
    _, ret = gae(GAE_REWARDS[:1], GAE_VALUES[:1], mask, gamma=0.5, lam=1.0)
    _close(ret, [[0, 0.1 + 0.5, 0, 0.4 + 0.6, 0, 0]])


# --- group estimators --------------------------------------------------------------------------

# interleaved groups: 5 = rows {0, 2, 4}, 2 = rows {1, 3}, 9 = row {5} (size 1), 4 = rows {6, 7} (all equal)
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.7, 0.3, 0.3])
GROUP = torch.tensor([5, 2, 5, 2, 5, 9, 4, 4])
# prompt first, ragged response lengths 2, 3, 1, 2, 3, 1, 2, 1, then padding
G_MASK = torch.tensor([[0, 1, 1, 0, 0],
                       [0, 1, 1, 1, 0],
                       [0, 0, 1, 0, 0],
                       [0, 0, 1, 1, 0],
                       [0, 0, 1, 1, 1],
                       [0, 1, 0, 0, 0],
                       [0, 0, 0, 1, 1],
                       [0, 1, 0, 0, 0]], dtype=torch.float32)
LENGTHS = [2, 3, 1, 2, 3, 1, 2, 1]


def _rows(per_sample: list[float]) -> torch.Tensor:
    """A per-sample value on every response token of its row (the reference broadcast)."""
    return _place(G_MASK, [a for a, n in zip(per_sample, LENGTHS) for _ in range(n)])


def test_grpo_unbiased_group_std() -> None:
    # group 5: [1, 0, 1], mean 2/3, unbiased var ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3, std 0.57735
    # group 2: [0, 1], mean 1/2, unbiased var (1/4 + 1/4) / 1 = 1/2, std 0.70711
    s5, s2 = math.sqrt(1 / 3), math.sqrt(1 / 2)
    expected = [(1 / 3) / s5, -0.5 / s2, (-2 / 3) / s5, 0.5 / s2, (1 / 3) / s5, 0.0, 0.0, 0.0]
    _close(grpo(SCORES, GROUP, G_MASK, eps=0.0), _rows(expected))
    # with eps the denominator is std + eps
    _close(grpo(SCORES, GROUP, G_MASK, eps=0.1), _rows([(1 / 3) / (s5 + 0.1), -0.5 / (s2 + 0.1), (-2 / 3) / (s5 + 0.1),
                                                         0.5 / (s2 + 0.1), (1 / 3) / (s5 + 0.1), 0.0, 0.0, 0.0]))


def test_grpo_without_std_normalisation() -> None:
    _close(grpo(SCORES, GROUP, G_MASK, norm_by_std=False), _rows([1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 0.0, 0.0, 0.0]))


def test_rloo_leave_one_out() -> None:
    # group 5 [1, 0, 1]: 1 - (0+1)/2, 0 - (1+1)/2, 1 - (1+0)/2; group 2 [0, 1]: 0 - 1, 1 - 0
    _close(rloo(SCORES, GROUP, G_MASK), _rows([0.5, -1.0, -1.0, 1.0, 0.5, 0.0, 0.0, 0.0]))


def test_reinforce_plus_plus_baseline() -> None:
    # centred per group as in GRPO without std, broadcast, then whitened over all 15 masked tokens
    centred = [1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 0.0, 0.0, 0.0]
    flat = [a for a, n in zip(centred, LENGTHS) for _ in range(n)]
    _close(reinforce_plus_plus_baseline(SCORES, GROUP, G_MASK), _place(G_MASK, _whiten_ref(flat)), atol=1e-5)


def test_reinforce_plus_plus_discounted_return_then_whitened() -> None:
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    rewards = torch.tensor([[J, 0.1, 0.0, 1.0, J], [J, J, -0.5, 0.0, 2.0]])
    # gamma 0.9: row 0: G3 = 1.0, G2 = 0.9, G1 = 0.1 + 0.81 = 0.91; row 1: G4 = 2.0, G3 = 1.8, G2 = -0.5 + 1.62 = 1.12
    _close(reinforce_plus_plus(rewards, mask, gamma=0.9), _place(mask, _whiten_ref([0.91, 0.9, 1.0, 1.12, 1.8, 2.0])),
           atol=1e-5)


def test_remax_greedy_baseline() -> None:
    mask = G_MASK[:3]
    _close(remax(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.5, 0.5, 0.5]), mask),
           [[0, 0.5, 0.5, 0, 0], [0, -0.5, -0.5, -0.5, 0], [0, 0, 0, 0, 0]])


# --- KL in the reward --------------------------------------------------------------------------

# a per-token KL estimate on each of the 15 response tokens of G_MASK (row-major), junk elsewhere
KL_FLAT = [0.5, -0.2, 1.0, 0.3, 0.1, 2.0, 0.4, 0.4, -1.0, 0.0, 3.0, 0.6, 0.2, 0.9, 0.7]
KL_COEF = 0.1


def _per_row(flat: list[float]) -> list[list[float]]:
    rows, k = [], 0
    for n in LENGTHS:
        rows.append(flat[k:k + n])
        k += n
    return rows


def _group_reference(scores: list[float], estimator: str) -> list[float]:
    """GRPO (unbiased std, eps 1e-6), RLOO, or the group-mean centring of REINFORCE++-baseline, by hand
    over GROUP; a group of one sample, or with all scores equal, gets 0."""
    out = []
    for i, g in enumerate(GROUP.tolist()):
        members = [scores[j] for j, h in enumerate(GROUP.tolist()) if h == g]
        n, mean = len(members), sum(members) / len(members)
        if n == 1 or max(members) == min(members):
            out.append(0.0)
        elif estimator == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            out.append((scores[i] - mean) / (std + 1e-6))
        elif estimator == "rloo":
            out.append(scores[i] - (sum(members) - scores[i]) / (n - 1))
        else:
            out.append(scores[i] - mean)
    return out


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline", "remax"])
def test_kl_in_reward_reaches_the_group_estimators(estimator: str) -> None:
    """With algorithm.use_kl_in_reward the trainer hands compute_advantages the token rewards
    (score on the last token, minus kl_coef * KL on every token): the group estimators compare the
    samples' summed token rewards r_i - kl_coef * sum_t kl_t (verl sums them the same way), ReMax
    takes their return-to-go on each token minus the greedy score. Hand-computed here; before, the
    raw scores were used and the KL never reached the gradient."""
    kl = _place(G_MASK, KL_FLAT) + J * (1 - G_MASK.double())  # junk outside the mask
    token_rewards = token_level_rewards(SCORES, G_MASK, kl, KL_COEF)
    kw = {"scores": SCORES, "group": GROUP, "mask": G_MASK, "token_rewards": token_rewards}
    raw = SCORES.tolist()
    kl_rows = _per_row(KL_FLAT)
    shaped = [r - KL_COEF * sum(k) for r, k in zip(raw, kl_rows)]
    if estimator == "remax":
        base = [0.5, 0.2, 0.9, 0.0, 1.0, 0.4, 0.3, 0.1]
        adv, _ = compute_advantages("remax", baseline_scores=torch.tensor(base), **kw)
        # on token t: the score (paid on the last token) minus kl_coef * the KL from t to the end
        flat = [r - KL_COEF * sum(k[t:]) - b for r, k, b in zip(raw, kl_rows, base) for t in range(len(k))]
        _close(adv, _place(G_MASK, flat))
        without = compute_advantages("remax", baseline_scores=torch.tensor(base), scores=SCORES, group=GROUP,
                                     mask=G_MASK)[0]
    else:
        adv, _ = compute_advantages(estimator, **kw)
        expected = _group_reference(shaped, estimator)
        if estimator == "reinforce_plus_plus_baseline":
            flat = [a for a, n in zip(expected, LENGTHS) for _ in range(n)]
            _close(adv, _place(G_MASK, _whiten_ref(flat)), atol=1e-5)
        else:
            _close(adv, _rows(expected), atol=1e-5)
        without = compute_advantages(estimator, scores=SCORES, group=GROUP, mask=G_MASK)[0]
    # the control: the KL changes the advantages (the raw scores' ones are far from these)
    assert (adv - without).abs().max() > 0.05
    # and with kl_coef 0 the token rewards give back exactly the raw scores' advantages
    plain = token_level_rewards(SCORES, G_MASK, kl, 0.0)
    base_kw = {"baseline_scores": torch.tensor([0.5] * 8)} if estimator == "remax" else {}
    assert torch.equal(compute_advantages(estimator, scores=SCORES, group=GROUP, mask=G_MASK, token_rewards=plain,
                                          **base_kw)[0],
                       compute_advantages(estimator, scores=SCORES, group=GROUP, mask=G_MASK, **base_kw)[0])


# --- dispatch ----------------------------------------------------------------------------------

def test_compute_advantages_dispatch() -> None:
    kw = {"scores": SCORES, "group": GROUP, "mask": G_MASK}
    adv, ret = compute_advantages("grpo", **kw)
    _close(adv, _rows([(1 / 3) / (math.sqrt(1 / 3) + 1e-6), -0.5 / (math.sqrt(1 / 2) + 1e-6),
                       (-2 / 3) / (math.sqrt(1 / 3) + 1e-6), 0.5 / (math.sqrt(1 / 2) + 1e-6),
                       (1 / 3) / (math.sqrt(1 / 3) + 1e-6), 0.0, 0.0, 0.0]))
    assert ret is None
    adv, _ = compute_advantages("grpo", norm_by_std=False, **kw)
    _close(adv, _rows([1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 0.0, 0.0, 0.0]))
    _close(compute_advantages("rloo", **kw)[0], _rows([0.5, -1.0, -1.0, 1.0, 0.5, 0.0, 0.0, 0.0]))
    flat = [a for a, n in zip([1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 0.0, 0.0, 0.0], LENGTHS) for _ in range(n)]
    _close(compute_advantages("reinforce_plus_plus_baseline", **kw)[0], _place(G_MASK, _whiten_ref(flat)), atol=1e-5)
    adv, _ = compute_advantages("remax", baseline_scores=torch.full((8,), 0.5), **kw)
    _close(adv, _rows([0.5, -0.5, -0.5, 0.5, 0.5, 0.2, -0.2, -0.2]))
    # gae and reinforce_plus_plus with explicit token rewards
    adv, ret = compute_advantages("gae", scores=torch.zeros(2), group=torch.arange(2), mask=GAE_MASK,
                                  token_rewards=GAE_REWARDS, values=GAE_VALUES, gamma=0.9, lam=0.8)
    _close(ret, GAE_RETURNS)
    _close(adv, _place(GAE_MASK, _whiten_ref(GAE_RAW)), atol=1e-5)
    # reinforce_plus_plus from scores only: the score sits on the last token; gamma 0.5 discounts it
    # row lengths 2 and 3 of G_MASK[:2]: row 0 [0.5, 1.0] * 1.0, row 1 [0.25, 0.5, 1.0] * 0.0
    adv, ret = compute_advantages("reinforce_plus_plus", scores=torch.tensor([1.0, 0.0]), group=torch.arange(2),
                                  mask=G_MASK[:2], gamma=0.5)
    _close(adv, _place(G_MASK[:2], _whiten_ref([0.5, 1.0, 0.0, 0.0, 0.0])), atol=1e-5)
    assert ret is None


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                  "remax"])
def test_compute_advantages_zero_outside_mask(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    adv, ret = compute_advantages(name, scores=torch.randn(8, generator=g), group=GROUP, mask=G_MASK,
                                  values=torch.randn(8, 5, generator=g), baseline_scores=torch.randn(8, generator=g),
                                  gamma=0.9, lam=0.95)
    assert adv.shape == G_MASK.shape and torch.isfinite(adv).all()
    assert (adv[G_MASK == 0] == 0).all()
    if ret is not None:
        assert (ret[G_MASK == 0] == 0).all()


def test_compute_advantages_errors() -> None:
    kw = {"scores": SCORES, "group": GROUP, "mask": G_MASK}
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator.*'ppo'.*gae, grpo, rloo, reinforce_plus_plus, "
                                         r"reinforce_plus_plus_baseline, remax"):
        compute_advantages("ppo", **kw)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", **kw)
    with pytest.raises(ValueError, match="baseline_scores"):
        compute_advantages("remax", **kw)


# --- KL controllers ----------------------------------------------------------------------------

def test_adaptive_kl_controller_trajectory() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    # KL 9: error 9/6 - 1 = 0.5, clipped to 0.2; beta *= 1 + 0.2 * 256/10000 = 1.00512
    ctl.update(9.0, 256)
    assert ctl.value == pytest.approx(0.201024, rel=1e-12)
    # KL 6.6: error 0.1 (inside the clip); beta *= 1 + 0.1 * 512/10000 = 1.00512
    ctl.update(6.6, 512)
    assert ctl.value == pytest.approx(0.20205324288, rel=1e-12)
    # KL 0: error -1 clipped to -0.2; beta *= 1 - 0.2 * 0.1 = 0.98
    ctl.update(0.0, 1000)
    assert ctl.value == pytest.approx(0.1980121780224, rel=1e-12)
    # KL 5.7: error -0.05; beta *= 1 - 0.05 * 0.1 = 0.995
    ctl.update(5.7, 1000)
    assert ctl.value == pytest.approx(0.197022117132288, rel=1e-12)
    # resume: the state is the coefficient
    other = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value
    other.update(6.0, 1000)  # on target: unchanged
    assert other.value == ctl.value


def test_fixed_kl_controller_and_factory() -> None:
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    restored = FixedKLController(0.0)
    restored.load_state_dict(fixed.state_dict())
    assert restored.value == 0.05

    ctl = make_kl_controller({"type": "fixed", "kl_coef": 0.01, "target_kl": 0.1, "horizon": 10})
    assert isinstance(ctl, FixedKLController) and ctl.value == 0.01
    ctl = make_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.5, "horizon": 100})
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(1.0, 10)  # error clipped to 0.2: 0.1 * (1 + 0.2 * 10/100)
    assert ctl.value == pytest.approx(0.102)
    ctl = make_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.3, target_kl=1.0, horizon=50))
    assert isinstance(ctl, AdaptiveKLController) and ctl.value == 0.3
    with pytest.raises(ValueError, match=r"algorithm\.kl_ctrl\.type='pid'.*fixed, adaptive"):
        make_kl_controller({"type": "pid", "kl_coef": 0.1})
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.0, "horizon": 100})


# --- DAPO sampling -----------------------------------------------------------------------------

def test_groups_with_signal() -> None:
    # group 5 {1, 0, 1} and group 2 {0, 1} vary; group 9 has one sample; group 4 {0.3, 0.3} agrees
    assert groups_with_signal(SCORES, GROUP).tolist() == [True, True, True, True, True, False, False, False]
    assert groups_with_signal(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0])).tolist() == [False] * 3


def test_overlong_penalty_boundaries() -> None:
    lengths = torch.tensor([0, 15, 16, 17, 18, 19, 20, 25])
    # max 20, buffer 4: free up to 16, then (16 - len) / 4, -1 at 20 and beyond
    _close(overlong_penalty(lengths, 20, 4, 1.0), [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0])
    _close(overlong_penalty(lengths, 20, 4, 0.5), [0, 0, 0, -0.125, -0.25, -0.375, -0.5, -0.5])
    _close(overlong_penalty(lengths, 20, 0, 1.0), [0.0] * 8)
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(lengths, 20, -1, 1.0)


def test_group_without_signal_is_exactly_zero() -> None:
    # three equal float64 scores of 0.1: their float mean is 0.1 - 1.4e-17, so r - mean is rounding
    # noise and, with eps = 0, noise / noise-sized std would be an O(1) GRPO advantage. It must be 0.
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7], dtype=torch.float64)
    group = torch.tensor([0, 0, 0, 1])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 0, 1], [0, 1, 1]])
    assert (scores[:3] - scores[:3].sum() / 3).abs().max() > 0  # the premise: the mean does round
    for adv in (grpo(scores, group, mask, eps=0.0), rloo(scores, group, mask),
                reinforce_plus_plus_baseline(scores, group, mask)):
        assert (adv == 0).all()
