"""The parallel layout's rules, written once (megatron_tepo/layout.py) and read by every consumer:
the config section is a ParallelLayout, and the actor's check, the HF -> Megatron converter and the
fit check all raise the same rule's words, each naming its own knobs."""
import json

import pytest

from megatron_tepo.config import ConfigError, RunConfig, from_dict
from megatron_tepo.layout import ModelShape, ParallelLayout, validate_layout

DENSE = ModelShape(num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=64,
                  num_hidden_layers=4)
MOE = ModelShape(num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=64,
                num_hidden_layers=4, num_experts=4)


def test_valid_layouts_give_dp():
    assert validate_layout(ParallelLayout(tp=2, pp=2), DENSE, 8) == 2
    assert validate_layout(ParallelLayout(), DENSE, 2) == 2
    assert validate_layout(ParallelLayout(ep=2), MOE, 4) == 4
    assert ParallelLayout(tp=2, pp=2).dp(8) == 2 and ParallelLayout(tp=2).model_parallel == 2
    assert validate_layout(ParallelLayout(tp=2, cp=2), DENSE, 8) == 2  # (#44: cp is a model-parallel size)
    assert ParallelLayout(tp=2, cp=2).model_parallel == 4


@pytest.mark.parametrize("layout, dims, world, pattern, kw", [
    (ParallelLayout(tp=3), dict(num_attention_heads=6, num_key_value_heads=6, intermediate_size=66), 3,
     r"parallel.tp=3 does not divide vocab_size=256 \(the actor does not pad", {}),
    (ParallelLayout(tp=4), {}, 4, r"parallel.tp=4 does not divide num_key_value_heads=2", {}),
    (ParallelLayout(tp=2), dict(num_attention_heads=5, num_key_value_heads=5), 2,
     r"parallel.tp=2 does not divide num_attention_heads=5", {}),
    (ParallelLayout(pp=3), {}, 3, r"parallel.pp=3 does not divide num_hidden_layers=4", {}),
    (ParallelLayout(tp=2), {}, 3, r"parallel.tp x parallel.pp = 2 does not divide the world size \(3\)", {}),
    (ParallelLayout(tp=1), {}, 1, r"actor.sequence_parallel=true needs parallel.tp > 1", dict(sequence_parallel=True)),
    (ParallelLayout(ep=2), {}, 2, r"parallel.ep=2 > 1 needs an MoE model", {}),
    (ParallelLayout(cp=2), {}, 2, r"parallel.cp=2: context parallelism splits packed sequences: needs "
                                  r"actor.pack_sequences=true", dict(pack_sequences=False)),
    (ParallelLayout(tp=2, cp=2), {}, 6, r"parallel.tp x parallel.pp x parallel.cp = 4 does not divide the world", {}),
    (ParallelLayout(tp=0), {}, 2, r"parallel.tp=0 must be integers >= 1", {}),
])
def test_bad_layouts_name_the_rule_and_the_knob(layout, dims, world, pattern, kw):
    import dataclasses

    with pytest.raises(ValueError, match=pattern) as err:
        validate_layout(layout, dataclasses.replace(DENSE, **dims), world, **kw)
    assert "\n" not in str(err.value)


def test_every_broken_rule_is_named_at_once():
    with pytest.raises(ValueError) as err:
        validate_layout(ParallelLayout(tp=3, pp=3), DENSE, 9)
    msg = str(err.value)
    assert "parallel.tp=3 does not divide num_attention_heads=4" in msg
    assert "parallel.pp=3 does not divide num_hidden_layers=4" in msg


def test_moe_rules():
    with pytest.raises(ValueError, match=r"parallel.ep=3 does not divide num_experts=4"):
        validate_layout(ParallelLayout(ep=3), MOE, 3)
    with pytest.raises(ValueError, match=r"parallel.ep=2 does not divide the data-parallel size 3"):
        validate_layout(ParallelLayout(ep=2), MOE, 3)
    with pytest.raises(ValueError, match=r"MoE with parallel.tp=2 needs actor.sequence_parallel"):
        validate_layout(ParallelLayout(tp=2), MOE, 2)
    with pytest.raises(ValueError, match=r"MoE with parallel.pp=2 does not run on CPU"):
        validate_layout(ParallelLayout(pp=2), MOE, 2, cpu=True)
    assert validate_layout(ParallelLayout(pp=2), MOE, 2, cpu=False) == 1
    # megatron's expert grid spreads the experts over data- and context-parallel ranks together
    assert validate_layout(ParallelLayout(ep=2, cp=2), MOE, 2) == 1
    with pytest.raises(ValueError, match=r"parallel.ep=4 does not divide data-parallel x parallel.cp 2"):
        validate_layout(ParallelLayout(ep=4, cp=2), MOE, 2)
    # unknown TE (the login node's fit check): that one rule is left to the actor
    assert validate_layout(ParallelLayout(tp=2), MOE, 2, sequence_parallel=True) == 1


def test_the_config_section_is_the_layout():
    cfg = from_dict({"parallel": {"tp": 2, "pp": 1}})
    assert isinstance(cfg.parallel, ParallelLayout) and cfg.parallel == ParallelLayout(tp=2)
    assert RunConfig().parallel == ParallelLayout()
    assert from_dict({"parallel": {"cp": 2}}).parallel == ParallelLayout(cp=2)
    with pytest.raises(ConfigError, match=r"parallel.cp: context parallelism splits packed sequences"):
        from_dict({"parallel": {"cp": 2}, "actor": {"pack_sequences": False}})
    with pytest.raises(ConfigError, match=r"parallel.dp: unknown key"):
        from_dict({"parallel": {"dp": 2}})


def test_converter_and_fit_check_raise_the_same_rule(tmp_path):
    """One rule, three doors: the converter names its flags, the fit check the config's keys."""
    from megatron_tepo.checkpoint import check_hf_input
    from megatron_tepo.launch import FitError, LaunchLayout, ModelShape, check_layout

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 128}))
    with pytest.raises(ValueError, match=r"--tp=3 does not divide num_attention_heads=4"):
        check_hf_input(hf, tp=3)
    # (#33: one model-shape type under the HF names, layout.ModelShape; the same sizes)
    shape = ModelShape(num_hidden_layers=4, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False)
    cfg = RunConfig(parallel=ParallelLayout(tp=3))
    with pytest.raises(FitError, match=r"parallel.tp=3 does not divide num_attention_heads=4"):
        check_layout(shape, cfg, LaunchLayout(gpus_per_node=3))
    with pytest.raises(FitError, match=r"does not divide the actor's ranks \(launch.actor_nodes x "
                                       r"launch.gpus_per_node\) \(4\)"):
        check_layout(shape, RunConfig(parallel=ParallelLayout(tp=2, pp=4)), LaunchLayout(gpus_per_node=4))
