"""Edge cases, dtypes, extreme inputs, errors and the registry."""
import math

import pytest
import torch

from megatron_tepo.algorithms import (
    AGG_MODES,
    POLICY_LOSSES,
    LossTerms,
    compute_policy_loss,
    get_loss_defaults,
    register_policy_loss,
)
from megatron_tepo.algorithms import losses as losses_module

NAN, INF = float("nan"), float("inf")
ALL = list(POLICY_LOSSES)
KW = dict(kl_coef=0.1, kl_mask="either", entropy_coef=0.01, entropy_adv_alpha=0.05)


def test_registry_contents_and_defaults():
    assert set(ALL) == {"tepo", "grpo", "gspo", "gpg", "cispo", "clip_cov", "kl_cov", "prefix_is", "steer"}
    # measured best on three tasks (docs/ALGORITHMS.md, "tepo"); GSPO keeps its paper's range
    assert get_loss_defaults("tepo") == {"clip_low": 0.01, "clip_high": 0.014, "agg": "token-mean"}
    assert get_loss_defaults("grpo")["clip_ratio_c"] == 3.0
    gspo = get_loss_defaults("gspo")
    assert (gspo["clip_low"], gspo["clip_high"], gspo["agg"]) == (3e-4, 4e-4, "seq-mean-token-mean")
    cispo = get_loss_defaults("cispo")
    assert cispo["clip_low"] is None and cispo["clip_high"] == 4.0
    cc = get_loss_defaults("clip_cov")
    assert (cc["clip_cov_ratio"], cc["clip_cov_lb"], cc["clip_cov_ub"], cc["generator"]) == (2e-4, 1.0, 5.0, None)
    kc = get_loss_defaults("kl_cov")
    assert (kc["kl_cov_ratio"], kc["kl_cov_coef"]) == (2e-3, 1.0)
    st = get_loss_defaults("steer")
    assert (st["steer_w_min"], st["clip_ratio_c"], st["clip_high"]) == (0.8, 10.0, 0.28)
    get_loss_defaults("grpo")["clip_ratio_c"] = 99.0  # a copy
    assert get_loss_defaults("grpo")["clip_ratio_c"] == 3.0


def test_register_custom_loss_and_duplicate():
    @register_policy_loss("_test_double_gpg", defaults={"scale": 2.0, "clip_low": 0.1})
    def _double(ctx):
        return LossTerms(-ctx.options["scale"] * ctx.log_prob * ctx.advantages)

    try:
        assert get_loss_defaults("_test_double_gpg")["clip_low"] == 0.1
        lp = torch.tensor([[-1.0, -2.0]])
        loss, _ = compute_policy_loss("_test_double_gpg", lp, lp, torch.ones(1, 2), torch.ones(1, 2), scale=3.0)
        assert loss.item() == pytest.approx(4.5)
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("_test_double_gpg", defaults={})(_double)
    finally:
        losses_module._REGISTRY.pop("_test_double_gpg", None)


def _batch(dtype=torch.float32):
    g = torch.Generator().manual_seed(2)
    B, T = 4, 5
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1] = False  # a response of length 0 among others
    mask[2, 2:] = False
    old = (-torch.rand(B, T, generator=g) * 3 - 0.05)
    lp = torch.clamp(old + 0.2 * torch.randn(B, T, generator=g), max=-1e-3)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    ent = torch.rand(B, T, generator=g) * 2
    old_ent = torch.rand(B, T, generator=g) * 2
    return [x.to(dtype) if x.is_floating_point() else x for x in (lp, old, adv, mask, ent, old_ent)]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", ALL)
def test_all_masked_batch_is_finite_zero_with_zero_grads(name, agg):
    lp, old, adv, mask, ent, old_ent = _batch()
    lp = lp.requires_grad_(True)
    ent = ent.requires_grad_(True)
    loss, metrics = compute_policy_loss(name, lp, old, adv, torch.zeros_like(mask), entropy=ent,
                                        old_entropy=old_ent, agg=agg, **KW)
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp)) and torch.equal(ent.grad, torch.zeros_like(ent))
    assert all(torch.isfinite(v) for v in metrics.values())
    assert metrics["num_tokens"].item() == 0


