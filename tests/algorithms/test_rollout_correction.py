"""Rollout correction (algorithms/correction.py): hand-computed weights and losses at every level,
bit-identity when the rollout and old log-probs are equal, micro-batch invariance, bad settings."""
import math

import pytest
import torch

from megatron_tepo.algorithms import (
    AGG_MODES,
    CORRECTION_LEVELS,
    POLICY_LOSSES,
    RolloutCorrection,
    compute_policy_loss,
    count_for_normalizer,
)

D = torch.float64
# Two sequences: 3 and 2 valid tokens. d = old - rollout per token.
MASK = [[1, 1, 1], [1, 1, 0]]
D_TOK = [[0.1, -0.2, 0.5], [1.0, -0.3, 0.0]]
# log pi - log pi_old per token, and advantages (constant per sequence, as GRPO gives them)
DELTA = [[0.05, 0.5, -0.4], [0.1, -0.02, 0.0]]
ADV = [[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]]
OLD = [[-1.0, -2.0, -0.5], [-0.7, -1.5, -3.0]]


def _tensors():
    mask = torch.tensor(MASK, dtype=torch.bool)
    old = torch.tensor(OLD, dtype=D)
    rollout = old - torch.tensor(D_TOK, dtype=D)
    lp = old + torch.tensor(DELTA, dtype=D)
    adv = torch.tensor(ADV, dtype=D)
    return lp, old, rollout, adv, mask


def _rows():
    return [[(j, D_TOK[i][j]) for j in range(3) if MASK[i][j]] for i in range(2)]


def _x(level):
    """Hand: x per valid token, as {(i, j): x}."""
    out = {}
    for i, row in enumerate(_rows()):
        total = sum(d for _, d in row)
        for j, d in row:
            out[i, j] = {"token": d, "sequence": total, "geometric": total / len(row)}[level]
    return out


def _hand_weights(is_level, cap, rs_level, bounds):
    w = {}
    for key in _x("token"):
        v = 1.0
        if is_level != "none":
            v = min(math.exp(_x(is_level)[key]), cap)
        if rs_level != "none":
            r = math.exp(_x(rs_level)[key])
            v = v if bounds[0] <= r <= bounds[1] else 0.0
        w[key] = v
    return w


def _hand_per_token(name):
    """Plain-float per-token loss of each method (docs/ALGORITHMS.md formulas)."""
    out = {}
    for i, row in enumerate(_rows()):
        seq = sum(DELTA[i][j] for j, _ in row) / len(row)
        for j, _ in row:
            a = ADV[i][j]
            if name == "grpo":
                r, lo, hi = math.exp(DELTA[i][j]), 0.2, 0.28
                loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
                if a < 0:
                    loss = min(loss, -a * 3.0)
            elif name == "tepo":
                r, lo, hi = math.exp(seq), 0.2, 0.28
                loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
            elif name == "gspo":
                r, lo, hi = math.exp(seq), 3e-4, 4e-4
                loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
            out[i, j] = loss
    return out


def _hand_loss(name, weights):
    per = _hand_per_token(name)
    if name == "gspo":  # seq-mean-token-mean
        rows = [[per[i, j] * weights[i, j] for j, _ in row] for i, row in enumerate(_rows())]
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(per[k] * weights[k] for k in per) / len(per)  # token-mean


WIDE = {"tepo": dict(clip_low=0.2, clip_high=0.28)}  # TEPO's wide range (not its default): few sequences clip
CASES = [
    ("token", 1.5, "none", (0.5, 2.0)),
    ("sequence", 1.5, "none", (0.5, 2.0)),
    ("geometric", 1.5, "none", (0.5, 2.0)),
    ("none", 2.0, "token", (0.8, 1.2)),
    ("none", 2.0, "sequence", (0.5, 1.6)),
    ("none", 2.0, "geometric", (0.9, 1.2)),
    ("token", 1.2, "geometric", (0.9, 1.2)),
    ("sequence", 3.0, "token", (0.75, 1.5)),
]


def test_hand_computed_weights_hit_the_cap_and_the_bounds():
    # the cases above were chosen so that caps and rejections really happen
    w = _hand_weights("token", 1.5, "none", (0.5, 2.0))
    assert w[0, 2] == 1.5 and w[1, 0] == 1.5 and w[0, 0] == pytest.approx(math.exp(0.1))
    w = _hand_weights("none", 2.0, "sequence", (0.5, 1.6))
    assert [w[0, 0], w[0, 1], w[0, 2], w[1, 0], w[1, 1]] == [1.0, 1.0, 1.0, 0.0, 0.0]
    w = _hand_weights("none", 2.0, "token", (0.8, 1.2))
    assert [w[0, 0], w[0, 1], w[0, 2], w[1, 0], w[1, 1]] == [1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ["grpo", "gspo", "tepo"])
