"""The sidecars that make a megatron checkpoint directory exportable to HF
(``megatron_tepo_checkpoint.json`` + ``hf_source/``): what they record of the family config, and
that files written before the MoE config was typed (no ``moe`` entry: the MoE sizes sat in an
untyped ``extra`` dict that was left out) still give the right family config."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_tepo.checkpoint import read_checkpoint_info, read_family_config, write_conversion_sidecars
from megatron_tepo.layout import ParallelLayout
from megatron_tepo.models import family_config_from_hf
from tests.checkpoint.fixtures import make_hf_dir

INFO = "megatron_tepo_checkpoint.json"


def _sidecars(tmp_path, family: str, spec: str = "local"):
    hf = make_hf_dir(tmp_path / "hf", family, tie=False, tokenizer=False)
    fam = family_config_from_hf(json.loads((hf / "config.json").read_text()), spec=spec)
    out = tmp_path / "ckpt"
    out.mkdir()
    write_conversion_sidecars(out, hf, fam, torch.float32, ParallelLayout(ep=2 if fam.moe else 1),
                              model_builder="hybrid")
    return out, fam


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_sidecar_records_the_whole_family_config(tmp_path, family):
    out, fam = _sidecars(tmp_path, family, spec="te")
    stored = read_checkpoint_info(out)["family_config"]
    if family == "qwen3_moe":
        assert stored["moe"] == {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32,
                                 "router_pre_softmax": False, "router_score_function": "softmax",
                                 "shared_expert_ffn_hidden_size": 0, "shared_expert_gate": False}
    else:
        assert stored["moe"] is None
    assert "extra" not in stored
    assert read_family_config(out) == fam


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_an_old_sidecar_without_moe_still_loads(tmp_path, family):
    """Written before the MoE config was typed: ``family_config`` without ``moe`` (MoE sizes
    missing); the family config is rebuilt from ``hf_source/config.json`` at the recorded spec."""
    out, fam = _sidecars(tmp_path, family, spec="te")
    info = json.loads((out / INFO).read_text())
    del info["family_config"]["moe"]
    (out / INFO).write_text(json.dumps(info))
    got = read_family_config(out)
    assert got == fam and got.spec == "te"
    assert (got.moe is not None) == (family == "qwen3_moe")
    del info["family_config"]  # older still: no family config at all
    (out / INFO).write_text(json.dumps(info))
    assert read_family_config(out) == fam


def test_a_sidecar_with_an_unknown_field_is_refused(tmp_path):
    out, _ = _sidecars(tmp_path, "qwen3")
    info = json.loads((out / INFO).read_text())
    info["family_config"]["sliding_window"] = 128
    (out / INFO).write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['sliding_window'\]"):
        read_family_config(out)


def test_the_sidecar_records_the_model_builder(tmp_path):
    """The torch_dist keys are the writing model's: the sidecar says which (the exporter builds the
    same); a file from before it was recorded was written by a GPTModel; anything else is refused."""
    from megatron_tepo.checkpoint.sidecars import model_builder_of

    out, fam = _sidecars(tmp_path, "qwen3")
    info = read_checkpoint_info(out)
    assert info["model_builder"] == "hybrid" and model_builder_of(info) == "hybrid"
    del info["model_builder"]
    assert model_builder_of(info) == "gpt"
    with pytest.raises(ValueError, match="model_builder 'mamba'"):
        model_builder_of(dict(info, model_builder="mamba"))
    with pytest.raises(ValueError, match="model_builder"):
        write_conversion_sidecars(out, tmp_path / "hf", fam, torch.float32, ParallelLayout(), model_builder="auto")