@pytest.mark.parametrize("name", ALL)
def test_bf16_inputs(name):
    lp32, old32, adv32, mask, ent32, oent32 = _batch()
    kw = dict(agg=None, **KW)
    if name == "clip_cov":
        kw["generator"] = torch.Generator().manual_seed(0)
    lp16 = lp32.to(torch.bfloat16).requires_grad_(True)
    bf = [x.to(torch.bfloat16) for x in (old32, adv32)]
    loss16, m16 = compute_policy_loss(name, lp16, *bf, mask, entropy=ent32.bfloat16(),
                                      old_entropy=oent32.bfloat16(), **kw)
    assert loss16.dtype == torch.float32 and torch.isfinite(loss16)
    assert all(v.dtype == torch.float32 for v in m16.values())
    loss16.backward()
    assert lp16.grad.dtype == torch.bfloat16 and torch.isfinite(lp16.grad.float()).all()
    if name == "clip_cov":
        kw["generator"] = torch.Generator().manual_seed(0)
    # identical to fp32 on the same (bf16-rounded) values: the computation is in fp32
    up = [x.float() for x in (lp16.detach(), *bf)]
    loss_up, _ = compute_policy_loss(name, *up, mask, entropy=ent32.bfloat16().float(),
                                     old_entropy=oent32.bfloat16().float(), **kw)
    assert loss16.item() == loss_up.item()
    # and close to the unrounded fp32 result
    if name not in ("clip_cov", "kl_cov"):  # token selection may flip under rounding
        loss32, _ = compute_policy_loss(name, lp32, old32, adv32, mask, entropy=ent32, old_entropy=oent32, **kw)
        assert loss16.item() == pytest.approx(loss32.item(), rel=5e-2, abs=2e-2)


