"""MoE routing replay (``actor.routing_replay``, issue 41) on a tiny Qwen3-MoE (8 experts, top-2,
3 layers) under torchrun (gloo, 2 ranks); the worker is workers/routing_replay_worker.py.

Every router call of the actor (forward, and the recompute of ``recompute: full``) is recorded by a
forward hook on megatron's router and compared, position by position, with the experts that had
to be used, which the worker places in megatron's token order by its own arithmetic. ``r3`` with
random experts (not the routing the model would choose): the log-probs, the loss and every gradient
equal the Hugging Face model with its routers' top-k forced to the same experts, and forcing moves
the log-probs (so the comparison could fail). ``r2``: the routers are perturbed between the
recording pass and the training pass, which must still use the recorded experts.

Layouts: EP=2, DP=2, CP=2 (each rank routes its own chunks; r2 gathers them back to the rows), and
TP=2 with sequence parallelism (megatron's MoE layer needs it at TP > 1;
on CPU the local spec's torch norms run it, megatron/spec.py): each TP rank's routers see its share
of the tokens. Left out: PP > 1 (MoE with PP does not run on CPU).
"""
import json
from pathlib import Path

import pytest

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "routing_replay_worker.py"
LOG_PROB_TOL = 1e-5
GRAD_REL_TOL = 1e-5


def _run(cases, tmp_path):
    results = torchrun(WORKER, 2, json.dumps(cases), tmp_path=tmp_path, timeout=300)
    return [r["cases"] for r in results]


def _gates_pass(metrics, mismatch_above):
    assert metrics["routing_coverage"] == 1.0, metrics
    assert metrics["routing_mismatch_mean"] > mismatch_above, metrics  # the forced experts differ
    assert metrics["routing_mismatch_max"] >= metrics["routing_mismatch_mean"], metrics


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_r3_routes_every_token_to_the_given_experts_and_matches_forced_hf(tmp_path):
    per_rank = _run([
        {"mode": "r3", "tp": 1, "ep": 2, "pack": False, "recompute": "full", "gates": True},  # EP=2, padded
        {"mode": "r3", "tp": 1, "ep": 1, "pack": True, "recompute": "full"},  # DP=2, packed
        {"mode": "r3", "tp": 1, "ep": 2, "pack": True, "recompute": "none"},  # EP=2, packed
        {"mode": "r3", "tp": 2, "ep": 1, "pack": True, "recompute": "full"},  # TP=2 (sequence parallel), packed
        {"mode": "r3", "tp": 2, "ep": 1, "pack": False, "recompute": "none"},  # TP=2 (sequence parallel), padded
        {"mode": "r3", "tp": 1, "ep": 1, "cp": 2, "pack": True, "recompute": "full"},  # CP=2: each rank its chunks
    ], tmp_path)
    for rank, cases in enumerate(per_rank):
        for c in cases:
            where = (rank, c["case"])
            # every router call used exactly the given experts, the recompute's included
            assert c["logprob_checked"] > 50 and c["logprob_bad"] == 0, where
            assert c["train_checked"] > 50 and c["train_bad"] == 0, where
            # full recompute: each layer's router ran twice per micro-batch (forward, recompute)
            calls = 2 if c["case"]["recompute"] == "full" else 1
            assert c["train_calls_per_layer"] == [calls * c["train_mbs"]] * 3, where
            # the actor equals HF with its top-k forced to the same experts; forcing matters
            assert c["forcing_moves_logprobs"] > 1e-2, where
            assert c["logprob_abs_err"] <= LOG_PROB_TOL, where
            assert c["loss_rel_err"] <= 1e-6, where
            bad = {n: e for n, e in c["grad_rel_err"].items() if e > GRAD_REL_TOL}
            assert not bad, (where, bad)
            # the router keeps its gradient under replay
            assert len(c["router_grad_norm"]) == 3 and min(c["router_grad_norm"].values()) > 0, where
            _gates_pass(c["logprob_metrics"], 0.5)
            _gates_pass(c["train_metrics"], 0.5)
            if c["case"].get("gates"):  # the gates can fail: a hole in the routing, a router that does not replay
                assert c["gates"]["missing"].startswith("routed_experts: row 0 has no routing at position 0"), c
                assert c["gates"]["coverage"].startswith("actor.routing_replay: the routers replayed 0.6667 of the "
                                                         "token x layers that had to be (MoE layers [1]"), c
                assert c["gates"]["after"] == 1.0, c


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_r2_training_pass_replays_the_routing_recorded_in_the_log_prob_pass(tmp_path):
    per_rank = _run([
        {"mode": "r2", "tp": 1, "ep": 2, "pack": True, "recompute": "full"},
        {"mode": "r2", "tp": 1, "ep": 1, "pack": False, "recompute": "none"},
        {"mode": "r2", "tp": 2, "ep": 1, "pack": True, "recompute": "full"},  # TP=2 (sequence parallel)
        {"mode": "r2", "tp": 1, "ep": 1, "cp": 2, "pack": True, "recompute": "none"},  # CP=2: recorded per rank
    ], tmp_path)
    for rank, cases in enumerate(per_rank):
        for c in cases:
            where = (rank, c["case"])
            assert c["recorded_dtype"] == "torch.int8", where  # 8 experts: one byte an expert id
            # the recording is what the routers chose, mapped back to the batch's rows
            assert c["record_checked"] > 50 and c["record_bad"] == 0, where
            assert c["logprob_metrics"] == {}, where  # a recording pass replays nothing
            assert c["logprob_abs_err"] <= LOG_PROB_TOL, where
            # perturbed routers would route elsewhere; the training pass still uses the recording
            assert c["train_checked"] > 50 and c["train_bad"] == 0, where
            calls = 2 if c["case"]["recompute"] == "full" else 1
            assert c["train_calls_per_layer"] == [calls * c["train_mbs"]] * 3, where
            _gates_pass(c["train_metrics"], 0.1)
            assert len(c["router_grad_norm"]) == 3 and min(c["router_grad_norm"].values()) > 0, where


