"""PPO-family losses and KL estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algos.losses import kl_estimate, ppo_policy_loss, token_weights, truncated_is_weights, value_loss


def _loss(ratio: float, adv: float, **kw) -> tuple[float, bool]:
    lp = torch.tensor([math.log(ratio)])
    loss, clipped = ppo_policy_loss(lp, torch.zeros(1), torch.tensor([adv]), **kw)
    return loss.item(), bool(clipped.item())


@pytest.mark.parametrize("ratio,adv,kw,expect,clipped", [
    (1.5, 2.0, {}, -1.2 * 2.0, True),         # A>0, ratio above 1+eps: clipped
    (0.5, 2.0, {}, -0.5 * 2.0, False),        # A>0, ratio below 1-eps: pessimistic = unclipped
    (1.5, -2.0, {}, 1.5 * 2.0, False),        # A<0, ratio above: unclipped is larger
    (0.5, -2.0, {}, 0.8 * 2.0, True),         # A<0, ratio below 1-eps: clipped
    (5.0, -2.0, {"dual_clip_c": 3.0}, 3.0 * 2.0, False),  # dual clip caps at c*|A|
    (1.5, -2.0, {"dual_clip_c": 3.0}, 1.5 * 2.0, False),  # under the cap: unchanged
    (1.25, 1.0, {"clip_low": 0.2, "clip_high": 0.28}, -1.25, False),  # DAPO clip-higher lets it through
    (1.25, 1.0, {"clip_low": 0.2, "clip_high": 0.2}, -1.2, True),
])
def test_ppo_clip_cases(ratio, adv, kw, expect, clipped) -> None:
    loss, was_clipped = _loss(ratio, adv, **kw)
    assert loss == pytest.approx(expect, abs=1e-6)
    assert was_clipped == clipped


def test_ppo_gradient_is_zero_where_clipped() -> None:
    lp = torch.tensor([math.log(1.5), math.log(1.1)], requires_grad=True)
    loss, _ = ppo_policy_loss(lp, torch.zeros(2), torch.tensor([1.0, 1.0]))
    loss.sum().backward()
    assert lp.grad[0] == 0 and lp.grad[1] == pytest.approx(-1.1)


def test_kl_estimators() -> None:
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-1.0))
    assert kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")


def test_clipped_value_loss() -> None:
    loss, clipped = value_loss(torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([2.0]), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * 1.3 ** 2) and clipped.item()
    loss, clipped = value_loss(torch.tensor([0.6]), torch.tensor([0.5]), torch.tensor([2.0]), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * 1.4 ** 2) and not clipped.item()


def test_token_weights_aggregation_modes() -> None:
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0, 1.0])]
    tm = token_weights(masks, "token-mean")
    assert torch.allclose(tm[0], torch.tensor([1, 1, 0]) / 6) and torch.allclose(tm[1], torch.full((4,), 1 / 6))
    sm = token_weights(masks, "seq-mean-token-mean")
    assert torch.allclose(sm[0], torch.tensor([0.25, 0.25, 0.0])) and torch.allclose(sm[1], torch.full((4,), 0.125))
    ss = token_weights(masks, "seq-mean-token-sum")
    assert torch.allclose(ss[0], torch.tensor([0.5, 0.5, 0.0])) and torch.allclose(ss[1], torch.full((4,), 0.5))
    for w in (tm, sm):
        assert sum(float(x.sum()) for x in w) == pytest.approx(1.0)


@pytest.mark.parametrize("ratio,adv,expect,clipped", [
    (1.5, 2.0, -1.3 * 2.0, True),     # A>0, ratio above 1+clip_high = 1.3: clipped at 1.3
    (1.25, 2.0, -1.25 * 2.0, False),  # A>0, inside the wider upper bound: unclipped (0.2 would clip it)
    (0.5, 2.0, -0.5 * 2.0, False),    # A>0, ratio below 1-clip_low = 0.9: unclipped (pessimistic)
    (0.85, -2.0, 0.9 * 2.0, True),    # A<0, ratio below 1-clip_low = 0.9: clipped at 0.9 (0.2 would not)
    (0.95, -2.0, 0.95 * 2.0, False),  # A<0, inside the bounds
    (1.5, -2.0, 1.5 * 2.0, False),    # A<0, ratio above 1+clip_high: unclipped (pessimistic)
    (1.5, 0.0, 0.0, False),           # A=0: no loss either way
])
def test_ppo_clip_higher_asymmetric_bounds(ratio, adv, expect, clipped) -> None:
    loss, was_clipped = _loss(ratio, adv, clip_low=0.1, clip_high=0.3)
    assert loss == pytest.approx(expect, abs=1e-6)
    assert was_clipped == clipped


def test_ppo_all_cases_per_token_with_dual_clip_and_gradients() -> None:
    # one token per case, clip_low 0.2, clip_high 0.28, dual clip c = 3
    ratios = [1.5, 0.5, 0.5, 1.5, 5.0, 3.5, 2.9, 5.0]
    advs = [1.0, 1.0, -2.0, -2.0, -2.0, -2.0, -2.0, 2.0]
    expect = [-1.28 * 1.0,  # A>0 above 1.28: clipped
              -0.5 * 1.0,   # A>0 below 0.8: unclipped
              0.8 * 2.0,    # A<0 below 0.8: clipped at 0.8 (under the dual cap 6)
              1.5 * 2.0,    # A<0 above: unclipped (under the cap)
              3.0 * 2.0,    # A<0, huge ratio: dual clip caps at c*|A| = 6 instead of 10
              3.0 * 2.0,    # A<0, ratio 3.5 just over c: 7 capped to 6
              2.9 * 2.0,    # A<0, ratio 2.9 under c: 5.8, the cap is not active
              -1.28 * 2.0]  # A>0, huge ratio: ordinary clip, the dual clip only applies to A<0
    lp = torch.tensor([math.log(r) for r in ratios], requires_grad=True)
    loss, clipped = ppo_policy_loss(lp, torch.zeros(8), torch.tensor(advs), clip_low=0.2, clip_high=0.28,
                                    dual_clip_c=3.0)
    assert torch.allclose(loss, torch.tensor(expect), atol=1e-5)
    # was_clipped reports the ordinary clip only (the dual cap is not counted as clipped)
    assert clipped.tolist() == [True, False, True, False, False, False, False, True]
    loss.sum().backward()
    # d/dlp of -A * ratio is -A * ratio where the unclipped term is active; 0 where clipped or capped
    grad = [0.0, -0.5, 0.0, 3.0, 0.0, 0.0, 5.8, 0.0]
    assert torch.allclose(lp.grad, torch.tensor(grad), atol=1e-5)


def test_kl_estimators_per_token_by_hand() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5, -0.2])
    ref = torch.tensor([-2.0, -1.0, -0.5, -0.5])
    # log r = lp - ref = [1, -1, 0, 0.3]
    assert torch.allclose(kl_estimate(lp, ref, "k1"), torch.tensor([1.0, -1.0, 0.0, 0.3]), atol=1e-6)
    # (log r)^2 / 2
    assert torch.allclose(kl_estimate(lp, ref, "k2"), torch.tensor([0.5, 0.5, 0.0, 0.045]), atol=1e-6)
    # exp(-log r) - 1 + log r: e^-1 - 1 + 1 = 0.3678794, e - 1 - 1 = 0.7182818, 0, e^-0.3 - 0.7 = 0.0408182
    assert torch.allclose(kl_estimate(lp, ref, "k3"), torch.tensor([0.3678794, 0.7182818, 0.0, 0.0408182]),
                          atol=1e-6)


def test_token_weights_aggregate_losses_by_hand() -> None:
    # per-token losses of three responses (one of them empty); junk at unmasked positions
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([0.0, 0.0])]
    losses = [torch.tensor([1.0, 2.0, 50.0]), torch.tensor([3.0, 4.0, 5.0, 6.0]), torch.tensor([70.0, 80.0])]

    def agg(mode: str) -> float:
        return sum(float((w * x).sum()) for w, x in zip(token_weights(masks, mode), losses))

    assert agg("token-mean") == pytest.approx((1 + 2 + 3 + 4 + 5 + 6) / 6)           # 3.5
    assert agg("seq-mean-token-mean") == pytest.approx(((1 + 2) / 2 + (3 + 4 + 5 + 6) / 4 + 0) / 3)  # 2.0
    assert agg("seq-mean-token-sum") == pytest.approx(((1 + 2) + (3 + 4 + 5 + 6) + 0) / 3)  # 7.0
    sm = token_weights(masks, "seq-mean-token-mean")
    assert torch.allclose(sm[0], torch.tensor([1 / 6, 1 / 6, 0.0])) and torch.allclose(sm[1], torch.full((4,), 1 / 12))
    assert (sm[2] == 0).all()
    with pytest.raises(ValueError, match="seq-sum"):
        token_weights(masks, "seq-sum")


def test_k3_is_bounded_like_verl() -> None:
    # a token the reference finds e^-30 times less likely: exp(30) - 31 would swamp the loss; the log
    # ratio is cut to 20 and k3 to 10. The other way round k3 = e^-20 + 19 is cut to 10 as well.
    lp = torch.tensor([0.0, -30.0, -1.0])
    ref = torch.tensor([-30.0, 0.0, -2.0])
    k3 = kl_estimate(lp, ref, "k3")
    assert k3[0].item() == 10.0 and k3[1].item() == 10.0
    assert k3[2].item() == pytest.approx(math.exp(-1.0))  # inside the bounds: unchanged
    # no overflow in the gradient either (exp of a huge log ratio would give inf * 0 = nan)
    lp = torch.tensor([-200.0, -1.0], requires_grad=True)
    kl_estimate(lp, torch.tensor([0.0, -2.0]), "k3").sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_minibatches_shuffle_prompts_with_their_samples_together() -> None:
    """With a prompt index per sample, the shuffle permutes prompts: each prompt's samples stay
    together in rollout order, in one mini-batch and one DP part (where the engine packs the
    prompt once), still seeded and covering every sample once."""
    from hpcrl.controller.batch import Batch
    from hpcrl.workers.batching import arrange_minibatches, minibatch_rows

    n, prompts, n_mb, dp = 4, 8, 2, 2
    groups = [p for p in range(prompts) for _ in range(n)]
    rows = minibatch_rows(len(groups), n_mb, shuffle_seed=3, groups=groups)
    assert rows == minibatch_rows(len(groups), n_mb, shuffle_seed=3, groups=groups)
    assert rows != minibatch_rows(len(groups), n_mb, shuffle_seed=4, groups=groups)
    flat = sum(rows, [])
    assert sorted(flat) == list(range(len(groups)))
    assert [groups[i] for i in flat] != groups  # shuffled ...
    for k in range(0, len(flat), n):  # ... by whole prompts, their samples in order
        assert flat[k:k + n] == list(range(flat[k], flat[k] + n)) and flat[k] % n == 0
    mask = torch.ones(len(groups), 3)
    batch = Batch({"row": torch.arange(len(groups)), "prompt_index": torch.tensor(groups), "response_mask": mask})
    out = arrange_minibatches(batch, n_mb, dp, "token-mean", shuffle_seed=3)
    for shard in out["prompt_index"].chunk(dp):
        for part in shard.chunk(n_mb):  # a rank's part of one mini-batch: whole prompts
            assert all(int((part == g).sum()) in (0, n) for g in range(prompts)), part


def test_minibatches_by_sample_deal_out_each_prompts_samples() -> None:
    """actor.minibatch_by=sample (group_key=None): the shuffle permutes samples, as TRL's GRPOTrainer
    does, so a prompt's samples land in different mini-batches; the same seed cuts the same ones."""
    from hpcrl.controller.batch import Batch
    from hpcrl.workers.batching import arrange_minibatches, minibatch_rows

    n, prompts, n_mb, dp = 4, 8, 2, 2
    groups = [p for p in range(prompts) for _ in range(n)]
    mask = torch.ones(len(groups), 3)
    batch = Batch({"row": torch.arange(len(groups)), "prompt_index": torch.tensor(groups), "response_mask": mask})
    by_sample = arrange_minibatches(batch, n_mb, dp, "token-mean", shuffle_seed=3, group_key=None)
    by_prompt = arrange_minibatches(batch, n_mb, dp, "token-mean", shuffle_seed=3)
    rows = minibatch_rows(len(groups), n_mb, shuffle_seed=3)  # the per-sample permutation
    shards = by_sample["row"].chunk(dp)
    for k in range(n_mb):
        assert sorted(int(r) for s in shards for r in s.chunk(n_mb)[k]) == sorted(rows[k])
    split = [g for g in range(prompts) if 0 < sum(groups[i] == g for i in rows[0]) < n]
    assert split, "no prompt's samples were dealt to two mini-batches"
    assert not torch.equal(by_sample["row"], by_prompt["row"])
    assert torch.equal(by_sample["row"], arrange_minibatches(batch, n_mb, dp, "token-mean", shuffle_seed=3,
                                                             group_key=None)["row"])
    # inside a mini-batch a prompt's samples sit on one rank, but for at most one prompt per cut
    # between two ranks: a prompt is packed about once per mini-batch, not once per (mini-batch, rank)
    shards = by_sample["prompt_index"].chunk(dp)
    parts = [[[int(g) for g in s.chunk(n_mb)[k]] for s in shards] for k in range(n_mb)]  # [mini-batch][rank]
    for k in range(n_mb):
        on_ranks = sum(len(set(p)) for p in parts[k])
        assert on_ranks <= len(set(groups[i] for i in rows[k])) + dp - 1, parts
    m = len(rows[0]) // dp  # the permutation's order cut into ranks as it falls, for comparison
    dealt = [[groups[r] for r in rows[k][d * m:(d + 1) * m]] for k in range(n_mb) for d in range(dp)]
    assert sum(len(set(p)) for mb in parts for p in mb) < sum(len(set(p)) for p in dealt)


