"""A NaN in one gradient leaves every weight finite and unchanged (issue #32 row 3).

megatron fills the optimizer's main gradients only inside ``optimizer.step()``, so a guard that
asks ``get_grad_norm()`` before the step reads 0.0, and without a loss scaler (bf16, fp32) the step
writes NaN weights. The actor now checks the reduced gradients (every rank's DDP buffers, one
all-reduce) before the step: a non-finite one skips the update -- no weight, main parameter, Adam
state or LR step changes -- and the step says ``skipped_update: 1`` with a NaN grad norm. Here the
NaN sits in one element of one ``main_grad`` on rank 0 only, at TP=2: both ranks skip.
"""
import json
from pathlib import Path

import pytest

from tests.dist_utils import torchrun
from tests.megatron.helpers import STATE_CASES

WORKER = Path(__file__).parent / "workers" / "nan_grad_worker.py"


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_nan_gradient_changes_no_weight_in_fp32_and_bf16(tmp_path):
    cases = STATE_CASES
    per_rank = [r["cases"] for r in torchrun(WORKER, 2, json.dumps(cases), tmp_path=tmp_path, timeout=380)]
    for rank, results in enumerate(per_rank):
        for spec, r in zip(cases, results):
            where = (rank, spec)
            assert r["finite"] and r["unchanged"], where
            assert r["result"].get("skipped_update") == 1.0 and r["result"]["grad_norm"] is None, where
            assert r["scheduler"][0] == r["scheduler"][1], where  # no LR step for a skipped update
            assert r["next"]["skipped_update"] == 0.0 and r["next"]["changed"] and r["next"]["finite"], where
            assert r["next"]["grad_norm"] > 0, where
