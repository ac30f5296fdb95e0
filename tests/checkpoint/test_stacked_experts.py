"""Issue #56 row 2: a Qwen3.5-MoE checkpoint whose experts are stored stacked, as the published ones
are (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``, no
``.weight``), written by hand from a tiny model's ``save_pretrained`` folder (one tensor per expert):
transformers loads both folders to the same logits; the reader serves the stacked one in the
per-expert names, bit for bit; the writer puts a stacked source's experts back stacked, which
transformers reloads with 0.0 difference. No process group: the converters and the actor on such a
folder are in tests/checkpoint/test_convert_roundtrip.py::test_qwen3_5_tp2_and_ep2_logits_and_roundtrip
and tests/megatron/test_qwen3_5.py::test_qwen3_5_matches_hf_at_tp1_tp2_pp2_cp2."""
from __future__ import annotations

import pytest
import torch

from tests.checkpoint.fixtures import causal_lm, load_hf_tensors, make_hf_dir, stack_experts

pytestmark = pytest.mark.skipif(not hasattr(__import__("transformers"), "Qwen3_5MoeTextConfig"),
                                reason="this transformers has no Qwen3.5-MoE")


def _logits(path) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return causal_lm(path)(input_ids=ids).logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same tiny Qwen3.5-MoE twice: as ``save_pretrained`` wrote it, and stacked by hand."""
    root = tmp_path_factory.mktemp("stacked")
    per_expert = make_hf_dir(root / "per-expert", "qwen3_5_moe", False, seed=3, tokenizer=False)
    stacked = make_hf_dir(root / "stacked", "qwen3_5_moe", False, seed=3, tokenizer=False)
    names = stack_experts(stacked)
    assert len(names) == 2 * 4 and "model.layers.3.mlp.experts.gate_up_proj" in names
    return per_expert, stacked


def test_a_stacked_checkpoint_reads_as_one_tensor_per_expert(folders):
    from megatron_tepo.checkpoint.hf_io import check_hf_tensors, load_hf_config, open_hf_checkpoint
    from megatron_tepo.models import family_config_from_hf, hf_to_megatron

    per_expert, stacked = folders
    stored = load_hf_tensors(stacked)
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # [E, 2I, H]
    assert stored["model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 32)  # [E, H, I]
    assert not any(".experts.0." in n for n in stored)
    assert torch.equal(_logits(stacked), _logits(per_expert))  # the layout as transformers reads it
    a, b = open_hf_checkpoint(per_expert), open_hf_checkpoint(stacked)
    assert sorted(b.names()) == sorted(a.names())
    assert [n for n in a.names() if not torch.equal(a.get(n), b.get(n))] == []
    up = "model.layers.2.mlp.experts.3.up_proj.weight"  # the last expert's second piece
    assert torch.equal(b.get(up, rows=(5, 9)), a.get(up)[5:9])
    assert b.stored_name(up) == "model.layers.2.mlp.experts.gate_up_proj"
    assert sorted(b.stored_tensors()) == sorted(stored)
    check_hf_tensors(b, load_hf_config(stacked))  # the config's shapes, nothing missing or unexpected
    fam = family_config_from_hf(load_hf_config(stacked), spec="local")
    mg_a = dict(hf_to_megatron(((n, a.get(n)) for n in a.names()), fam))
    mg_b = dict(hf_to_megatron(((n, b.get(n)) for n in b.names()), fam))
    assert sorted(mg_a) == sorted(mg_b) and all(torch.equal(mg_a[n], mg_b[n]) for n in mg_a)


def test_a_published_kind_of_stacked_checkpoint_reads_in_the_text_models_names(tmp_path):
    """``Qwen3_5MoeForConditionalGeneration``: the stacked experts under ``model.language_model.``."""
    from megatron_tepo.checkpoint.hf_io import open_hf_checkpoint

    cg = make_hf_dir(tmp_path / "cg", "qwen3_5_moe", False, seed=3, tokenizer=False, conditional_generation=True)
    before = open_hf_checkpoint(cg)
    want = {n: before.get(n) for n in before.names()}
    assert "model.language_model.layers.1.mlp.experts.down_proj" in stack_experts(cg)
    after = open_hf_checkpoint(cg)
    assert sorted(after.names()) == sorted(want) and all(torch.equal(after.get(n), want[n]) for n in want)
    assert after.stored_name("model.layers.1.mlp.experts.0.down_proj.weight") == \
        "model.language_model.layers.1.mlp.experts.down_proj"
    assert "mtp.fc.weight" in after.carried_names()


def test_the_writer_writes_a_stacked_sources_experts_stacked(folders, tmp_path):
    """What the export and the converter write through (``HFDirWriter``): the per-expert tensors
    of a stacked source go back into its stacked tensors, bit for bit; transformers reloads the
    result with 0.0 difference. A stream that misses an expert names the stacked tensor."""
    from megatron_tepo.checkpoint.hf_io import open_hf_checkpoint
    from megatron_tepo.checkpoint.megatron_to_hf import HFDirWriter
    from megatron_tepo.checkpoint.sidecars import hf_tensor_table

    per_expert, stacked = folders
    source = open_hf_checkpoint(stacked)
    table = hf_tensor_table(source)
    assert table["model.layers.0.mlp.experts.gate_up_proj"]["shape"] == [4, 64, 64]
    reader = open_hf_checkpoint(per_expert)
    writer = HFDirWriter(tmp_path / "out", table, stacked, False, force=False, naming=source.naming)
    for name in reversed(reader.names()):  # any order: a stacked tensor is written once complete
        writer.add(name, reader.get(name))
    out = writer.close()
    got, want = load_hf_tensors(out), load_hf_tensors(stacked)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert torch.equal(_logits(out), _logits(stacked))

    short = HFDirWriter(tmp_path / "short", table, stacked, False, force=False, naming=source.naming)
    for name in reader.names():
        if name != "model.layers.1.mlp.experts.2.up_proj.weight":
            short.add(name, reader.get(name))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj .*7 piece\(s\) given"):
        short.close()
    short.abort()
    assert not (tmp_path / "short").exists()


def test_a_layer_with_both_layouts_is_refused_naming_both(folders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_tepo.checkpoint.hf_io import open_hf_checkpoint

    _, stacked = folders
    mixed = shutil.copytree(stacked, tmp_path / "mixed")
    (f,) = mixed.glob("*.safetensors")
    tensors = load_file(str(f))
    tensors["model.layers.0.mlp.experts.1.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.(1\.up_proj\.weight|gate_up_proj)' and "
                                         r"'model\.layers\.0\.mlp\.experts\.(1\.up_proj\.weight|gate_up_proj)' .* both "
                                         r"the text model's 'model\.layers\.0\.mlp\.experts\.1\.up_proj\.weight'"):
        open_hf_checkpoint(mixed)