def test_shuffled_minibatches_are_seeded_and_weighted_per_minibatch() -> None:
    from hpcrl.controller.batch import Batch
    from hpcrl.workers.batching import arrange_minibatches, minibatch_rows

    b, n_mb, dp = 16, 2, 2
    mask = torch.zeros(b, 6)
    for i in range(b):
        mask[i, 1:2 + i % 5] = 1  # 1..5 response tokens
    batch = Batch({"row": torch.arange(b), "response_mask": mask})
    rows = minibatch_rows(b, n_mb, shuffle_seed=3)
    assert rows == minibatch_rows(b, n_mb, shuffle_seed=3)  # a function of the seed: the same on resume
    assert rows != minibatch_rows(b, n_mb, shuffle_seed=4) and sorted(sum(rows, [])) == list(range(b))
    assert rows[0] != list(range(8))  # not in rollout order
    assert minibatch_rows(b, n_mb) == [list(range(8)), list(range(8, 16))]  # shuffle off
    out = arrange_minibatches(batch, n_mb, dp, "token-mean", shuffle_seed=3)
    # DP shard d holds part d of mini-batch 0, then part d of mini-batch 1; a rank cuts its shard
    # into n_mb contiguous chunks: together the DP parts of chunk k are mini-batch k
    shards = out["row"].chunk(dp)
    for k in range(n_mb):
        got = sorted(int(r) for s in shards for r in s.chunk(n_mb)[k])
        assert got == sorted(rows[k])
        # token-mean weights are normalised over the whole mini-batch (all DP parts together)
        w = sum(float(out["loss_weight"][j].sum()) for j, r in enumerate(out["row"].tolist()) if r in rows[k])
        assert w == pytest.approx(1.0)


