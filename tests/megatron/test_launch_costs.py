"""What the actor's step costs a GPU that waits for the CPU, counted on CPU (issue #31, point 7):
aten ops dispatched (each at least one kernel launch on a GPU), host syncs, dynamo compiles.

* The ops of a log-prob pass, of a forward-backward and of an optimizer step do not grow with the
  number of packed sequences: the same 512 tokens as 2 x 256 and 16 x 32 (core attention left
  out: on CPU it is one SDPA call per sequence by necessity). megatron-core 0.19's local THD RoPE
  looped over the sequences (551 -> 1587 ops for the log-prob pass), and the micro-batch was built
  row by row.
* An optimizer step makes the same number of host syncs at 2 and at 4 layers (megatron's no-apex
  grad norm read one value per parameter, torch's per-parameter AdamW one step count each).
* With ``fusions: on``, no packed length after the first compiles anything new, in either pass, with
  or without recompute (megatron's compiled functions recompiled per length and per
  ``requires_grad`` until dynamo's recompile limit).
"""
import json
from pathlib import Path

import pytest

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "launch_cost_worker.py"


def _run(cases, tmp_path):
    return torchrun(WORKER, 1, json.dumps(cases), tmp_path=tmp_path, timeout=600)[0]["cases"]


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    growth, syncs = _run([{"kind": "growth"}, {"kind": "optimizer_syncs"}], tmp_path_factory.mktemp("costs"))
    return {"growth": growth, "syncs": syncs}


@pytest.mark.parametrize("phase", ["log_probs", "forward_backward", "optimizer_step"])
def test_ops_do_not_grow_with_the_number_of_packed_sequences(counts, phase):
    long, short = counts["growth"]["2x256"][phase], counts["growth"]["16x32"][phase]
    assert long["ops"] > 0
    assert short["ops"] == long["ops"], (phase, long, short)
    assert short["syncs"] == long["syncs"], (phase, long["sync_sites"], short["sync_sites"])


def test_an_optimizer_step_syncs_as_often_at_2_and_at_4_layers(counts):
    two, four = counts["syncs"]["2"], counts["syncs"]["4"]
    assert four["syncs"] == two["syncs"], (two["sync_sites"], four["sync_sites"])
    assert two["syncs"] <= 2, two["sync_sites"]  # the grad norm's one read (and no more than one other)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fusions_compile_once_for_every_packed_length(tmp_path, recompute):
    (case,) = _run([{"kind": "compiles", "recompute": recompute}], tmp_path)
    graphs = case["graphs"]  # after each pass: length 1 log-probs, train, length 2 log-probs, train, ...
    assert graphs[1] > 0
    assert graphs[-1] == graphs[1], graphs  # nothing new after the first length's two passes
    assert case["fusions"] == [True, False]  # SwiGLU fused; bias-dropout-add has no bias or dropout to fuse


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fast_paths_step_equals_megatrons_own_within_rounding(tmp_path, precision):
    """One clipped step (clip 0.05: the scaling path runs) with the fast paths against
    ``MTEPO_FAST_PATHS=0`` (megatron-core's own RoPE loop, grad norm, clipping, copies, unfused AdamW)."""
    import math

    case = [{"kind": "step", "precision": precision}]
    fast = torchrun(WORKER, 1, json.dumps(case), tmp_path=tmp_path / "fast", timeout=600)[0]["cases"][0]
    own = torchrun(WORKER, 1, json.dumps(case), tmp_path=tmp_path / "own", timeout=600,
                   env={"MTEPO_FAST_PATHS": "0"})[0]["cases"][0]
    assert set(fast["fast_paths"]) >= {"rope_thd", "grad_norm", "grad_scale", "param_copy"} and own["fast_paths"] == []
    assert all(fast["fused_adam"]) and not any(own["fused_adam"])
    assert fast["loss"] == own["loss"]  # the forward is the same arithmetic (RoPE bit for bit)
    assert math.isclose(fast["grad_norm"], own["grad_norm"], rel_tol=1e-6)
    assert fast["grad_norm"] > 0.05  # clipped
    # fp32: rounding of the norm and of Adam's arithmetic; bf16: the model's copy of a main
    # parameter can round to the neighbouring bf16 value
    tol = 1e-6 if precision == "fp32" else 2 ** -7
    for name, a in fast["params"].items():
        b = own["params"][name]
        scale = max(max(abs(x) for x in b), 1e-30)
        assert max(abs(x - y) for x, y in zip(a, b)) <= tol * scale, name
