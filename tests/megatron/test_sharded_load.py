"""Building the actor from an HF directory: each rank reads only its own slices, draws no random
init, and ends up bit for bit where the state-dict path puts it (issue #22, row 4).

Under torchrun (gloo, see workers/sharded_load_worker.py). Checked per rank: no whole-file read
(``safetensors`` ``load_file`` / ``load`` / ``safe_open``, ``torch.load``), the bytes read equal
the bytes of this rank's parameters (so nothing of another TP shard, pipeline stage or expert is
read), no call of megatron's init functions or of ``torch.nn.init``'s draws, every parameter equal
to the shard the state-dict path computes, and log-probs bit for bit those of the actor built from
the in-memory state dict (and, in fp32, within 1e-5 of the HF model). A chunk built without init carries
the same tensor-parallel attributes as one built with it (the local spec; the TE spec sets them in
TE's own ``reset_parameters``, which runs with or without init). A bad checkpoint fails with a
one-line ValueError naming the tensor and the file.
"""
import json
import re
from pathlib import Path

import pytest

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "sharded_load_worker.py"
UNFUSED = {"attention": "unfused", "pack_sequences": False}
WHOLE_FILE = ("safetensors.torch.load_file", "safetensors.torch.load", "safetensors.safe_open", "torch.load")


def _run(cases, nproc, tmp_path):
    return [r["cases"] for r in torchrun(WORKER, nproc, json.dumps(cases), tmp_path=tmp_path, timeout=300)]


def _layers(names):
    return {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}


