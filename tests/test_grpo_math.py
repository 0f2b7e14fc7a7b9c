import math

import pytest
import torch

from fastgrpo.grpo.advantages import group_advantages, informative_groups
from fastgrpo.grpo.loss import policy_loss


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    a = group_advantages(r)
    # group 0: mean 0.5, unbiased std sqrt(1/3)
    assert a[0].tolist() == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], rel=1e-5)
    assert a[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    # group 2: mean 0.75, unbiased std 1.5
    assert a[2].tolist() == pytest.approx([2.25 / 1.5, -0.5, -0.5, -0.5], rel=1e-5)
    centred = group_advantages(r, scale_by_std=False)
    assert centred[2].tolist() == pytest.approx([2.25, -0.75, -0.75, -0.75])
    assert informative_groups(r).tolist() == [True, False, True]
    with pytest.raises(ValueError):
        group_advantages(torch.ones(3, 1))


def _loss(logp, old, adv, mask, agg="token_mean", **kw):
    mask = torch.tensor(mask, dtype=torch.bool)
    norm = float(mask.sum()) if agg == "token_mean" else float(mask.shape[0])
    return policy_loss(torch.tensor(logp, requires_grad=True) if not isinstance(logp, torch.Tensor) else logp,
                       torch.tensor(old), torch.tensor(adv), mask, eps_low=0.2, eps_high=0.28,
                       aggregation=agg, normaliser=norm, **kw)


def test_clipped_loss_by_hand():
    old = [[0.0, 0.0]]
    logp = [[math.log(1.5), math.log(0.5)]]  # ratios 1.5 and 0.5
    # A = +1: token 1 clipped at 1.28, token 2 unclipped 0.5
    t = _loss(logp, old, [1.0], [[1, 1]])
    assert t.loss.item() == pytest.approx(-(1.28 + 0.5) / 2, rel=1e-6)
    assert t.clipped_tokens.item() == 1
    # A = -1: token 1 unclipped -1.5, token 2 clipped at 0.8
    t = _loss(logp, old, [-1.0], [[1, 1]])
    assert t.loss.item() == pytest.approx((1.5 + 0.8) / 2, rel=1e-6)
    assert t.clipped_tokens.item() == 1


def test_clipped_tokens_get_no_gradient():
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    t = _loss(logp, [[0.0, 0.0]], [2.0], [[1, 1]])
    t.loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped: no push beyond 1 + eps_high
    assert logp.grad[0, 1].item() == pytest.approx(-2.0 * 1.1 / 2, rel=1e-5)  # d(-rho A)/dlogp / N


def test_sequence_mean_and_mask():
    logp = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    old = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # ratio 1: per-token loss = -A; seq 0 has 3 tokens with A=1, seq 1 has 1 token with A=-3
    mask = [[1, 1, 1], [1, 0, 0]]
    tok = _loss(logp, old, [1.0, -3.0], mask, "token_mean")
    assert tok.loss.item() == pytest.approx((-3 + 3) / 4)
    seq = _loss(logp, old, [1.0, -3.0], mask, "seq_mean")
    assert seq.loss.item() == pytest.approx((-1 + 3) / 2)


def test_tis_weight_and_k3_kl():
    old = [[0.0]]
    logp = torch.tensor([[0.0]], requires_grad=True)
    w = torch.tensor([[0.5]])
    ref = torch.tensor([[math.log(2.0)]])  # d = ref - logp = ln 2: k3 = 2 - ln2 - 1
    t = _loss(logp, old, [1.0], [[1]], correction_weight=w, ref_logp=ref, kl_coef=0.1)
    k3 = 2 - math.log(2) - 1
    assert t.loss.item() == pytest.approx(-0.5 + 0.1 * k3, rel=1e-6)
    assert t.kl_ref_sum.item() == pytest.approx(k3, rel=1e-6)
