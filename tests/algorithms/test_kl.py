"""KL estimators, KL masks, and the sign of the predicted entropy change."""
import math

import pytest
import torch

from megatron_tepo.algorithms import KL_MASKS, kl_mask, kl_penalty, predicted_entropy_change

L = [-0.5, -2.0, -1.0, -0.1]
LR = [-1.0, -0.5, -1.0, -3.0]


@pytest.mark.parametrize(
    "estimator,fn",
    [
        ("k1", lambda l, lr: l - lr),
        ("k2", lambda l, lr: 0.5 * (l - lr) ** 2),
        ("k3", lambda l, lr: math.exp(lr - l) - (lr - l) - 1.0),
        ("abs", lambda l, lr: abs(l - lr)),
    ],
)
def test_estimator_values(estimator, fn):
    out = kl_penalty(torch.tensor(L), torch.tensor(LR), estimator)
    torch.testing.assert_close(out, torch.tensor([fn(a, b) for a, b in zip(L, LR)]))


def test_k3_literal_and_nonnegative():
    # l = 0, lr = ln 2: exp(ln 2) - ln 2 - 1 = 1 - ln 2
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([math.log(2.0)]), "k3").item() == pytest.approx(1 - math.log(2))
    torch.manual_seed(0)
    out = kl_penalty(torch.randn(1000) * 5, torch.randn(1000) * 5, "k3")
    assert (out >= 0).all()


def test_k3_clamped_finite_with_finite_grad():
    l = torch.tensor([1e4, -1e4, 0.0], requires_grad=True)
    out = kl_penalty(l, torch.tensor([0.0, 0.0, -float("inf")]), "k3")
    assert torch.isfinite(out).all()
    # d = clamp(lr - l, -20, 20) = (-20, 20, -20)
    torch.testing.assert_close(out, torch.tensor([math.exp(-20) + 19, math.exp(20) - 21, math.exp(-20) + 19]))
    out.sum().backward()
    assert torch.isfinite(l.grad).all()


def test_unknown_estimator_lists_valid():
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_kl_mask_kinds():
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0, 1.0]])
    d_h = torch.tensor([[-0.5, 0.5, 0.5, -0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    expected = {
        "none": [0, 0, 0, 0, 0, 0],
        "all": [1, 1, 1, 1, 1, 0],
        "pos_adv_dec_entropy": [1, 0, 0, 0, 0, 0],  # last token qualifies but is padding
        "neg_adv_inc_entropy": [0, 0, 1, 0, 0, 0],
        "either": [1, 0, 1, 0, 0, 0],
    }
    assert set(expected) == set(KL_MASKS)
    for kind, exp in expected.items():
        assert kl_mask(kind, adv, mask, d_h).tolist() == [[bool(x) for x in exp]], kind
    with pytest.raises(ValueError, match="pos_adv_dec_entropy"):
        kl_mask("pos_adv", adv, mask, d_h)


# ---------------------------------------------------------------------------------------------
# Predicted entropy change dH ~ -A (log pi_a + H), checked against real softmax-logit steps.
# ---------------------------------------------------------------------------------------------
def _entropy(z: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(z, -1)
    return -(logp.exp() * logp).sum()


def _measured_dh_after_pg_step(z: torch.Tensor, a: int, adv: float, lr: float = 1e-3) -> float:
    """One gradient-ascent step on A * log pi_a w.r.t. the logits; returns H(after) - H(before)."""
    z = z.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(adv * torch.log_softmax(z, -1)[a], z)
    with torch.no_grad():
        return (_entropy(z + lr * grad) - _entropy(z)).item()


def _predicted(z: torch.Tensor, a: int, adv: float) -> float:
    logp = torch.log_softmax(z, -1)
    return predicted_entropy_change(logp[a], _entropy(z), torch.tensor(adv, dtype=z.dtype)).item()


def test_worked_example_09_01_and_the_issue_sign_is_wrong():
    z = torch.log(torch.tensor([0.9, 0.1], dtype=torch.float64))
    measured = _measured_dh_after_pg_step(z, 0, +1.0)
    assert measured < 0  # reinforcing the likely token sharpens the distribution
    logp_plus_h = math.log(0.9) + _entropy(z).item()
    assert logp_plus_h == pytest.approx(0.2197, abs=1e-4)
    assert _predicted(z, 0, +1.0) < 0  # -A (log pi + H) has the right sign
    assert +1.0 * logp_plus_h > 0  # the issue's A (log pi + H) would predict an increase


def test_predicted_sign_matches_real_gradient_step():
    """Random categoricals; high- and low-probability sampled tokens; A of both signs.

    For a vanilla gradient step the exact first-order change is
    -eta A [pi_a (log pi_a + H) - sum_j pi_j^2 (log pi_j + H)]; its sign provably equals that of
    -A (log pi_a + H) for the argmax token and for every token with log pi_a + H < 0 (which
    includes the lowest-probability token), so these are the tokens checked here.
    """
    gen = torch.Generator().manual_seed(7)
    checked = 0
    for case in range(6):
        vocab = 3 + case
        z = torch.randn(vocab, generator=gen, dtype=torch.float64) * (0.5 + case)
        logp = torch.log_softmax(z, -1)
        h = _entropy(z).item()
        tokens = {int(logp.argmax()), int(logp.argmin())}
        tokens |= {j for j in range(vocab) if logp[j].item() + h < -1e-3}
        for a in tokens:
            for adv in (1.0, -0.7):
                measured = _measured_dh_after_pg_step(z, a, adv)
                predicted = _predicted(z, a, adv)
                assert abs(measured) > 1e-12
                assert math.copysign(1, measured) == math.copysign(1, predicted), (case, a, adv)
                checked += 1
    assert checked >= 30


def test_predicted_change_is_exact_first_order_for_a_sampled_logit_step():
    """Raising only the sampled logit by eta * A (tabular / natural-gradient view, Cui et al.)
    changes the entropy by -eta A pi_a (log pi_a + H) to first order, for every token."""
    gen = torch.Generator().manual_seed(3)
    eta = 1e-5
    for _ in range(5):
        z = torch.randn(6, generator=gen, dtype=torch.float64) * 2
        pi = torch.softmax(z, -1)
        for a in range(6):
            for adv in (1.0, -1.0):
                step = torch.zeros(6, dtype=torch.float64)
                step[a] = eta * adv
                measured = (_entropy(z + step) - _entropy(z)).item()
                predicted = _predicted(z, a, adv)
                assert measured == pytest.approx(eta * pi[a].item() * predicted, rel=1e-3, abs=1e-15)
