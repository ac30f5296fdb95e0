"""Hand-computed values of every loss on small tensors (plain-python references, no library helpers)."""
import math

import pytest
import torch

from megatron_tepo.algorithms import compute_policy_loss

NAN, INF = float("nan"), float("inf")
# 2 x 3; the last position of row 1 is padding and holds garbage.
LP = [[-0.5, -1.0, -0.25], [-0.7, -0.1, NAN]]
OLP = [[-0.6, -0.7, -0.25], [-0.4, -0.5, -INF]]
ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, NAN]]
OLD_ENT = [[0.5, 1.0, 0.3], [2.0, 0.1, NAN]]
MASK = [[1, 1, 1], [1, 1, 0]]
VALID = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
N = len(VALID)


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _run(name, **kw):
    lp = _t(LP).requires_grad_(True)
    loss, metrics = compute_policy_loss(name, lp, _t(OLP), _t(ADV), torch.tensor(MASK, dtype=torch.bool), **kw)
    return loss, metrics


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def ppo(w, a, el, eh):
    return max(-a * w, -a * clip(w, 1 - el, 1 + eh))


def row_mean_diff(i):
    d = [LP[i][t] - OLP[i][t] for (r, t) in VALID if r == i]
    return sum(d) / len(d)


def token_mean(per_token):
    return sum(per_token[v] for v in VALID) / N


def seq_mean_token_mean(per_token):
    rows = sorted({i for i, _ in VALID})
    return sum(sum(per_token[v] for v in VALID if v[0] == i) / sum(1 for v in VALID if v[0] == i) for i in rows) / len(rows)


def grpo_token(i, t, el=0.2, eh=0.28, c=3.0):
    r = math.exp(LP[i][t] - OLP[i][t])
    a = ADV[i][t]
    loss = ppo(r, a, el, eh)
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


def test_grpo():
    loss, m = _run("grpo")
    expected = token_mean({v: grpo_token(*v) for v in VALID})
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["pg_loss"].item() == pytest.approx(expected, rel=1e-6)
    # row 0: r = e^-0.3 = 0.741 < 0.8 with A > 0 -> not clipped; row 1: r = e^-0.3 with A < 0 -> clipped,
    # r = e^0.4 = 1.49 > 1.28 with A < 0 -> not clipped (only the lower side binds for A < 0).
    assert m["clip_frac"].item() == pytest.approx(1 / 5)
    assert m["num_tokens"].item() == 5


