"""The loss is built once, as an object: PolicyLoss holds its resolved settings, counts its own
normaliser and says how each metric reduces; the trainer builds it from the run config's
``algorithm`` section, and ``compute_policy_loss`` (the functional entry point) is the same object."""
import dataclasses

import pytest
import torch

from megatron_tepo.algorithms import PolicyLoss, RolloutCorrection, compute_policy_loss, count_for_normalizer
from megatron_tepo.config import AlgorithmConfig, ConfigError, from_dict


def _batch(seed=0, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1 - 1.0
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 4:] = False
    def rnd(fn):
        return fn(b, t, generator=g, dtype=torch.float64)

    return dict(log_prob=lp.requires_grad_(), old_log_prob=lp.detach() + 0.01 * rnd(torch.randn),
                advantages=rnd(torch.randn), response_mask=mask, entropy=rnd(torch.rand), old_entropy=rnd(torch.rand))


def test_every_field_is_read_from_the_config_section_by_name():
    """A new shared option is a field of PolicyLoss and of AlgorithmConfig under one name: nothing between."""
    cfg_fields = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    for f in dataclasses.fields(PolicyLoss):
        assert PolicyLoss.CONFIG_NAMES.get(f.name, f.name) in cfg_fields, f.name


def test_from_config_resolves_defaults_and_the_correction():
    alg = AlgorithmConfig(loss="grpo", kl_coef=0.1, loss_args={"clip_ratio_c": 4.0})
    alg.rollout_correction.rollout_is = "token"
    loss = PolicyLoss.from_config(alg)
    assert (loss.name, loss.clip_low, loss.clip_high, loss.agg) == ("grpo", 0.2, 0.28, "token-mean")
    assert loss.options["clip_ratio_c"] == 4.0 and loss.kl_coef == 0.1
    assert loss.correction == RolloutCorrection(rollout_is="token")
    tepo = PolicyLoss.from_config(AlgorithmConfig())  # tepo's own default
    assert (tepo.clip_low, tepo.clip_high) == (0.01, 0.014)


@pytest.mark.parametrize("settings", [
    dict(name="tepo"),
    dict(name="grpo", kl_coef=0.1, kl_mask="all", agg="seq-mean-token-sum", clip_ratio_c=3.0),
    dict(name="gspo", entropy_coef=0.01, entropy_adv_alpha=0.5),
])
def test_the_object_is_the_functional_entry_point(settings):
    batch = _batch()
    name = settings.pop("name")
    loss = PolicyLoss.of(name, **settings)
    a, ma = loss(**batch)
    b, mb = compute_policy_loss(name, **batch, **settings)
    assert torch.equal(a, b) and ma.keys() == mb.keys()
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_bad_settings_fail_when_built_not_per_micro_batch():
    with pytest.raises(ValueError, match="unknown KL mask 'sometimes'"):
        PolicyLoss.of("grpo", kl_mask="sometimes")
    with pytest.raises(ValueError, match="unknown option 'clip_ratio_d' for loss 'grpo'"):
        PolicyLoss.of("grpo", clip_ratio_d=3.0)
    with pytest.raises(ConfigError, match=r"^algorithm\.loss_args\.foo"):
        from_dict({"algorithm": {"loss": "grpo", "loss_args": {"foo": 1}}})


def test_count_and_metric_reduction_belong_to_the_loss():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss = PolicyLoss.of("grpo", agg=agg)
        assert torch.equal(loss.count(mask), count_for_normalizer(mask, agg))
    loss = PolicyLoss.of("grpo")
    assert loss.is_summed("pg_loss") and loss.is_summed("num_tokens") and not loss.is_summed("clip_frac")
    assert loss.metric_weight("pg_loss", {}, 10) == 1.0
    assert loss.metric_weight("kl", {"kl_mask_frac": 0.25}, 8) == 2.0  # a mean over the KL-mask tokens
    assert loss.metric_weight("entropy", {"kl_mask_frac": 0.25}, 8) == 8


def test_micro_batches_sum_to_the_whole_batch_with_the_counted_normaliser():
    batch = _batch(1)
    loss = PolicyLoss.of("grpo", agg="seq-mean-token-mean")
    whole, _ = loss(**batch)
    norm = loss.count(batch["response_mask"])
    parts = [loss(**{k: v[i:i + 2] for k, v in batch.items()}, normalizer=norm)[0] for i in (0, 2)]
    assert torch.allclose(sum(parts), whole, atol=1e-12)
