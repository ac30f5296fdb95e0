"""Acceptance 1-3: HF -> Megatron -> HF bit for bit; converted checkpoints give the HF logits at
TP=2 and PP=2; a TP=2 checkpoint loads at TP=1 and PP=2 with the same logits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint.fixtures import VARIANTS, causal_lm, load_hf_tensors, make_hf_dir, stack_experts, variant_id
from tests.dist_utils import torchrun

WORKER = Path(__file__).with_name("convert_worker.py")
pytestmark = pytest.mark.distributed


def _build(root: Path, variants):
    for family, tie in variants:
        make_hf_dir(root / f"hf-{variant_id(family, tie)}", family, tie, seed=hash((family, tie)) % 1000)
    return ",".join(variant_id(f, t) for f, t in variants)


def _assert_bitwise(res: dict):
    for v, r in res.items():
        assert r["same_names"], (v, r)
        assert r["not_equal"] == [], (v, r["not_equal"])
        assert "model.safetensors.index.json" in r["files"] and "config.json" in r["files"]
        assert "generation_config.json" in r["files"] and "tokenizer.json" in r["files"]


def test_roundtrip_tp1_all_variants(tmp_path):
    """All 6 variants (Llama/Qwen2/Qwen3 x tied/untied) through TP=1, one process."""
    names = _build(tmp_path, VARIANTS)
    (res,) = torchrun(WORKER, 1, "roundtrip", str(tmp_path), names, tmp_path=tmp_path)
    assert sorted(res) == sorted(variant_id(f, t) for f, t in VARIANTS)
    _assert_bitwise(res)


def test_roundtrip_tp2pp2_and_logits(tmp_path):
    """TP=2 x PP=2 (4 ranks) for 3 variants: bitwise round trip, and the logits of the model
    loaded from each checkpoint at TP2xPP2 match HF (fp32, 1e-5)."""
    variants = [("llama", True), ("qwen2", False), ("qwen3", True)]
    names = _build(tmp_path, variants)
    results = torchrun(WORKER, 4, "import", str(tmp_path), "2", "2", names, "--logits", tmp_path=tmp_path)
    with_logits = [r for r in results if all(v.get("has_logits") for v in r.values())]
    assert len(with_logits) == 2  # the two TP ranks of the last stage
    for r in with_logits:
        for v, d in r.items():
            assert d["max_abs_diff"] < 1e-5, (v, d)
    (res,) = torchrun(WORKER, 1, "export", str(tmp_path), "tp2pp2", names, tmp_path=tmp_path / "exp")
    _assert_bitwise(res)


def test_bf16_checkpoint_roundtrip_tp2(tmp_path):
    """A bf16 HF checkpoint (what real models ship) through TP=2 and back: bf16 tensors, bit for bit."""
    make_hf_dir(tmp_path / "hf-qwen3_bf16", "qwen3", False, seed=5, dtype=torch.bfloat16)
    torchrun(WORKER, 2, "import", str(tmp_path), "2", "1", "qwen3_bf16", tmp_path=tmp_path / "a")
    (res,) = torchrun(WORKER, 1, "export", str(tmp_path), "tp2pp1", "qwen3_bf16", tmp_path=tmp_path / "b")
    _assert_bitwise(res)
    back = load_hf_tensors(tmp_path / "back-qwen3_bf16-tp2pp1")
    assert back and {t.dtype for t in back.values()} == {torch.bfloat16}


def test_tp2_logits_and_reshard_to_tp1_and_pp2(tmp_path):
    """Convert at TP=2 (logits vs HF at TP=2), then load that checkpoint at TP=1 and at PP=2:
    same logits as HF, and as each other."""
    names = _build(tmp_path, [("qwen3", False)])
    hf, ckpt = tmp_path / f"hf-{names}", tmp_path / f"mg-{names}-tp2pp1"
    r_tp2 = torchrun(WORKER, 2, "import", str(tmp_path), "2", "1", names, "--logits", tmp_path=tmp_path / "a")
    r_tp1 = torchrun(WORKER, 1, "logits", str(ckpt), str(hf), "1", "1", tmp_path=tmp_path / "b")
    r_pp2 = torchrun(WORKER, 2, "logits", str(ckpt), str(hf), "1", "2", tmp_path=tmp_path / "c")
    diffs = {"tp2": r_tp2[0][names], "tp1": r_tp1[0], "pp2": r_pp2[1]}
    for k, d in diffs.items():
        assert d["has_logits"] and d["max_abs_diff"] < 1e-5, (k, d)
    logits = {k: torch.load(d["saved"]) for k, d in diffs.items()}
    assert torch.equal(logits["tp1"], logits["pp2"])  # same ops, different placement
    # TP=2 splits the matmul reductions (row-parallel all-reduce): measured 1.4e-6 on logits ~4
    assert float((logits["tp1"] - logits["tp2"]).abs().max()) < 5e-6


MOE_VARIANTS = [("qwen3_moe", False)]  # untied as every released Qwen3-MoE (tying: dense tests)


@pytest.mark.second_lane  # (about 70 s: the first lane is the critical path, tools/test.sh)
def test_qwen3_moe_ep2_and_ep1(tmp_path):
    """Qwen3-MoE (4 experts, top-2, QK-norm; one HF tensor per expert as safetensors store them),
    untied. TP=2: convert, load, logits vs HF (1e-5). EP=2 (2 ranks, each holding and reading only its 2 experts): convert, load
    at EP=2, logits vs HF (1e-5); the one-process exporter (EP=1) gives back every expert, bit for
    bit. EP=1: round trip bit for bit, logits vs HF, and the EP=2 checkpoint loaded at EP=1."""
    names = _build(tmp_path, MOE_VARIANTS)
    results = torchrun(WORKER, 2, "import", str(tmp_path), "1", "1", names, "--logits", "--ep", "2",
                       tmp_path=tmp_path / "ep2")
    for r in results:  # EP=2 is data-parallel over tokens: both ranks compute full logits
        for v, d in r.items():
            assert d["has_logits"] and d["max_abs_diff"] < 1e-5, (v, d)
    # TP=2 (the 30B-A3B example's kind of layout: an MoE layer at TP > 1, which trains with sequence
    # parallelism; the converter refused it): convert and load at TP=2, logits vs HF
    results = torchrun(WORKER, 2, "import", str(tmp_path), "2", "1", names, "--logits",
                       tmp_path=tmp_path / "tp2")
    for r in results:
        for v, d in r.items():
            assert d["has_logits"] and d["max_abs_diff"] < 1e-5, (v, d)
    (res,) = torchrun(WORKER, 1, "ep1", str(tmp_path), "tp1pp1ep2", names, tmp_path=tmp_path / "ep1")
    for v, r in res.items():
        _assert_bitwise({v: r["roundtrip_ep1"]})
        _assert_bitwise({v: r["export_of_ep2"]})
        # 4 layers x (q,k,v,o, q/k norm, 2 layer norms, router, 4 experts x 3) + embed, norm (+ lm_head)
        assert r["export_of_ep2"]["n"] == 4 * (4 + 2 + 2 + 1 + 4 * 3) + 2 + v.endswith("untied"), r
        for k in ("logits_ep1", "logits_ep2_ckpt_at_ep1"):
            assert r[k]["has_logits"] and r[k]["max_abs_diff"] < 1e-5, (v, k, r[k])


QWEN3_5_VARIANTS = [("qwen3_5", False), ("qwen3_5_moe", False)]


def _gdn_available():
    from packaging.version import Version

    from megatron_tepo.megatron.compat import hybrid_model_available, mcore_version

    return hybrid_model_available() and mcore_version() >= Version("0.19")


@pytest.mark.second_lane  # (about 136 s: the first lane is the critical path, tools/test.sh)
@pytest.mark.skipif(not _gdn_available(), reason="Qwen3.5 needs megatron-core >= 0.19 (HybridModel, Gated DeltaNet)")
def test_qwen3_5_tp2_and_ep2_logits_and_roundtrip(tmp_path):
    """Qwen3.5 dense and MoE (3 Gated DeltaNet + 1 gated attention layer; the MoE with 4 experts
    and a gated shared expert), untied: converted at TP=2 (each rank its share of every section of
    the Gated DeltaNet's fused in_proj and conv1d, of each query group's queries, gates, key and
    value) and the MoE at EP=2, each loaded at its layout with the HF logits (1e-5), each exported
    by the one-process exporter (TP=1, EP=1: resharded) bit for bit. Beside them the published kind
    of checkpoint, a ``Qwen3_5ForConditionalGeneration`` (``qwen3_5-cg``: the text model under
    ``model.language_model.``, a tiny vision tower, ``mtp.*`` tensors): its text model converted at
    TP=2 with the HF logits, exported with every tensor bit for bit (the vision and MTP ones: the
    checkpoint's ``hf_source/carried.safetensors``), its config.json as it was, loading as
    ``Qwen3_5ForConditionalGeneration``. The MoE at EP=2 is a folder that stores its experts stacked,
    as the published ones do (#56 row 2): its logits are transformers' own load of that folder, and
    it exports stacked, bit for bit."""
    import json

    import transformers

    names = _build(tmp_path, QWEN3_5_VARIANTS) + ",qwen3_5-cg"
    cg = make_hf_dir(tmp_path / "hf-qwen3_5-cg", "qwen3_5", False, seed=5, conditional_generation=True)
    moe = variant_id("qwen3_5_moe", False) + "-stacked"
    stacked = stack_experts(make_hf_dir(tmp_path / f"hf-{moe}", "qwen3_5_moe", False, seed=6))
    for args, where in (((("2", "1", names)), "tp2"), ((("1", "1", moe, "--ep", "2")), "ep2")):
        results = torchrun(WORKER, 2, "import", str(tmp_path), *args[:3], "--logits", *args[3:],
                           tmp_path=tmp_path / where)
        for r in results:  # (TP=2: both ranks gather full logits; EP=2: data-parallel over tokens)
            for v, d in r.items():
                assert d["has_logits"] and d["max_abs_diff"] < 1e-5, (where, v, d)
    for suffix, which in (("tp2pp1", names), ("tp1pp1ep2", moe)):
        (res,) = torchrun(WORKER, 1, "export", str(tmp_path), suffix, which, tmp_path=tmp_path / f"exp-{suffix}")
        _assert_bitwise(res)
    back_moe = tmp_path / f"back-{moe}-tp1pp1ep2"
    assert set(stacked) <= set(load_hf_tensors(back_moe)) and len(stacked) == 8
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # transformers reloads the export with 0.0 difference
        assert torch.equal(causal_lm(back_moe)(input_ids=ids).logits,
                           causal_lm(tmp_path / f"hf-{moe}")(input_ids=ids).logits)
    back = tmp_path / "back-qwen3_5-cg-tp2pp1"
    assert len([n for n in load_hf_tensors(back) if n.startswith(("model.visual.", "mtp."))]) > 20
    assert json.loads((back / "config.json").read_text()) == json.loads((cg / "config.json").read_text())
    model, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(back), output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
