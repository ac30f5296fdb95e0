"""The fit check prices what the actor really allocates (see fit_worker.py): per rank, the bytes of
the parameters, of megatron DDP's gradient buffers and of the optimizer's own tensors after one
step agree with ``launch.memory.actor_memory`` within 10%, in bf16 and fp32, at TP=2 (plain optimizer,
untied embeddings) and at DP=2 (distributed optimizer, tied embeddings), and for a Qwen3.5 (Gated DeltaNet
layers, gated attention) at TP=2."""
import json
from pathlib import Path

import pytest

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "fit_worker.py"


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_fit_check_bytes_equal_the_actor_allocations(tmp_path):
    cases = [dict(family="qwen3", tie=False, tp=2, dist_opt=False, precision=p) for p in ("bf16", "fp32")]
    cases += [dict(family="qwen2", tie=True, tp=1, dist_opt=True, precision=p) for p in ("bf16", "fp32")]
    cases += [dict(family="qwen3_5", tie=False, tp=2, dist_opt=False, precision="bf16")]  # (#53: a hybrid)
    per_rank = torchrun(WORKER, 2, json.dumps(cases), tmp_path=tmp_path, timeout=380)
    for rank, result in enumerate(per_rank):
        for c in result["cases"]:
            where = (rank, c["case"])
            assert (c["tp"], c["dp"]) == ((2, 1) if c["case"]["tp"] == 2 else (1, 2)), where
            for what in ("weights", "grads", "optimizer"):
                got, priced = c["measured"][what], c["fit"][what]
                assert got > 0 and abs(got - priced) <= 0.1 * got, (where, what, got, priced)
            # the distinctions the check prices are real: bf16 holds 2-byte weights and 12 bytes of
            # optimizer per weight (fp32 main copy + Adam), fp32 4 and 8; the distributed optimizer
            # keeps 1/DP of it
            w, o = c["measured"]["weights"], c["measured"]["optimizer"]
            per_weight = (2, 12) if c["case"]["precision"] == "bf16" else (4, 8)
            share = 2 if c["case"]["dist_opt"] else 1
            assert abs(o / w - per_weight[1] / per_weight[0] / share) <= 0.1 * per_weight[1] / per_weight[0] / share


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_fit_check_prices_a_lora_actor_as_it_allocates(tmp_path):
    """With ``actor.lora`` (rank 4 on every target linear) the fit check's adapter count equals the
    built actor's trainable parameters exactly, per rank, at TP 2 (A of a column-parallel linear and
    B of a row-parallel one whole on each rank, the others split) and at DP 2 with the distributed
    optimizer; its weight, gradient and optimizer bytes are the actor's within 10% (the buffers'
    padding), and the gradients and optimizer are the adapters' alone: far below a full actor's."""
    cases = [dict(family="qwen3", tie=False, tp=2, dist_opt=False, precision="bf16", lora=4),
             dict(family="qwen3", tie=False, tp=1, dist_opt=True, precision="bf16", lora=4)]
    per_rank = torchrun(WORKER, 2, json.dumps(cases), tmp_path=tmp_path, timeout=380)
    for rank, result in enumerate(per_rank):
        for c in result["cases"]:
            where = (rank, c["case"])
            m, fit = c["measured"], c["fit"]
            assert m["trained"] > 0 and m["trained"] == fit["lora_params"], where
            for what in ("weights", "grads", "optimizer"):
                assert abs(m[what] - fit[what]) <= 0.1 * m[what], (where, what, m[what], fit[what])
            # bf16: 4 B of fp32 gradient and 12 B (main copy + Adam) of optimizer per adapter, over DP
            assert fit["grads"] == 4 * m["trained"]
            assert fit["optimizer"] == 12 * m["trained"] / (2 if c["case"]["dist_opt"] else 1)
            assert m["optimizer"] < 0.5 * m["weights"], where  # (a full actor's: 6x its weights)
