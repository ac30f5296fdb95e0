"""Micro-batch invariance with the global normaliser, and padding invariance."""
import pytest
import torch

from megatron_tepo.algorithms import AGG_MODES, POLICY_LOSSES, compute_policy_loss, count_for_normalizer

D = torch.float64
NAN, INF = float("nan"), float("inf")
INVARIANT = [n for n in POLICY_LOSSES if n not in ("clip_cov", "kl_cov")]
SPLITS = {"1-3-3": [(0, 1), (1, 4), (4, 7)], "2-5": [(0, 2), (2, 7)]}
SHARED = dict(kl_coef=0.1, kl_mask="either", entropy_coef=0.01, entropy_adv_alpha=0.05)


def _batch(adv_scale=1.0):
    g = torch.Generator().manual_seed(1)
    B, T = 7, 6
    lengths = [6, 3, 0, 1, 5, 6, 2]
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    old = -torch.rand(B, T, generator=g, dtype=D) * 3 - 0.05
    lp = old + 0.4 * torch.randn(B, T, generator=g, dtype=D)  # some ratios outside the clip range
    lp = torch.clamp(lp, max=-1e-3)
    adv = adv_scale * torch.randn(B, 1, generator=g, dtype=D).expand(B, T).clone()
    adv[:, ::2] *= 1.3  # not constant per sequence
    ent = torch.rand(B, T, generator=g, dtype=D) * 2
    old_ent = torch.rand(B, T, generator=g, dtype=D) * 2
    ref = old + 0.1 * torch.randn(B, T, generator=g, dtype=D)
    return dict(lp=lp, old=old, adv=adv, mask=mask, ent=ent, old_ent=old_ent, ref=ref)


def _loss(name, b, lp, ent, sl=slice(None), **kw):
    return compute_policy_loss(
        name, lp[sl], b["old"][sl], b["adv"][sl], b["mask"][sl], entropy=ent[sl], old_entropy=b["old_ent"][sl],
        ref_log_prob=b["ref"][sl], **kw,
    )


def _whole_and_split(name, agg, splits, b, **kw):
    lp_w, ent_w = b["lp"].clone().requires_grad_(True), b["ent"].clone().requires_grad_(True)
    whole, _ = _loss(name, b, lp_w, ent_w, agg=agg, **kw)
    whole.backward()
    lp_s, ent_s = b["lp"].clone().requires_grad_(True), b["ent"].clone().requires_grad_(True)
    norm = sum(count_for_normalizer(b["mask"][s:e], agg) for s, e in splits)
    parts = sum(_loss(name, b, lp_s, ent_s, slice(s, e), agg=agg, normalizer=norm, **kw)[0] for s, e in splits)
    parts.backward()
    return (whole, lp_w.grad, ent_w.grad), (parts, lp_s.grad, ent_s.grad)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", INVARIANT)
def test_micro_batch_invariance(name, agg, split):
    b = _batch()
    extra = {"steer_omega_max": 0.5} if name == "steer" else {}
    (w, gw, ew), (p, gp, ep) = _whole_and_split(name, agg, SPLITS[split], b, **SHARED, **extra)
    assert gw.abs().sum() > 0 and ew.abs().sum() > 0
    torch.testing.assert_close(p, w, rtol=0, atol=1e-12)
    torch.testing.assert_close(gp, gw, rtol=0, atol=1e-12)
    torch.testing.assert_close(ep, ew, rtol=0, atol=1e-12)


@pytest.mark.parametrize("delta_entropy", ["measured", "predicted"])
def test_micro_batch_invariance_of_kl_mask_variants(delta_entropy):
    b = _batch()
    for mask_kind in ("all", "pos_adv_dec_entropy", "neg_adv_inc_entropy"):
        (w, gw, _), (p, gp, _) = _whole_and_split(
            "tepo", "token-mean", SPLITS["1-3-3"], b, kl_coef=1.0, kl_mask=mask_kind, delta_entropy=delta_entropy
        )
        torch.testing.assert_close(p, w, rtol=0, atol=1e-12)
        torch.testing.assert_close(gp, gw, rtol=0, atol=1e-12)


def test_steer_default_is_invariant_when_omega_below_floor_only():
    # |Omega| <= 0.02 everywhere: k = -ln(w_min)/0.02 in every micro-batch -> invariant.
    small = _batch(adv_scale=1e-3)
    (w, gw, _), (p, gp, _) = _whole_and_split("steer", "token-mean", SPLITS["1-3-3"], small)
    torch.testing.assert_close(p, w, rtol=0, atol=1e-12)
    torch.testing.assert_close(gp, gw, rtol=0, atol=1e-12)
    # general data: the per-micro-batch max of |Omega| (STEER's reference) breaks invariance
    (w, _, _), (p, _, _) = _whole_and_split("steer", "token-mean", SPLITS["1-3-3"], _batch())
    assert abs(p.item() - w.item()) > 1e-6


# ---------------------------------------------------------------------------------------------
# Padding invariance: extra padded columns and empty rows full of garbage change nothing.
# ---------------------------------------------------------------------------------------------
def _pad(b):
    """Insert an empty row at index 3 and at the end, and 3 padded columns; padding is garbage."""
    garbage = {"lp": NAN, "old": -INF, "adv": NAN, "ent": NAN, "old_ent": INF, "ref": NAN}
    out = {}
    for key, t in b.items():
        fill = False if key == "mask" else garbage[key]
        t = torch.cat([t, torch.full((t.shape[0], 3), fill, dtype=t.dtype)], dim=1)
        row = torch.full((1, t.shape[1]), fill, dtype=t.dtype)
        out[key] = torch.cat([t[:3], row, t[3:], row], dim=0)
    keep_rows = [i for i in range(out["mask"].shape[0]) if i not in (3, out["mask"].shape[0] - 1)]
    return out, keep_rows


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_padding_invariance(name, agg):
    b = _batch()
    padded, rows = _pad(b)
    kw = dict(agg=agg, **SHARED)
    if name == "clip_cov":
        kw["clip_cov_ratio"] = 0.1
    results = []
    for batch in (b, padded):
        lp = batch["lp"].clone().requires_grad_(True)
        ent = batch["ent"].clone().requires_grad_(True)
        if name == "clip_cov":
            kw["generator"] = torch.Generator().manual_seed(3)
        loss, metrics = _loss(name, batch, lp, ent, **kw)
        loss.backward()
        results.append((loss, metrics, lp.grad, ent.grad))
    (l0, m0, g0, e0), (l1, m1, g1, e1) = results
    assert torch.isfinite(l1) and torch.isfinite(g1).all() and torch.isfinite(e1).all()
    torch.testing.assert_close(l1, l0, rtol=0, atol=1e-12)
    torch.testing.assert_close(g1[rows, :6], g0, rtol=0, atol=1e-12)
    torch.testing.assert_close(e1[rows, :6], e0, rtol=0, atol=1e-12)
    assert (g1[:, 6:] == 0).all() and (g1[3] == 0).all() and (g1[-1] == 0).all()
    assert m0.keys() == m1.keys()
    for key in m0:
        torch.testing.assert_close(m1[key], m0[key], rtol=0, atol=1e-6, msg=key)
