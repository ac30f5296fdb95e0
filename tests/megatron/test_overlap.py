"""``actor.overlap_grad_reduce`` / ``actor.overlap_param_gather`` on CPU (gloo, DP=2): on and off
give the same gradients (1e-6 of each tensor's largest entry), grad norm, parameters after a step
and the loss of the next forward/backward, with the plain and the distributed optimizer; the
settings really reach megatron's DDP config."""
from pathlib import Path

import pytest
import torch

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "overlap_worker.py"
TOL = 1e-6


def _rel(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_overlap_on_and_off_match_over_gloo(tmp_path):
    results = torchrun(WORKER, 2, tmp_path=tmp_path, timeout=360)
    for rank, res in enumerate(results):
        for opt in ("plain", "distopt"):
            off, on = res[f"{opt}_off"], res[f"{opt}_on"]
            where = (rank, opt)
            assert off["ddp"] == [False, False], where
            assert on["ddp"] == [True, opt == "distopt"], where  # param gather: distributed optimizer only
            assert on["mbs"] == off["mbs"] >= 2, where  # several micro-batches: no_sync really used
            assert abs(on["loss"] - off["loss"]) <= TOL * abs(off["loss"]), where
            assert set(on["grads"]) == set(off["grads"]), where
            assert opt == "distopt" or len(off["grads"]) > 5, where
            bad = {n: _rel(on["grads"][n], off["grads"][n]) for n in off["grads"]
                   if _rel(on["grads"][n], off["grads"][n]) > TOL}
            assert not bad, (where, bad)
            assert abs(on["grad_norm"] - off["grad_norm"]) <= TOL * off["grad_norm"], where
            bad = {n: _rel(on["params"][n], off["params"][n]) for n in off["params"]
                   if _rel(on["params"][n], off["params"][n]) > TOL}
            assert not bad, (where, bad)
            assert abs(on["loss2"] - off["loss2"]) <= TOL * abs(off["loss2"]), where
            assert abs(on["loss2"] - on["loss"]) > 1e-7, where  # the step changed the weights