def test_grpo_dual_clip_literal():
    # r = 4, A = -1: L1 = max(4, 1.28) = 4, dual clip caps it at c = 3.
    lp = torch.tensor([[math.log(4.0) - 1.0]], requires_grad=True)
    args = (torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    loss, m = compute_policy_loss("grpo", lp, *args)
    assert loss.item() == pytest.approx(3.0)
    assert m["dual_clip_frac"].item() == 1.0
    loss.backward()
    assert lp.grad.item() == 0.0  # capped region has no gradient
    loss, m = compute_policy_loss("grpo", lp, *args, clip_ratio_c=None)
    assert loss.item() == pytest.approx(4.0) and m["dual_clip_frac"].item() == 0.0
    loss, _ = compute_policy_loss("grpo", lp, *args, clip_ratio_c=5.0)
    assert loss.item() == pytest.approx(4.0)


def test_tepo():
    w = [math.exp(row_mean_diff(0)), math.exp(row_mean_diff(1))]
    loss, m = _run("tepo")
    expected = token_mean({(i, t): ppo(w[i], ADV[i][t], 0.2, 0.28) for i, t in VALID})
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["clip_frac"].item() == 0.0  # w = e^-0.0667 and e^0.05 are inside [0.8, 1.28]


def test_tepo_clip_values_and_kl_term():
    # clip_high 0.01: row 1 has w = e^0.05 > 1.01 but A < 0 -> unclipped; row 0 w < 1 with A > 0 unclipped.
    w = [math.exp(row_mean_diff(0)), math.exp(row_mean_diff(1))]
    loss, m = _run("tepo", clip_low=0.01, clip_high=0.01)
    assert loss.item() == pytest.approx(token_mean({(i, t): ppo(w[i], ADV[i][t], 0.01, 0.01) for i, t in VALID}), rel=1e-6)
    # row 0: w = 0.9355 < 0.99 with A > 0 -> unclipped; row 1 w = 1.051 > 1.01 with A < 0 -> unclipped.
    assert m["clip_frac"].item() == 0.0
    # KL on every valid token, k3 against pi_old: exp(lo - l) - (lo - l) - 1.
    k3 = {(i, t): math.exp(OLP[i][t] - LP[i][t]) - (OLP[i][t] - LP[i][t]) - 1 for i, t in VALID}
    pg = token_mean({(i, t): ppo(w[i], ADV[i][t], 0.2, 0.28) for i, t in VALID})
    loss, m = _run("tepo", kl_coef=0.5, kl_mask="all")
    assert loss.item() == pytest.approx(pg + 0.5 * token_mean(k3), rel=1e-6)
    assert m["kl"].item() == pytest.approx(token_mean(k3), rel=1e-6)
    assert m["approx_kl"].item() == pytest.approx(token_mean(k3), rel=1e-6)
    assert m["kl_mask_frac"].item() == 1.0
    # with an explicit reference policy and k1
    ref = [[-0.5, -0.5, -0.5], [-0.5, -0.5, NAN]]
    k1 = {(i, t): LP[i][t] - ref[i][t] for i, t in VALID}
    loss, _ = _run("tepo", kl_coef=2.0, kl_mask="all", kl_estimator="k1", ref_log_prob=_t(ref))
    assert loss.item() == pytest.approx(pg + 2.0 * token_mean(k1), rel=1e-6)


def test_gspo_default_and_agg_override():
    s = [math.exp(row_mean_diff(0)), math.exp(row_mean_diff(1))]
    per_token = {(i, t): ppo(s[i], ADV[i][t], 3e-4, 4e-4) for i, t in VALID}
    loss, m = _run("gspo")  # default agg: seq-mean-token-mean
    assert loss.item() == pytest.approx(seq_mean_token_mean(per_token), rel=1e-6)
    loss, _ = _run("gspo", agg="token-mean")
    assert loss.item() == pytest.approx(token_mean(per_token), rel=1e-6)
    # s_0 = 0.936 < 1 - 3e-4 with A > 0: unclipped; s_1 = 1.051 > 1 + 4e-4 with A < 0: unclipped.
    assert m["clip_frac"].item() == 0.0
    # flip the advantage sign: A < 0 with s_0 < 1 - 3e-4 -> clipped on all row-0 tokens
    lp = _t(LP).requires_grad_(True)
    adv = [[-1.0, -1.0, -1.0], [-2.0, -2.0, NAN]]
    _, m = compute_policy_loss("gspo", lp, _t(OLP), _t(adv), torch.tensor(MASK))
    assert m["clip_frac"].item() == pytest.approx(3 / 5)


def test_gpg():
    loss, m = _run("gpg")
    assert loss.item() == pytest.approx(token_mean({(i, t): -LP[i][t] * ADV[i][t] for i, t in VALID}), rel=1e-6)
    assert m["clip_frac"].item() == 0.0


def test_cispo_values():
    loss, m = _run("cispo")  # ratios e^0.1.. e^0.4 all < 5: weight = r
    expected = token_mean({(i, t): -math.exp(LP[i][t] - OLP[i][t]) * ADV[i][t] * LP[i][t] for i, t in VALID})
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["clip_frac"].item() == 0.0


def test_cispo_caps_and_detaches_weight_literals():
    # r = e^2 = 7.39 capped at 1 + 4 = 5: L = -5 * 1 * (-0.5) = 2.5, dL/dl = -5 (weight detached)
    lp = torch.tensor([[-0.5]], requires_grad=True)
    loss, m = compute_policy_loss("cispo", lp, torch.tensor([[-2.5]]), torch.ones(1, 1), torch.ones(1, 1))
    assert loss.item() == pytest.approx(2.5)
    assert m["clip_frac"].item() == 1.0
    loss.backward()
    assert lp.grad.item() == pytest.approx(-5.0)
    # no lower bound by default: r = e^-1 stays; with clip_low 0.2 the weight is raised to 0.8
    lp = torch.tensor([[-1.5]], requires_grad=True)
    args = (torch.tensor([[-0.5]]), torch.ones(1, 1), torch.ones(1, 1))
    assert compute_policy_loss("cispo", lp, *args)[0].item() == pytest.approx(math.exp(-1) * 1.5, rel=1e-6)
    assert compute_policy_loss("cispo", lp, *args, clip_low=0.2)[0].item() == pytest.approx(0.8 * 1.5, rel=1e-6)


def test_prefix_is():
    per_token = {}
    for i, t in VALID:
        diffs = [LP[i][j] - OLP[i][j] for j in range(t + 1) if (i, j) in VALID]
        per_token[(i, t)] = ppo(math.exp(sum(diffs) / len(diffs)), ADV[i][t], 0.2, 0.28)
    loss, _ = _run("prefix_is")
    assert loss.item() == pytest.approx(token_mean(per_token), rel=1e-6)


def test_steer():
    omega = {}
    for i, t in VALID:
        p = clip(math.exp(LP[i][t]), 1e-8, 1 - 1e-8)
        po = clip(math.exp(OLP[i][t]), 1e-8, 1.0)
        omega[(i, t)] = abs(ADV[i][t] / po * p * (1 - p) * (math.log(p) + OLD_ENT[i][t]))
    k = -math.log(0.8) / max(max(omega.values()), 0.02)
    lam = {v: clip(math.exp(-k * omega[v]), 0.8, 1.0) for v in VALID}
    expected = token_mean({v: lam[v] * grpo_token(*v, c=10.0) for v in VALID})
    loss, m = _run("steer", old_entropy=_t(OLD_ENT))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["steer_weight_mean"].item() == pytest.approx(token_mean(lam), rel=1e-6)
    assert min(lam.values()) == pytest.approx(0.8)  # the largest |Omega| gets w_min
    # a fixed omega scale replaces the micro-batch maximum
    k2 = -math.log(0.8) / 10.0
    lam2 = {v: clip(math.exp(-k2 * omega[v]), 0.8, 1.0) for v in VALID}
    loss, _ = _run("steer", old_entropy=_t(OLD_ENT), steer_omega_max=10.0)
    assert loss.item() == pytest.approx(token_mean({v: lam2[v] * grpo_token(*v, c=10.0) for v in VALID}), rel=1e-6)


def test_kl_cov_topk_exact():
    lp_valid = {v: LP[v[0]][v[1]] for v in VALID}
    a_valid = {v: ADV[v[0]][v[1]] for v in VALID}
    mean_a = sum(a_valid.values()) / N
    mean_l = sum(lp_valid.values()) / N
    cov = {v: (a_valid[v] - mean_a) * (lp_valid[v] - mean_l) for v in VALID}
    ranked = sorted(VALID, key=lambda v: -cov[v])
    k = int(N * 0.4)  # 2
    assert cov[ranked[k - 1]] != cov[ranked[k]]
    top = set(ranked[:k])
    assert top == {(1, 0), (0, 2)}
    per_token = {}
    for i, t in VALID:
        d = LP[i][t] - OLP[i][t]
        per_token[(i, t)] = -ADV[i][t] * math.exp(d) + (0.7 * abs(d) if (i, t) in top else 0.0)
    loss, m = _run("kl_cov", kl_cov_ratio=0.4, kl_cov_coef=0.7)
    assert loss.item() == pytest.approx(token_mean(per_token), rel=1e-6)
    assert m["kl_cov_frac"].item() == pytest.approx(2 / 5)
    assert m["clip_frac"].item() == 0.0
    # default ratio 2e-3: int(5 * 0.002) = 0 -> max(1, 0) = 1 token, the largest covariance
    loss, m = _run("kl_cov")
    d = LP[1][0] - OLP[1][0]
    expected = token_mean({v: -ADV[v[0]][v[1]] * math.exp(LP[v[0]][v[1]] - OLP[v[0]][v[1]]) for v in VALID}) + abs(d) / N
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["kl_cov_frac"].item() == pytest.approx(1 / 5)


# ---------------------------------------------------------------------------------------------
# clip_cov: random selection -> properties, and a fixed generator.
# ---------------------------------------------------------------------------------------------
def _clip_cov_batch():
    g = torch.Generator().manual_seed(11)
    B, T = 4, 8
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 0.05
    olp = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([2.0, -2.0, 1.5, -1.5], dtype=torch.float64)[:, None].expand(B, T).clone()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 5:] = False
    mask[3, 2:] = False
    return lp, olp, adv, mask


