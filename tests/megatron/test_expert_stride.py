"""Qwen3-MoE under Transformer Engine's expert attributes loads and exports right (issue #32 row 2).

megatron-core resets ``partition_stride`` to 1 on every expert weight of TE's layers, while each
rank still holds its expert ``linear_fc1`` as ``[gate_r; up_r]``; the loader and the export split
by that attribute, so at expert TP 2 rank 0 got every gate row and rank 1 every up row (the actor
computed nonsense) and the export put them back (SGLang got the right weights, and disagreed with
the actor completely). The split now comes from the family's mapping: a ``gate_up`` tensor is
split with stride 2 whatever its attribute. TE cannot be installed on a CPU torch, so the experts
of a local-spec actor get the attributes TE gives them (tests/megatron/workers/expert_stride_worker.py).
"""
from pathlib import Path

import pytest

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "expert_stride_worker.py"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_gated_expert_fc1_is_split_by_what_it_is(tmp_path):
    for r in torchrun(WORKER, 2, tmp_path=tmp_path, timeout=280):
        assert r["marked"] > 0  # the stand-in for TE's attributes reached some expert weights
        assert r["state_dict_shards"] and r["checkpoint_shards"], r  # [gate_r; up_r] on every rank
        assert r["export_equal"], r