@pytest.mark.parametrize("name", ALL)
def test_extreme_log_ratios_finite(name):
    lp = torch.tensor([[-1e4, -0.5, -1.0, NAN], [-1e-3, -3.0, NAN, NAN]], requires_grad=True)
    old = torch.tensor([[-1e-3, -1e4 - 0.5, -1e4, -INF], [-1e4, -1e-3, -INF, NAN]])  # -inf only on padding
    adv = torch.tensor([[1.0, -1.0, 2.0, NAN], [-2.0, 1.0, INF, NAN]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    ent = torch.tensor([[0.5, 1.0, 0.2, NAN], [0.3, 0.9, NAN, NAN]], requires_grad=True)
    old_ent = torch.tensor([[1.0, 0.5, 0.2, INF], [0.1, 0.9, NAN, NAN]])
    for kl_est in ("k1", "k2", "k3", "abs"):
        lp.grad = None
        ent.grad = None
        loss, metrics = compute_policy_loss(name, lp, old, adv, mask, entropy=ent, old_entropy=old_ent,
                                            kl_coef=1.0, kl_mask="all", kl_estimator=kl_est,
                                            entropy_coef=0.1, entropy_adv_alpha=0.1)
        assert torch.isfinite(loss), (name, kl_est)
        loss.backward()
        assert torch.isfinite(lp.grad).all() and torch.isfinite(ent.grad).all(), (name, kl_est)
        assert (lp.grad[~mask] == 0).all()
        assert all(torch.isfinite(v) for v in metrics.values()), (name, kl_est)


def test_metrics_are_detached_fp32_scalars():
    lp, old, adv, mask, ent, old_ent = _batch()
    lp.requires_grad_(True)
    _, metrics = compute_policy_loss("grpo", lp, old, adv, mask, entropy=ent, old_entropy=old_ent)
    expected = {"pg_loss", "clip_frac", "approx_kl", "kl_mask_frac", "kl", "entropy", "num_tokens",
                "quad_pos_adv_inc_ent", "quad_pos_adv_dec_ent", "quad_neg_adv_inc_ent", "quad_neg_adv_dec_ent",
                "dual_clip_frac"}
    assert set(metrics) == expected
    for v in metrics.values():
        assert v.dim() == 0 and v.dtype == torch.float32 and not v.requires_grad
    assert metrics["num_tokens"].item() == 4 * 5 - 5 - 3
    _, metrics = compute_policy_loss("grpo", lp, old, adv, mask)  # no entropies: no dH, no entropy metric
    assert "entropy" not in metrics and "quad_pos_adv_dec_ent" not in metrics


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def _args():
    lp, old, adv, mask, ent, old_ent = _batch()
    return lp, old, adv, mask


@pytest.mark.parametrize("arg", ["old_log_prob", "advantages", "response_mask"])
def test_shape_mismatch_names_argument_and_shapes(arg):
    args = dict(zip(["log_prob", "old_log_prob", "advantages", "response_mask"], _args()))
    args[arg] = args[arg][:, :3]
    with pytest.raises(ValueError, match=rf"{arg} has shape \(4, 3\) but log_prob has shape \(4, 5\)"):
        compute_policy_loss("grpo", *args.values())


@pytest.mark.parametrize("kw", ["entropy", "old_entropy", "ref_log_prob"])
def test_optional_tensor_shape_mismatch(kw):
    with pytest.raises(ValueError, match=kw):
        compute_policy_loss("grpo", *_args(), **{kw: torch.zeros(4, 4)})


def test_non_2d_input():
    lp, old, adv, mask = _args()
    with pytest.raises(ValueError, match="log_prob must be a 2-D"):
        compute_policy_loss("grpo", lp[0], old[0], adv[0], mask[0])
    with pytest.raises(ValueError, match="advantages has shape"):
        compute_policy_loss("grpo", lp, old, adv[:, 0], mask)


@pytest.mark.parametrize(
    "call,pattern",
    [
        (dict(name="ppo"), r"unknown policy loss 'ppo'.*grpo.*tepo"),
        (dict(agg="token-sum"), r"token-sum.*seq-mean-token-mean"),
        (dict(kl_estimator="k9"), r"k9.*k1.*k2.*k3"),
        (dict(kl_mask="pos"), r"'pos'.*pos_adv_dec_entropy"),
        (dict(delta_entropy="guess"), r"guess.*measured.*predicted"),
        (dict(clip_ratio_c=1.0), r"clip_ratio_c must be a number > 1"),
        (dict(clip_ratio=0.2), r"unknown option 'clip_ratio' for loss 'grpo'.*clip_ratio_c"),
        (dict(name="tepo", clip_ratio_c=3.0), r"unknown option 'clip_ratio_c' for loss 'tepo'.*\[\]"),
        (dict(name="kl_cov", kl_cov_ratio=0.0), r"kl_cov_ratio"),
        (dict(name="steer"), r"steer.*old_entropy"),
        (dict(entropy_coef=0.1), r"entropy_coef.*entropy"),
        (dict(entropy_adv_alpha=0.1), r"entropy_adv_alpha.*entropy"),
        (dict(entropy_adv_kappa=0.0), r"entropy_adv_kappa"),
        (dict(clip_low=-0.1), r"clip_low"),
        (dict(kl_coef=1.0), r"pos_adv_dec_entropy.*measured.*entropy and old_entropy"),
        (dict(kl_coef=1.0, delta_entropy="predicted"), r"entropy or old_entropy"),
    ],
)
def test_error_messages_name_the_thing(call, pattern):
    call = dict(call)
    name = call.pop("name", "grpo")
    with pytest.raises(ValueError, match=pattern):
        compute_policy_loss(name, *_args(), **call)


def test_kl_mask_none_or_all_needs_no_entropy():
    for kind in ("none", "all"):
        loss, metrics = compute_policy_loss("tepo", *_args(), kl_coef=1.0, kl_mask=kind)
        assert math.isfinite(loss.item())
        assert metrics["kl_mask_frac"].item() == (0.0 if kind == "none" else 1.0)
