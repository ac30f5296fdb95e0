"""Every method row of the TEPO paper's Tables 1 and 3 has a config under examples/ablations/."""
from pathlib import Path

import pytest

from megatron_tepo.algorithms import PolicyLoss
from megatron_tepo.config import load_config

ABL = Path(__file__).resolve().parents[1] / "examples" / "ablations"

# file stem -> (loss, expected algorithm fields)
ROWS = {
    "table1_grpo_dapo": ("grpo", dict(clip_low=0.2, clip_high=0.28, kl_coef=0.0)),
    "table1_clip_cov": ("clip_cov", dict(loss_args={"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0})),
    "table1_kl_cov": ("kl_cov", dict(loss_args={"kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0})),
    "table1_entropy_based_term": ("grpo", dict(entropy_adv_alpha=4e-4, entropy_adv_kappa=2.0)),
    "table1_gpg": ("gpg", {}),
    "table1_gspo": ("gspo", dict(clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean")),
    "table1_tepo_qwen2.5_7b": ("tepo", dict(kl_coef=0.001, kl_mask="pos_adv_dec_entropy", agg="token-mean")),
    "table1_tepo_qwen3_14b": ("tepo", dict(kl_coef=1.0, kl_mask="pos_adv_dec_entropy")),
    "table3_tepo_wo_kl": ("tepo", dict(kl_coef=0.0)),
    "table3_a_undiff_kl_beta_1": ("tepo", dict(kl_coef=1.0, kl_mask="all")),
    "table3_a_undiff_kl_beta_0.1": ("tepo", dict(kl_coef=0.1, kl_mask="all")),
    "table3_a_undiff_kl_beta_0.01": ("tepo", dict(kl_coef=0.01, kl_mask="all")),
    "table3_a_undiff_kl_beta_0.001": ("tepo", dict(kl_coef=0.001, kl_mask="all")),
    "table3_a_undiff_kl_beta_0.0001": ("tepo", dict(kl_coef=0.0001, kl_mask="all")),
    "table3_b_max_entropy": ("tepo", dict(kl_coef=0.0, entropy_coef=1e-3)),
    "table3_b_min_entropy": ("tepo", dict(kl_coef=0.0, entropy_coef=-1e-3)),
    "table3_b_steel": ("steer", dict(loss_args={"steer_w_min": 0.8, "clip_ratio_c": 10.0})),
    "table3_b_clip_cov": ("clip_cov", {}),
    "table3_b_kl_cov": ("kl_cov", {}),
    "table3_b_entropy_based_term": ("grpo", dict(entropy_adv_alpha=4e-4)),
    "table3_c_grpo_dapo_token_level": ("grpo", {}),
    "table3_c_gpg_remove_is": ("gpg", {}),
    "table3_c_cispo": ("cispo", dict(clip_low=None, clip_high=4.0)),
    "table3_c_sentence_prefix_is": ("prefix_is", dict(clip_low=0.2, clip_high=0.28)),
    "table3_d_seq_mean_token_mean_gspo_agg": ("gspo", dict(agg="seq-mean-token-mean")),
    "table3_d_seq_mean_token_sum": ("tepo", dict(agg="seq-mean-token-sum", kl_coef=0.0)),
    "table3_e_tepo_wo_kl": ("tepo", dict(kl_coef=0.0)),
    "table3_e_kl_neg_adv_inc_ent": ("tepo", dict(kl_coef=0.001, kl_mask="neg_adv_inc_entropy")),
    "table3_e_kl_either": ("tepo", dict(kl_coef=0.001, kl_mask="either")),
    "table3_e_tepo": ("tepo", dict(kl_coef=0.001, kl_mask="pos_adv_dec_entropy")),
}


@pytest.mark.parametrize("stem", sorted(ROWS))
def test_row_config(stem):
    cfg = load_config(ABL / f"{stem}.yaml")
    loss, fields = ROWS[stem]
    assert cfg.algorithm.loss == loss
    if loss == "tepo":  # every TEPO row: the loss's own range, 0.01/0.014 (docs/ALGORITHMS.md, "tepo")
        effective = PolicyLoss.from_config(cfg.algorithm)
        assert (effective.clip_low, effective.clip_high) == (0.01, 0.014), stem
    for name, value in fields.items():
        got = getattr(cfg.algorithm, name)
        assert got == (pytest.approx(value) if isinstance(value, float) else value), (stem, name, got)
    # Section 4.1's setup holds in every row.
    assert (cfg.rollout.prompts_per_step, cfg.rollout.n_samples, cfg.rollout.temperature) == (64, 8, 1.0)
    assert cfg.rollout.dynamic_sampling and cfg.optim.lr == pytest.approx(5e-7)
    assert cfg.train.mini_batch_prompts == 16


def test_no_unlisted_row_files():
    files = {p.stem for p in ABL.glob("*.yaml") if not p.stem.startswith("_")}
    assert files == set(ROWS)


def test_the_main_job_gets_tepos_own_range():
    """What a user gets without asking: examples/tiny_tepo/config.yaml sets no clip range."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples/tiny_tepo/config.yaml")
    assert (cfg.algorithm.loss, cfg.algorithm.clip_low, cfg.algorithm.clip_high) == ("tepo", None, None)
    effective = PolicyLoss.from_config(cfg.algorithm)
    assert (effective.clip_low, effective.clip_high) == (0.01, 0.014)