@pytest.mark.parametrize("is_level,cap,rs_level,bounds", CASES)
def test_loss_and_metrics_equal_the_hand_computation(name, is_level, cap, rs_level, bounds):
    lp, old, rollout, adv, mask = _tensors()
    loss, m = compute_policy_loss(name, lp, old, adv, mask, rollout_log_prob=rollout, rollout_is=is_level,
                                  rollout_is_cap=cap, rollout_rs=rs_level, rollout_rs_bounds=bounds,
                                  **WIDE.get(name, {}))
    weights = _hand_weights(is_level, cap, rs_level, bounds)
    assert float(loss) == pytest.approx(_hand_loss(name, weights), rel=1e-12, abs=1e-14)
    n = len(weights)
    if is_level != "none":
        raw = {k: math.exp(x) for k, x in _x(is_level).items()}
        assert float(m["rollout_is_weight"]) == pytest.approx(sum(min(v, cap) for v in raw.values()) / n, rel=1e-6)
        assert float(m["rollout_is_capped"]) == pytest.approx(sum(v > cap for v in raw.values()) / n)
    else:
        assert float(m["rollout_is_weight"]) == 1.0 and float(m["rollout_is_capped"]) == 0.0
    if rs_level != "none":
        ratio = {k: math.exp(x) for k, x in _x(rs_level).items()}
        rejected = sum(not (bounds[0] <= v <= bounds[1]) for v in ratio.values())
        assert rejected > 0
        assert float(m["rollout_rs_rejected"]) == pytest.approx(rejected / n)
    else:
        assert float(m["rollout_rs_rejected"]) == 0.0
    k3 = sum(math.exp(d) - 1 - d for row in _rows() for _, d in row) / n
    assert float(m["rollout_mismatch_kl"]) == pytest.approx(k3, rel=1e-6)


def test_the_weight_multiplies_the_gradient_of_each_token():
    """GRPO in its unclipped region: dL/dl_t = -A_t r_t w_t / N."""
    _, old, rollout, adv, mask = _tensors()
    delta = torch.tensor([[0.05, 0.1, -0.1], [0.1, -0.02, 0.0]], dtype=D)
    lp = (old + delta).requires_grad_(True)
    loss, _ = compute_policy_loss("grpo", lp, old, adv, mask, rollout_log_prob=rollout, rollout_is="token",
                                  rollout_is_cap=1.5)
    loss.backward()
    w = _hand_weights("token", 1.5, "none", (0.5, 2.0))
    for (i, j), wt in w.items():
        want = -ADV[i][j] * math.exp(float(delta[i, j])) * wt / len(w)
        assert float(lp.grad[i, j]) == pytest.approx(want, rel=1e-12)
    assert float(lp.grad[1, 2]) == 0.0


def test_the_kl_and_entropy_terms_are_not_weighted():
    lp, old, rollout, adv, mask = _tensors()
    ent = torch.rand(2, 3, dtype=D, generator=torch.Generator().manual_seed(0))
    kw = dict(entropy=ent, kl_coef=0.3, kl_mask="all", entropy_coef=0.05)
    plain, mp = compute_policy_loss("grpo", lp, old, adv, mask, **kw)
    rejected_all, mr = compute_policy_loss("grpo", lp, old, adv, mask, rollout_log_prob=rollout,
                                           rollout_rs="token", rollout_rs_bounds=(1.0, 1.0), **kw)
    assert float(mr["rollout_rs_rejected"]) == 1.0 and float(mr["pg_loss"]) == 0.0
    # what is left is exactly the KL and entropy terms of the uncorrected loss
    assert float(rejected_all) == pytest.approx(float(plain) - float(mp["pg_loss"]), abs=1e-7)  # pg_loss is an fp32 metric


def _batch():
    g = torch.Generator().manual_seed(3)
    B, T = 7, 6
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate([6, 3, 0, 1, 5, 6, 2]):
        mask[i, :n] = True
    old = -torch.rand(B, T, generator=g, dtype=D) * 3 - 0.05
    lp = torch.clamp(old + 0.4 * torch.randn(B, T, generator=g, dtype=D), max=-1e-3)
    adv = torch.randn(B, 1, generator=g, dtype=D).expand(B, T).clone()
    ent = torch.rand(B, T, generator=g, dtype=D) * 2
    old_ent = torch.rand(B, T, generator=g, dtype=D) * 2
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    # garbage on padding must not leak
    rollout = torch.where(mask, rollout, torch.full_like(rollout, float("nan")))
    return dict(lp=lp, old=old, adv=adv, mask=mask, ent=ent, old_ent=old_ent, rollout=rollout)


