"""Context parallelism's attention without Transformer Engine, exact against one rank's attention of
the whole sequences (CP = 2 and 3, under torchrun). The load-balanced split:
tests/megatron/test_side_inputs.py; the actor at CP=2 and TP=2 x CP=2:
tests/megatron/test_actor_distributed.py."""
from pathlib import Path

import pytest

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "cp_attention_worker.py"


@pytest.mark.distributed
@pytest.mark.parametrize("size", [2, 3])
def test_context_parallel_attention_equals_one_rank(tmp_path, size):
    """Packed sequences of 7, 1, 12, 3 and 9 tokens (two shorter than 2 x CP), grouped-query
    heads, float64: each rank's outputs and the gradients of its queries, keys and values equal
    the whole sequences' attention at its tokens; every real token is held by one rank."""
    results = torchrun(WORKER, size, tmp_path=tmp_path, timeout=180)
    assert sorted(r["rank"] for r in results) == list(range(size))
    assert sum(r["tokens"] for r in results) == 32  # every real token, once
    assert len({r["local_tokens"] for r in results}) == 1  # the same work on every rank
    for r in results:
        for key in ("out", "grad_q", "grad_k", "grad_v"):
            assert r[key] <= 1e-12 * max(r["scale"], 1.0), (r["rank"], key, r)
        assert r["pad_key_grad"] == 0.0  # a real query never sees padding
