"""The actor's offload and onload (colocated mode, issue #34): its optimizer states, gradients and
parameters go to host memory, their memory is freed, and they come back bit-identical (fp32 and
bf16 at TP=2, and with the distributed optimizer at DP=2); the host copies are made once and
reused; the actor trains on exactly as if it had never offloaded."""
import json
from pathlib import Path

import pytest

from tests.dist_utils import torchrun
from tests.megatron.helpers import STATE_CASES

WORKER = Path(__file__).parent / "workers" / "offload_worker.py"


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_offload_then_onload_is_bit_identical_and_frees_the_memory(tmp_path):
    cases = STATE_CASES
    per_rank = [r["cases"] for r in torchrun(WORKER, 2, json.dumps(cases), tmp_path=tmp_path, timeout=480)]
    for rank, results in enumerate(per_rank):
        for spec, r in zip(cases, results):
            where = (rank, spec)
            assert all(r["sizes"][part] > 0 for part in ("optimizer", "grads", "params")), (where, r["sizes"])
            assert r["nonzero_grads"], where
            first, second = r["rounds"]
            for rnd in (first, second):
                assert rnd["freed"] and rnd["equal"], (where, rnd)
                assert rnd["offloaded"] == ["optimizer", "grads", "params"] and rnd["back"] == [], (where, rnd)
                assert rnd["out"] == rnd["in"] > 0, (where, rnd)
            assert first["host_ids"] == second["host_ids"], where  # pinned host copies made once
            assert r["optimizer_only"] == {"optimizer_freed": True, "params_kept": True}, where
            assert "unknown part(s) ['activations']" in r["unknown_part"], where
            assert r["same_as_never_offloaded"], where
