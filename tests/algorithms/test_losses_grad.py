"""Gradient facts: TEPO's true gradient vs Algorithm 1, clipped sides, GSPO-token == GSPO."""
import math

import pytest
import torch

from megatron_tepo.algorithms import compute_policy_loss

D = torch.float64


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = [4, 2, 5]
    B, T = 3, 5
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    old = -torch.rand(B, T, generator=g, dtype=D) * 3 - 0.1
    lp = old + 0.05 * torch.randn(B, T, generator=g, dtype=D)  # small shifts: w_i inside the clip range
    adv = torch.tensor([1.5, -0.7, 0.4], dtype=D)[:, None].expand(B, T).clone()
    return lp, old, adv, mask, lengths


def test_tepo_closed_form_gradient_is_w_A_over_N():
    lp, old, adv, mask, lengths = _batch()
    leaf = lp.clone().requires_grad_(True)
    loss, m = compute_policy_loss("tepo", leaf, old, adv, mask, clip_low=0.2, clip_high=0.28)  # the unclipped region
    assert m["clip_frac"].item() == 0.0
    loss.backward()
    n_tokens = sum(lengths)
    for i, n in enumerate(lengths):
        mean_diff = sum((lp[i, t] - old[i, t]).item() for t in range(n)) / n
        w = math.exp(mean_diff)
        for t in range(n):
            assert leaf.grad[i, t].item() == pytest.approx(-w * adv[i, 0].item() / n_tokens, rel=1e-9)
            # Algorithm 1 line 21 would give |y_i| times less:
            assert leaf.grad[i, t].item() != pytest.approx(-w * adv[i, 0].item() / (n * n_tokens), rel=1e-3)
        assert (leaf.grad[i, n:] == 0).all()


@pytest.mark.parametrize(
    "shift,adv,zero_grad",
    [
        (+0.5, +1.0, True),   # A > 0, w = e^0.5 = 1.65 > 1.28: clipped -> no gradient
        (-0.5, -1.0, True),   # A < 0, w = e^-0.5 = 0.61 < 0.8: clipped -> no gradient
        (-0.5, +1.0, False),  # A > 0, w < 0.8: the min keeps the unclipped term -> gradient
        (+0.5, -1.0, False),  # A < 0, w > 1.28: unclipped term -> gradient
    ],
)
def test_tepo_clipped_side_has_zero_gradient(shift, adv, zero_grad):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]], dtype=D)
    lp = old.clone()
    lp[0] += torch.tensor([shift - 0.1, shift + 0.1, shift], dtype=D)  # row mean = shift
    a = torch.tensor([[adv] * 3, [1.0] * 3], dtype=D)
    leaf = lp.clone().requires_grad_(True)
    loss, m = compute_policy_loss("tepo", leaf, old, a, torch.ones(2, 3))
    loss.backward()
    if zero_grad:
        assert (leaf.grad[0] == 0).all()
        assert m["clip_frac"].item() == pytest.approx(3 / 6)
    else:
        w = math.exp(shift)
        torch.testing.assert_close(leaf.grad[0], torch.full((3,), -w * adv / 6, dtype=D))
    torch.testing.assert_close(leaf.grad[1], torch.full((3,), -1.0 / 6, dtype=D))  # row 1 on-policy, untouched


def _sequence_level_gspo(lp, old, adv_seq, mask, el, eh):
    """Paper GSPO: J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t (l - lo))."""
    n = mask.sum(-1)
    s = torch.exp(torch.where(mask, lp - old, 0).sum(-1) / n)
    obj = torch.minimum(s * adv_seq, torch.clamp(s, 1 - el, 1 + eh) * adv_seq)
    return -obj.mean()


@pytest.mark.parametrize("el,eh", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_token_equals_sequence_gspo(el, eh):
    lp, old, adv, mask, _ = _batch()
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss("gspo", a, old, adv, mask, clip_low=el, clip_high=eh)
    ref = _sequence_level_gspo(b, old, adv[:, 0], mask, el, eh)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    if el == 3e-4:
        assert (a.grad == 0).any() and (a.grad != 0).any()  # both clipped and unclipped rows present


def test_grpo_token_gradient_and_dual_clip_gradient():
    # token 0: r = 1.1, A = 1 -> dL/dl = -r; token 1: r = 5, A = -1 -> dual-capped -> 0;
    # token 2: r = 2, A = -1: L1 = 2 < c = 3 -> dL/dl = r = 2.
    old = torch.tensor([[-1.0, -2.0, -1.5]], dtype=D)
    lp = (old + torch.log(torch.tensor([[1.1, 5.0, 2.0]], dtype=D))).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, -1.0]], dtype=D)
    loss, m = compute_policy_loss("grpo", lp, old, adv, torch.ones(1, 3))
    assert loss.item() == pytest.approx((-1.1 + 3.0 + 2.0) / 3)
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.1 / 3, 0.0, 2.0 / 3]], dtype=D))


def test_entropy_regularisation_gradient_and_sign():
    lp, old, adv, mask, lengths = _batch()
    ent = torch.rand(3, 5, dtype=D, requires_grad=True)
    base, _ = compute_policy_loss("grpo", lp, old, adv, mask)
    for coef in (0.01, -0.02):
        ent.grad = None
        loss, _ = compute_policy_loss("grpo", lp, old, adv, mask, entropy=ent, entropy_coef=coef)
        assert loss.item() == pytest.approx(base.item() - coef * ent[mask].mean().item(), rel=1e-10)
        loss.backward()
        n = sum(lengths)
        torch.testing.assert_close(ent.grad, torch.where(mask, -coef / n, 0.0).to(D))