def test_truncated_importance_weights_by_hand() -> None:
    """TIS (algorithm.rollout_correction=tis): w = min(p_old / p_rollout, cap) on the response tokens,
    0 elsewhere. Probabilities chosen so the ratios are 0.5, 1, 1.5 and 4 (capped at 2)."""
    p_old = torch.tensor([[0.0, 0.2, 0.3, 0.3, 0.8]])
    p_rollout = torch.tensor([[0.0, 0.4, 0.3, 0.2, 0.2]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]])
    old = torch.where(mask.bool(), p_old.clamp(min=1e-9).log(), torch.zeros(()))
    rollout = torch.where(mask.bool(), p_rollout.clamp(min=1e-9).log(), torch.zeros(()))
    w, m = truncated_is_weights(old, rollout, mask, cap=2.0)
    assert w[0].tolist() == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0], abs=1e-6)
    assert m["rollout_is/weight_mean"] == pytest.approx((0.5 + 1.0 + 1.5 + 2.0) / 4, abs=1e-6)
    assert m["rollout_is/ratio_max"] == pytest.approx(4.0, rel=1e-6)
    assert m["rollout_is/truncated_frac"] == pytest.approx(0.25)


def test_masked_importance_weights_by_hand() -> None:
    """MIS (algorithm.rollout_correction=mis): the same ratios 0.5, 1, 1.5, 4 with cap 2 give weights
    0.5, 1, 1.5 and 0 (the token above the cap is masked, not truncated)."""
    p_old = torch.tensor([[0.2, 0.3, 0.3, 0.8]])
    p_rollout = torch.tensor([[0.4, 0.3, 0.2, 0.2]])
    mask = torch.ones(1, 4)
    w, m = truncated_is_weights(p_old.log(), p_rollout.log(), mask, cap=2.0, mode="mis")
    assert w[0].tolist() == pytest.approx([0.5, 1.0, 1.5, 0.0], abs=1e-6)
    assert m["rollout_is/weight_mean"] == pytest.approx(3.0 / 4, abs=1e-6)
    assert m["rollout_is/truncated_frac"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="mode 'cap'"):
        truncated_is_weights(p_old.log(), p_rollout.log(), mask, cap=2.0, mode="cap")


