"""The bucketed HF export (one collective per bucket, gathered straight into flat buffers) against
the HF model, bit for bit, under torchrun (gloo): TP=2 dense families (fused QKV with and without
bias, gate-up, row-parallel shards, tied and untied embeddings); Qwen3-MoE at EP=2, where each
rank holds 2 of the 4 experts and the export must still hold every expert under its global index
(model.layers.L.mlp.experts.E.*); PP=2 and TP=2 x PP=2, where the stream gathered to rank 0 must
hold every stage. At TP=2 the gathered stream is checked both ways: TP ranks casting their shards
straight into shared-memory buckets, and the point-to-point gather (MTEPO_EXPORT_SHM=0). A bf16
actor (TP=2) exports its bf16 parameters bit for bit. See workers/export_worker.py."""
import json
from pathlib import Path

import pytest

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "export_worker.py"
CLEAN = {"missing": [], "extra": [], "differ": []}


def _check(per_rank):
    for rank in range(len(per_rank)):
        for c in per_rank[rank]["cases"]:
            assert c["ref_vs_hf"]["differ"] == [] and c["ref_vs_hf"]["extra"] == [], (rank, c["case"])
            for name, d in c["checks"].items():
                assert d == CLEAN, (rank, c["case"], name, d)
            assert c.get("dst0_nonroot_yielded", 0) == 0, (rank, c["case"])
            if rank == 0:  # only the destination yields buckets
                assert c["buckets"][str(1 << 10)] > c["buckets"][str(64 << 20)] >= 1
                # every bucket released once, the last at the end of the export
                assert all(n_rel == n and n >= 1 for n_rel, n in c["released"].values()), c["released"]
            else:
                assert set(c["buckets"].values()) == {0}
            # TP ranks on one host fill shared-memory buckets (two, alternating, kept across the
            # exports), unless MTEPO_EXPORT_SHM=0; without TP there is nothing to share
            tp = c["case"]["tp"]
            assert c["shared_buffers"] == {"1": 2 if tp > 1 else 0, "0": 0}, (rank, c["case"])


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_export_buckets_tp2_bit_exact(tmp_path):
    per_rank = [r for r in torchrun(WORKER, 2, json.dumps([
        {"family": "qwen3", "tie": False, "tp": 2},
        {"family": "qwen2", "tie": True, "tp": 2},
        {"family": "qwen3", "tie": True, "tp": 2, "precision": "bf16"},
    ]), tmp_path=tmp_path, timeout=380)]
    _check(per_rank)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_export_qwen3_moe_ep2_every_expert_bit_exact(tmp_path):
    """EP=2: rank 0's stream (what the weight-sync sender pushes) holds all 4 experts of every layer."""
    per_rank = torchrun(WORKER, 2, json.dumps([{"family": "qwen3_moe", "tie": False, "tp": 1, "ep": 2}]),
                        tmp_path=tmp_path, timeout=380)
    _check(per_rank)
    # the per-tensor reference (gather_full_tensors) only has each rank's own experts: the bucketed
    # export is what brings the other rank's
    ref = [set(per_rank[rank]["cases"][0]["ref_experts"]) for rank in (0, 1)]
    every = set(per_rank[0]["cases"][0]["hf_experts"])
    assert len(every) == 4 * 4 * 3  # 4 layers x 4 experts x gate/up/down, all checked above
    assert ref[0] and ref[1] and not ref[0] & ref[1] and ref[0] | ref[1] == every


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_export_buckets_pp2_reach_rank0_bit_exact(tmp_path):
    """PP=2 (tied embeddings: the last stage's output-layer copy is not exported): rank 0's
    gathered stream holds both stages, received from stage 1 bucket by bucket."""
    per_rank = torchrun(WORKER, 2, json.dumps([{"family": "qwen3", "tie": True, "tp": 1, "pp": 2}]),
                        tmp_path=tmp_path, timeout=380)
    _check(per_rank)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_export_buckets_tp2_pp2_reach_rank0_bit_exact(tmp_path):
    per_rank = torchrun(WORKER, 4, json.dumps([{"family": "llama", "tie": False, "tp": 2, "pp": 2}]),
                        tmp_path=tmp_path, timeout=580)
    _check(per_rank)


def test_the_bucket_plan_never_mixes_kinds_and_counts_every_ep_rank_s_experts():
    """The export's planning steps are functions of their own (actor/export.py: _stage_items,
    _participation, _plan_buckets, _buffer_caps); the plan is the same on every rank: buckets up to
    the byte budget in parameter order, a new one at each change of kind, an expert counted once
    per EP rank."""
    import torch

    from megatron_tepo.actor.export import _buffer_caps, _Item, _plan_buckets

    def item(n, expert, size=1):
        return _Item(f"p{n}", 0, torch.zeros(4 // size), torch.float32, (0, 1) if size > 1 else None, None, size,
                     (4,), [(f"p{n}", None)], expert)

    items = [item(0, False, 2), item(1, False), item(2, True), item(3, True), item(4, False)]  # 16 bytes each
    plan = _plan_buckets(items, bucket_bytes=32, ep=1)
    assert [[it.lname for it in b] for b in plan] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    plan = _plan_buckets(items, bucket_bytes=32, ep=2)  # an expert item is 32 bytes with EP 2
    assert [[it.lname for it in b] for b in plan] == [["p0", "p1"], ["p2"], ["p3"], ["p4"]]
    caps = _buffer_caps(plan, [False] * len(plan), False, {False: True, True: True}, ep=2)
    assert caps == {"send": 8, "recv": 16, "out": 32, "local_out": 16}
    assert _buffer_caps(plan, [True, False, False, True], True, {False: True, True: False}, ep=2) == {"shared": 32}