def _replay_and_batch():
    """A replay of 2 MoE layers (top-2 of 4 experts) with no routers, and a batch of 3 rows whose
    routing is known (ids from the position, -1 after each row's tokens)."""
    import torch

    from megatron_tepo.batch import RolloutBatch
    from megatron_tepo.megatron.routing_replay import RoutingReplay
    from megatron_tepo.routing import RoutingShape

    replay = RoutingReplay([(0, None), (1, None)], RoutingShape(2, (0, 1), 2, 4), torch.zeros(2, 3))
    prompt_lens = torch.tensor([2, 3, 1])
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    seq = prompt_lens + response_mask.sum(1)
    width = int(seq.max())
    pos = torch.arange(width)[None, :, None, None].expand(3, width, 2, 2)
    routed = torch.where(pos < seq[:, None, None, None], pos % 4, -1).to(torch.int8)
    return replay, RolloutBatch(input_ids=torch.ones(3, width, dtype=torch.long), prompt_lens=prompt_lens,
                                response_mask=response_mask, routed_experts=routed)


def test_the_replay_checks_a_batch_s_routing_naming_the_field():
    """The routing checks live with routing replay (megatron/routing_replay.py), not in the actor."""
    import torch

    replay, batch = _replay_and_batch()
    replay.check_input(batch.routed_experts, batch.seq_lens(), "r3")  # every scored position has routing
    with pytest.raises(ValueError, match=r"routed_experts: the batch has none, and actor.routing_replay r3"):
        replay.check_input(None, batch.seq_lens(), "r3")
    with pytest.raises(ValueError, match=r"routed_experts: must be \[B, L, 2, 2\]"):
        replay.check_input(batch.routed_experts[:, :, :1], batch.seq_lens(), "r3")
    with pytest.raises(ValueError, match=r"routed_experts: expert id 4 >= the model's 4 experts"):
        replay.check_input(torch.where(batch.routed_experts == 3, 4, batch.routed_experts).to(torch.int8),
                           batch.seq_lens(), "r2")
    holed = batch.routed_experts.clone()
    holed[1, 2] = -1
    with pytest.raises(ValueError, match=r"routed_experts: row 1 has no routing at position 2"):
        replay.check_input(holed, batch.seq_lens(), "r3")


@pytest.mark.parametrize("packed", [False, True])
def test_a_recording_is_laid_back_into_the_batch_s_rows(packed):
    """One rank (no SP, no CP): what the routers recorded, in megatron's token order, comes back as
    the batch's ``[B, L, moe_layers, topk]`` at every position the micro-batches hold."""
    import torch

    from megatron_tepo.token_layout import build_micro_batch

    replay, batch = _replay_and_batch()
    mbs = [build_micro_batch(batch, rows, packed=packed) for rows in ([2, 0], [1])]
    replay.recorded = [mb.side.routed_experts for mb in mbs]  # the routers chose the given experts
    out = replay.gathered_recording(mbs, batch.batch_size, batch.input_ids.shape[1])
    assert out.dtype == torch.int8 and torch.equal(out, batch.routed_experts)