def _reference_clip_cov_parts(lp, olp, adv, mask, lb=1.0, ub=5.0, el=0.2, eh=0.28):
    r = torch.exp(lp - olp)
    l1, l2 = -adv * r, -adv * torch.clamp(r, 1 - el, 1 + eh)
    clipped = (l2 > l1) & mask
    mean_a, mean_l = adv[mask].mean(), lp[mask].mean()
    cov = (adv - mean_a) * (lp - mean_l)
    candidates = mask & ~clipped & (cov > lb) & (cov < ub)
    return torch.maximum(l1, l2), clipped, candidates


@pytest.mark.parametrize("ratio", [2e-4, 0.1, 0.5])
def test_clip_cov_properties(ratio):
    lp, olp, adv, mask = _clip_cov_batch()
    n = int(mask.sum())
    per_token, clipped, candidates = _reference_clip_cov_parts(lp, olp, adv, mask)
    assert candidates.sum() >= 3 and clipped.any()
    leaf = lp.clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(5)
    loss, m = compute_policy_loss("clip_cov", leaf, olp, adv, mask, clip_cov_ratio=ratio, generator=gen)
    loss.backward()
    zeroed = mask & ~clipped & (leaf.grad == 0)
    expected_count = min(max(int(ratio * n), 1), int(candidates.sum()))
    assert int(zeroed.sum()) == expected_count
    assert not (zeroed & ~candidates).any()  # only candidates are zeroed
    assert m["clip_cov_frac"].item() == pytest.approx(expected_count / n)
    # zeroed tokens contribute 0 but are still counted in the denominator
    assert loss.item() == pytest.approx(per_token[mask & ~zeroed].sum().item() / n, rel=1e-10)
    # the same seed gives the same selection
    leaf2 = lp.clone().requires_grad_(True)
    loss2, _ = compute_policy_loss("clip_cov", leaf2, olp, adv, mask, clip_cov_ratio=ratio,
                                   generator=torch.Generator().manual_seed(5))
    loss2.backward()
    assert torch.equal(leaf2.grad, leaf.grad)


def test_clip_cov_no_candidates_equals_plain_ppo():
    lp, olp, adv, mask = _clip_cov_batch()
    per_token, _, _ = _reference_clip_cov_parts(lp, olp, adv, mask)
    loss, m = compute_policy_loss("clip_cov", lp, olp, adv, mask, clip_cov_lb=100.0, clip_cov_ub=200.0)
    assert loss.item() == pytest.approx(per_token[mask].mean().item(), rel=1e-10)
    assert m["clip_cov_frac"].item() == 0.0


def test_clip_cov_uses_global_rng_by_default():
    lp, olp, adv, mask = _clip_cov_batch()
    torch.manual_seed(42)
    a, _ = compute_policy_loss("clip_cov", lp, olp, adv, mask, clip_cov_ratio=0.1)
    torch.manual_seed(42)
    b, _ = compute_policy_loss("clip_cov", lp, olp, adv, mask, clip_cov_ratio=0.1)
    assert a.item() == b.item()