def _run(name, b, rollout, sl=slice(None), **kw):
    lp = b["lp"].clone().requires_grad_(True)
    ent = b["ent"].clone().requires_grad_(True)
    extra = {"generator": torch.Generator().manual_seed(5)} if name == "clip_cov" else {}
    loss, metrics = compute_policy_loss(
        name, lp[sl], b["old"][sl], b["adv"][sl], b["mask"][sl], entropy=ent[sl], old_entropy=b["old_ent"][sl],
        rollout_log_prob=None if rollout is None else rollout[sl], kl_coef=0.1, kl_mask="either",
        entropy_coef=0.01, **extra, **kw)
    loss.backward()
    return loss, lp.grad, ent.grad, metrics


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_equal_log_probs_are_bit_identical_to_no_correction(name):
    b = _batch()
    base = _run(name, b, None)
    for is_level in CORRECTION_LEVELS:
        for rs_level in CORRECTION_LEVELS:
            got = _run(name, b, b["old"].clone(), rollout_is=is_level, rollout_rs=rs_level,
                       rollout_is_cap=1.0, rollout_rs_bounds=(1.0, 1.0))
            for want, have in zip(base[:3], got[:3]):
                assert torch.equal(want, have), (is_level, rs_level)
            assert float(got[3]["rollout_mismatch_kl"]) == 0.0
            assert float(got[3]["rollout_rs_rejected"]) == 0.0


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("level", CORRECTION_LEVELS[1:])
@pytest.mark.parametrize("name", ["grpo", "gspo", "tepo", "cispo", "gpg"])
def test_micro_batch_invariance_with_the_correction_on(name, level, agg):
    b = _batch()
    bounds = (0.92, 1.08) if level == "geometric" else (0.6, 1.8)  # the mean of d is small
    kw = dict(agg=agg, rollout_is=level, rollout_is_cap=1.3, rollout_rs=level, rollout_rs_bounds=bounds)
    whole, gw, ew, m = _run(name, b, b["rollout"], **kw)
    assert 0 < float(m["rollout_rs_rejected"]) < 1  # the settings really act
    splits = [(0, 2), (2, 5), (5, 7)]
    norm = sum(count_for_normalizer(b["mask"][s:e], agg) for s, e in splits)
    lp = b["lp"].clone().requires_grad_(True)
    ent = b["ent"].clone().requires_grad_(True)
    parts = sum(compute_policy_loss(
        name, lp[s:e], b["old"][s:e], b["adv"][s:e], b["mask"][s:e], entropy=ent[s:e],
        old_entropy=b["old_ent"][s:e], rollout_log_prob=b["rollout"][s:e], kl_coef=0.1, kl_mask="either",
        entropy_coef=0.01, normalizer=norm, **kw)[0] for s, e in splits)
    parts.backward()
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(lp.grad, gw, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent.grad, ew, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(rollout_is="seq"), "rollout_is must be one of"),
    (dict(rollout_rs="tokens"), "rollout_rs must be one of"),
    (dict(rollout_is="token", rollout_is_cap=0.5), "rollout_is_cap must be a finite number >= 1"),
    (dict(rollout_rs="token", rollout_rs_bounds=(1.1, 2.0)), "0 <= lo <= 1 <= hi"),
    (dict(rollout_rs="token", rollout_rs_bounds=(0.5,)), "rollout_rs_bounds"),
])
def test_bad_settings_name_the_setting(kwargs, fragment):
    lp, old, rollout, adv, mask = _tensors()
    with pytest.raises(ValueError, match=fragment):
        compute_policy_loss("grpo", lp, old, adv, mask, rollout_log_prob=rollout, **kwargs)


def test_correction_without_rollout_log_probs_is_refused():
    lp, old, _, adv, mask = _tensors()
    with pytest.raises(ValueError, match="requires rollout_log_prob"):
        compute_policy_loss("grpo", lp, old, adv, mask, rollout_is="token")
    with pytest.raises(ValueError, match="rollout_log_prob has shape"):
        compute_policy_loss("grpo", lp, old, adv, mask, rollout_log_prob=old[:, :2], rollout_is="token")


def test_settings_object_round_trips():
    c = RolloutCorrection("geometric", 2, "sequence", [0.25, 4])
    assert c.active and c.rollout_rs_bounds == (0.25, 4.0) and isinstance(c.rollout_is_cap, float)
    assert not RolloutCorrection().active
