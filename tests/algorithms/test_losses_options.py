"""Shared options: entropy-based advantage, KL mask variants, dH estimates, quadrant metrics."""
import math

import pytest
import torch

from megatron_tepo.algorithms import compute_policy_loss

# One row of six valid tokens (plus one padding position), hand-built quadrants.
ADV = [[1.0, 1.0, -1.0, -1.0, 0.0, 2.0, 5.0]]
ENT = [[0.5, 1.5, 1.5, 0.5, 1.0, 1.0, 9.0]]
OLD_ENT = [[1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0]]  # measured dH: -, +, +, -, +, 0
LP = [[-0.5, -1.0, -0.2, -2.0, -0.7, -0.3, -1.0]]
OLD = [[-0.4, -1.1, -0.3, -1.5, -0.7, -0.1, -1.0]]
MASK = [[1, 1, 1, 1, 1, 1, 0]]
N = 6


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _run(name="tepo", **kw):
    return compute_policy_loss(name, _t(LP), _t(OLD), _t(ADV), torch.tensor(MASK), entropy=_t(ENT),
                               old_entropy=_t(OLD_ENT), **kw)


def test_quadrant_metrics_measured():
    _, m = _run()
    assert m["quad_pos_adv_dec_ent"].item() == pytest.approx(1 / N)  # token 0
    assert m["quad_pos_adv_inc_ent"].item() == pytest.approx(1 / N)  # token 1 (token 5: dH = 0)
    assert m["quad_neg_adv_inc_ent"].item() == pytest.approx(1 / N)  # token 2
    assert m["quad_neg_adv_dec_ent"].item() == pytest.approx(1 / N)  # token 3 (token 4: A = 0)
    assert m["entropy"].item() == pytest.approx(sum(ENT[0][:6]) / N)


def test_quadrant_metrics_predicted():
    # dH = -A (l + H): t0: -(1)(-0.5+0.5)=0; t1: -(1)(0.5)<0; t2: +(1.3)>0; t3: +(-1.5)<0; t5: -2(0.7)<0
    _, m = _run(delta_entropy="predicted")
    assert m["quad_pos_adv_dec_ent"].item() == pytest.approx(2 / N)  # t1, t5
    assert m["quad_pos_adv_inc_ent"].item() == 0.0
    assert m["quad_neg_adv_inc_ent"].item() == pytest.approx(1 / N)  # t2
    assert m["quad_neg_adv_dec_ent"].item() == pytest.approx(1 / N)  # t3
    # without the current entropy the old one is used: t0 -(1)(-0.5+1.0) < 0, t1 -(1)(-1+1) = 0, t5 < 0
    _, m = compute_policy_loss("tepo", _t(LP), _t(OLD), _t(ADV), torch.tensor(MASK), old_entropy=_t(OLD_ENT),
                               delta_entropy="predicted")
    assert m["quad_pos_adv_dec_ent"].item() == pytest.approx(2 / N)  # t0, t5


def _k3(t):
    d = OLD[0][t] - LP[0][t]
    return math.exp(d) - d - 1


@pytest.mark.parametrize(
    "kind,tokens",
    [("none", []), ("all", [0, 1, 2, 3, 4, 5]), ("pos_adv_dec_entropy", [0]), ("neg_adv_inc_entropy", [2]),
     ("either", [0, 2])],
)
def test_kl_term_follows_the_mask(kind, tokens):
    base, _ = _run()
    loss, m = _run(kl_coef=0.3, kl_mask=kind)
    assert loss.item() == pytest.approx(base.item() + 0.3 * sum(_k3(t) for t in tokens) / N, rel=1e-12)
    assert m["kl_mask_frac"].item() == pytest.approx(len(tokens) / N)
    expected_kl = sum(_k3(t) for t in tokens) / len(tokens) if tokens else 0.0
    assert m["kl"].item() == pytest.approx(expected_kl, rel=1e-6)


def test_kl_gradient_only_on_masked_tokens():
    lp = _t(LP).requires_grad_(True)
    lp0 = _t(LP).requires_grad_(True)
    kw = dict(entropy=_t(ENT), old_entropy=_t(OLD_ENT))
    loss, _ = compute_policy_loss("tepo", lp, _t(OLD), _t(ADV), torch.tensor(MASK), kl_coef=1.0, **kw)
    base, _ = compute_policy_loss("tepo", lp0, _t(OLD), _t(ADV), torch.tensor(MASK), **kw)
    loss.backward()
    base.backward()
    diff = lp.grad - lp0.grad
    # d k3 / dl at token 0 = 1 - exp(lo - l), divided by N
    assert diff[0, 0].item() == pytest.approx((1 - math.exp(OLD[0][0] - LP[0][0])) / N, rel=1e-9)
    assert (diff[0, 1:] == 0).all()


def test_entropy_based_advantage():
    # gpg: dL/dl = -A'/N, so the gradient exposes the shaped advantage A' = A + min(alpha H, |A|/kappa)
    lp = _t(LP).requires_grad_(True)
    loss, _ = compute_policy_loss("gpg", lp, _t(OLD), _t(ADV), torch.tensor(MASK), entropy=_t(ENT),
                                  entropy_adv_alpha=0.4, entropy_adv_kappa=2.0)
    loss.backward()
    shaped = [1.0 + min(0.2, 0.5), 1.0 + min(0.6, 0.5), -1.0 + min(0.6, 0.5), -1.0 + min(0.2, 0.5), 0.0,
              2.0 + min(0.4, 1.0)]
    assert shaped == pytest.approx([1.2, 1.5, -0.5, -0.8, 0.0, 2.4])
    torch.testing.assert_close(lp.grad[0, :6], -_t(shaped) / N)
    assert lp.grad[0, 6].item() == 0.0
    # the entropy enters detached: no gradient reaches it through the advantage
    ent = _t(ENT).requires_grad_(True)
    loss, _ = compute_policy_loss("gpg", _t(LP).requires_grad_(True), _t(OLD), _t(ADV), torch.tensor(MASK),
                                  entropy=ent, entropy_adv_alpha=0.4)
    loss.backward()
    assert ent.grad is None or (ent.grad == 0).all()