def test_decoupled_ppo_objective_by_hand() -> None:
    """The decoupled PPO objective (behaviour = the rollout engine's policy, proximal = the trainer's
    recomputed old policy): per token -w * min(r A, clip(r, 0.8, 1.2) A) with r = pi / pi_prox and
    w from pi_prox / pi_behav. Four tokens, worked out by hand:

      pi     pi_prox  pi_behav  A     r     clip(r)  min(rA, clip(r)A)   prox/behav  w tis  w mis
      0.30   0.20     0.40      +1    1.5   1.2      1.2                 0.5         0.5    0.5
      0.10   0.20     0.10      -2    0.5   0.8      -1.6                2.0         2.0    2.0
      0.22   0.20     0.05      +1    1.1   1.1      1.1                 4.0         3.0    0
      0.09   0.10     0.10      -1    0.9   0.9      -0.9                1.0         1.0    1.0

    loss tis = -(0.5 * 1.2 + 2 * -1.6 + 3 * 1.1 + 1 * -0.9) / 4 = -(0.6 - 3.2 + 3.3 - 0.9) / 4 = 0.05
    loss mis = -(0.6 - 3.2 + 0 - 0.9) / 4 = 0.875"""
    pi = torch.tensor([[0.30, 0.10, 0.22, 0.09]])
    prox = torch.tensor([[0.20, 0.20, 0.20, 0.10]])
    behav = torch.tensor([[0.40, 0.10, 0.05, 0.10]])
    adv = torch.tensor([[1.0, -2.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    per_token, clipped = ppo_policy_loss(pi.log(), prox.log(), adv, 0.2, 0.2)
    assert (-per_token[0]).tolist() == pytest.approx([1.2, -1.6, 1.1, -0.9], abs=1e-6)
    assert clipped[0].tolist() == [True, True, False, False]
    for mode, cap, expected in (("tis", 3.0, 0.05), ("mis", 3.0, 0.875)):
        w, _ = truncated_is_weights(prox.log(), behav.log(), mask, cap=cap, mode=mode)
        assert float((w * per_token).mean()) == pytest.approx(expected, abs=1e-6), mode
    # without the weights the loss is the plain clipped surrogate against the proximal policy
    assert float(per_token.mean()) == pytest.approx(-(1.2 - 1.6 + 1.1 - 0.9) / 4, abs=1e-6)
