"""PPO-family losses and KL estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algos.losses import kl_estimate, ppo_policy_loss, token_weights, value_loss


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