def _check_load(c, where):
    whole = {k: v for k, v in c["calls"].items() if k in WHOLE_FILE}
    assert not whole, f"{where}: whole checkpoint files read: {whole}"
    init = {k: v for k, v in c["calls"].items() if k not in WHOLE_FILE}
    assert not init, f"{where}: random init ran although weights were given: {init}"
    assert c["read_total"] == c["param_bytes"], (
        f"{where}: read {c['read_total']} bytes for {c['param_bytes']} bytes of parameters")
    assert not c["mismatched"], f"{where}: parameters differ from the state-dict load: {c['mismatched']}"
    assert c["logprob_bitwise_equal"], f"{where}: log-probs differ from the state-dict-built actor"
    if c["case"].get("actor", {}).get("precision", "fp32") == "fp32":  # (bf16: test_actor_bf16.py)
        assert c["logprob_abs_err"] <= 1e-5, f"{where}: log-probs {c['logprob_abs_err']} from HF"


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tp2_rank_reads_only_its_slices_and_draws_no_init(tmp_path):
    per_rank = _run([
        {"family": "qwen3", "tie": False, "tp": 2, "pp": 1},
        {"family": "qwen2", "tie": True, "tp": 2, "pp": 1, "actor": UNFUSED, "ckpt_dtype": "bfloat16"},
        {"family": "llama", "tie": False, "tp": 2, "pp": 1, "actor": {"precision": "bf16"}},
    ], 2, tmp_path)
    for k in range(3):
        for rank, cases in enumerate(per_rank):
            c = cases[k]
            _check_load(c, f"rank {rank}, case {c['case']}")
            # at TP=2 a rank holds half of every matrix: well under the whole checkpoint
            assert c["read_total"] < 0.6 * c["ckpt_bytes"], (rank, c["case"])
        # the two ranks read different halves of a TP-split tensor, the same replicated norm
        a, b = per_rank[0][k]["read"], per_rank[1][k]["read"]
        assert set(a) == set(b)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_pp2_and_ep2_ranks_read_only_their_stage_and_experts(tmp_path):
    per_rank = _run([
        {"family": "qwen3", "tie": True, "tp": 1, "pp": 2},
        {"family": "qwen3_moe", "tie": False, "tp": 1, "pp": 1, "ep": 2},
    ], 2, tmp_path)
    for k in range(2):
        for rank, cases in enumerate(per_rank):
            _check_load(cases[k], f"rank {rank}, case {cases[k]['case']}")
    # pipeline: each stage reads its own layers only
    l0, l1 = (_layers(r[0]["read"]) for r in per_rank)
    assert l0 and l1 and not l0 & l1 and l0 | l1 == set(range(4)), (l0, l1)
    # experts: each EP rank reads its own experts only
    e0, e1 = ({n for n in r[1]["read"] if ".mlp.experts." in n} for r in per_rank)
    assert e0 and e1 and not e0 & e1


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_build_without_init_keeps_megatron_tp_attributes(tmp_path):
    per_rank = _run([
        {"attrs": True, "family": "qwen3", "tie": False, "tp": 2, "pp": 1},
        {"attrs": True, "family": "qwen2", "tie": True, "tp": 2, "pp": 1},
        {"attrs": True, "family": "qwen3_moe", "tie": False, "tp": 1, "pp": 1, "ep": 2},
    ], 2, tmp_path)
    for rank, cases in enumerate(per_rank):
        for c in cases:
            assert not c["attr_diff"], f"rank {rank}, case {c['case']}: {c['attr_diff']}"
            if c["case"]["tp"] > 1:
                assert any(n.endswith("linear_fc1.weight") for n in c["tp_split"]), c["tp_split"]
                assert "embedding.word_embeddings.weight" in c["tp_split"]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_bad_checkpoint_fails_with_one_line_naming_tensor_and_file(tmp_path):
    missing = "model.layers.1.self_attn.k_proj.weight"
    wrong = "model.layers.0.mlp.up_proj.weight"
    per_rank = _run([
        {"error": True, "family": "qwen3", "tie": False, "tp": 2, "pp": 1, "drop": missing},
        {"error": True, "family": "qwen3", "tie": False, "tp": 2, "pp": 1, "reshape": wrong},
    ], 2, tmp_path)
    for cases in per_rank:
        drop, shape = cases[0]["error"], cases[1]["error"]
        assert drop and missing in drop and "mtepo_sharded_" in drop and "\n" not in drop, drop
        assert shape and wrong in shape and ".safetensors" in shape and "\n" not in shape, shape


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shard_reads_equal_shard_tensor_for_every_split(tmp_path, dtype):
    """One process, no megatron: the reads planned for a shard (dim 0 or 1, stride 1 or 2, the
    rows of a fused tensor coming from two HF tensors) give exactly ``shard_tensor`` of the full
    tensor, straight into an fp32/bf16 destination, a strided one, or through small buffers."""
    import torch
    from safetensors.torch import save_file

    from megatron_tepo.checkpoint.hf_io import LazyHFCheckpoint
    from megatron_tepo.megatron.sharding import _read_into, _shard_reads, shard_tensor

    g = torch.Generator().manual_seed(0)
    st = getattr(torch, dtype)
    a, b = torch.randn(8, 12, generator=g).to(st), torch.randn(16, 12, generator=g).to(st)
    save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    ckpt = LazyHFCheckpoint(tmp_path)
    # the full tensor interleaves a and b in blocks of 4 rows: a[0:4], b[0:8], a[4:8], b[8:16]
    full = torch.cat([a[0:4], b[0:8], a[4:8], b[8:16]])
    sources = [("a", ((0, 4), (12, 16))), ("b", ((4, 12), (16, 24)))]
    for dim in (0, 1):
        for stride in (1, 2):
            for size in (1, 2):
                for rank in range(size):
                    want = shard_tensor(full, dim, stride, rank, size) if size > 1 else full
                    for out_dtype in (st, torch.float32):
                        for block in (1 << 20, 40):  # 40 bytes: buffers of one row at a time
                            got = torch.full_like(want, float("nan"), dtype=out_dtype)
                            for hf, rows, local, cols in _shard_reads(list(full.shape), (dim, stride), rank,
                                                                       size, sources):
                                _read_into(ckpt, hf, rows, got[local:local + rows[1] - rows[0]], cols, block)
                            assert torch.equal(got, want.to(out_dtype)), (dim, stride, size, rank, out_dtype, block)
    ckpt.close()
