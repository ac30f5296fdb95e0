"""The layer-kind table (megatron_tepo/layer_kinds.py): one row per token mixer, read by the family
configs, the hybrid builder, the Qwen3.5 name tables, the CPU stand-ins and the fit check, so that a
new kind is a row (and its sublayer spec and name table), not edits across the package."""
import dataclasses

import pytest

from megatron_tepo import layer_kinds
from megatron_tepo.layer_kinds import ATTENTION, BY_LAYER_TYPE, GATED_DELTANET, MIXERS
from megatron_tepo.layout import ModelShape

HYBRID = ModelShape(num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, intermediate_size=256,
                    num_hidden_layers=8, hidden_size=128, head_dim=32, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_layers=6, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel=4, attention_output_gate=True)


def test_every_row_is_its_own():
    for field in ("name", "hf_layer_type", "symbol"):
        values = [getattr(k, field) for k in MIXERS]
        assert len(set(values)) == len(values), field
    assert MIXERS[0] is ATTENTION and BY_LAYER_TYPE["linear_attention"] is GATED_DELTANET
    assert not {k.symbol for k in MIXERS} & {"-", "E", "|"}  # the MLP symbols and the stage separator


def test_every_kind_has_its_sublayer_spec_name_table_and_cpu_stand_in():
    from megatron_tepo.megatron.cpu_patches import PATCHES
    from megatron_tepo.megatron.hybrid import MIXER_SPECS
    from megatron_tepo.models.qwen3_5.state_dict_adapter import MIXER_MAPPINGS

    assert set(MIXER_SPECS) == {k.name for k in MIXERS if k is not ATTENTION}
    assert set(MIXER_MAPPINGS) == {k.name for k in MIXERS}
    assert {k.cpu_stand_in for k in MIXERS} - {""} <= set(PATCHES)


def test_the_family_config_and_the_pattern_read_the_table():
    from megatron_tepo.megatron.hybrid import layer_pattern
    from megatron_tepo.models import GPTFamilyConfig, LinearAttentionConfig

    fam = GPTFamilyConfig(family="qwen3_5", num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                          num_query_groups=2, head_dim=32, vocab_size=1000, tie_word_embeddings=False,
                          layer_types=("linear_attention",) * 3 + ("full_attention",),
                          linear_attention=LinearAttentionConfig(2, 4, 16, 16))
    assert [fam.layer_kind(i) for i in range(fam.num_layers)] == [GATED_DELTANET] * 3 + [ATTENTION]
    assert layer_pattern(fam) == "G-G-G-*-"
    assert layer_kinds.attention_layers(fam.dims()) == 1


def test_the_fit_check_prices_each_kind_from_its_row(monkeypatch):
    """A row's price is what the fit check adds, with nothing else edited: a Gated DeltaNet priced
    one parameter dearer per layer makes the model that many parameters dearer, and a row with a
    recurrent state gives the server that state."""
    from megatron_tepo.launch import memory

    before = memory.param_counts(HYBRID)["first"][0]
    state_before = memory.linear_state_bytes(HYBRID, 1)
    dearer = dataclasses.replace(GATED_DELTANET, params=lambda m, t: GATED_DELTANET.params(m, t) + 1,
                                 state_bytes=lambda m, ts: 7)
    monkeypatch.setattr(layer_kinds, "MIXERS", (ATTENTION, dearer))
    assert memory.param_counts(HYBRID)["first"][0] == before + HYBRID.linear_layers
    assert memory.linear_state_bytes(HYBRID, 1) == 7 * HYBRID.linear_layers != state_before


@pytest.mark.parametrize("selective", [False, True])
def test_a_hybrid_s_activations_average_its_kinds(selective):
    from megatron_tepo.launch import memory

    dense = dataclasses.replace(HYBRID, linear_layers=0)
    a, b = memory.layer_activation_bytes(dense, 1, False, selective=selective), \
        memory.layer_activation_bytes(HYBRID, 1, False, selective=selective)
    att = ATTENTION.activations(HYBRID, 2, 0, selective)
    gdn = GATED_DELTANET.activations(HYBRID, 2, 0, selective)
    assert b - a == pytest.approx(2 * 6 / 8 * (gdn[0] - att[0]) + 6 / 8 * (gdn[1] - att[1]))
