"""The Megatron actor under torchrun (gloo) against a single-process Hugging Face reference.

Each test runs one torchrun with one or more cases (see workers/equivalence_worker.py) and checks,
per case and rank: per-token log-probs and entropy (abs 1e-5), the mini-batch loss (rel 1e-6),
every parameter's gradient mapped back to its HF name (rel 1e-5 of the tensor's max), the grad
norm, the parameters after one clipped AdamW step (abs 1e-5), the loss metrics, and for tied
embeddings with PP the last stage's copy of the embedding. Together the ranks must cover every HF
parameter. DP=2 also checks that 1 and 4 micro-batches give the same gradient.

The actor runs in fp32 with the sdpa core attention and packed sequences (its GPU path) unless a
case says otherwise; one case per layout keeps megatron's unfused attention on padded rows. Cases
with ``pack_check`` compare packed and padded micro-batches of the same actor (log-probs,
entropy: abs 1e-6; loss: rel 1e-6; gradients: 1e-6 relative L2 error over all of the stage's
gradients -- fp32 summation order alone moves single small tensors by ~1e-6 of their max; both
micro-batched by their own plan, so the dense
cases also show that the grouping into micro-batches does not matter), cases with ``recompute_check`` full recompute
against none (gradients rel 1e-6).
"""
import json
from pathlib import Path

import pytest

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "equivalence_worker.py"

LOG_PROB_TOL = 1e-5
LOSS_REL_TOL = 1e-6
GRAD_REL_TOL = 1e-5
PARAM_ABS_TOL = 1e-5
PACK_TOL = 1e-6  # packed vs padded, recompute vs not: the same arithmetic in another order
UNFUSED = {"attention": "unfused", "pack_sequences": False}


def _run(cases, nproc, tmp_path):
    results = torchrun(WORKER, nproc, json.dumps(cases), tmp_path=tmp_path, timeout=300)
    return [r["cases"] for r in results]


def _check(per_rank):
    n_cases = len(per_rank[0])
    for k in range(n_cases):
        covered = set()
        for rank, cases in enumerate(per_rank):
            c = cases[k]
            where = f"rank {rank}, case {c['case']}"
            assert c["logprob_abs_err"] <= LOG_PROB_TOL, where
            assert c["entropy_abs_err"] <= LOG_PROB_TOL, where
            assert c["loss_rel_err"] <= LOSS_REL_TOL, where
            assert max(c["metric_errs"].values()) <= 1e-5, (where, c["metric_errs"])
            assert abs(c["grad_norm"] - c["ref_grad_norm"]) <= 1e-5 * c["ref_grad_norm"], where
            if not c["case"].get("dist_opt"):
                # (the distributed optimizer reduce-scatters: main_grad is only complete for the
                # rank's own shard, so full gradients are compared in the other layouts)
                bad = {n: e for n, e in c["grad_rel_err"].items() if e > GRAD_REL_TOL}
                assert not bad, (where, bad)
            bad = {n: e for n, e in c["param_abs_err"].items() if e > PARAM_ABS_TOL}
            assert not bad, (where, bad)
            assert c["min_param_update"] > 1e-4, where  # the step really moved every tensor
            if "tied_copy_grad_rel_err" in c:
                assert c["tied_copy_grad_rel_err"] <= GRAD_REL_TOL, where
                assert c["tied_copy_param_abs_err"] <= PARAM_ABS_TOL, where
            if c["case"].get("mb_invariance"):
                assert c["mb_counts"] == [1, 4], where
                assert c["mb_invariance_rel_err"] <= GRAD_REL_TOL, where
            if c["case"].get("pack_check"):
                pc = c["pack_check"]
                assert pc["lp"] <= PACK_TOL and pc["ent"] <= PACK_TOL, (where, pc)
                assert pc["loss_rel"] <= PACK_TOL and pc["grad_rel"] <= PACK_TOL, (where, pc)
            if c["case"].get("recompute_check"):
                assert c["recompute_grad_rel_err"] <= PACK_TOL, (where, c["recompute_grad_rel_err"])
                assert c["recompute_loss_rel_err"] <= PACK_TOL, where
            if c["case"].get("cp_check"):
                cc = c["cp_check"]
                assert cc["lp"] <= PACK_TOL and cc["ent"] <= PACK_TOL, (where, cc)
                assert cc["loss_rel"] <= PACK_TOL and cc["grad_rel"] <= PACK_TOL, (where, cc)
                assert cc["grad_names"], where
            covered |= set(c["grad_names"])
        assert covered == set(per_rank[0][k]["hf_names"]), per_rank[0][k]["case"]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tp2_matches_hf(tmp_path):
    per_rank = _run([
        {"family": "qwen3", "tie": False, "tp": 2, "pp": 1, "loss": {"name": "grpo"}, "pack_check": True,
         "recompute_check": True},
        {"family": "qwen2", "tie": True, "tp": 2, "pp": 1, "loss": {"name": "gspo"}, "actor": UNFUSED},
        # sequence parallelism on the local spec (its torch norms, Qwen3's QK-norms included, marked
        # for it: megatron/spec.py), packed and padded
        {"family": "qwen3", "tie": True, "tp": 2, "pp": 1, "loss": {"name": "grpo"}, "pack_check": True,
         "actor": {"precision": "fp32", "attention": "sdpa", "pack_sequences": True, "sequence_parallel": True}},
    ], 2, tmp_path)
    _check(per_rank)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_pp2_matches_hf(tmp_path):
    per_rank = _run([
        {"family": "qwen3", "tie": True, "tp": 1, "pp": 2, "loss": {"name": "grpo"}, "pack_check": True,
         "recompute_check": True},
        {"family": "llama", "tie": False, "tp": 1, "pp": 2, "actor": UNFUSED,
         "loss": {"name": "grpo", "agg": "seq-mean-token-sum", "kl_coef": 0.1, "kl_mask": "all"}},
    ], 2, tmp_path)
    _check(per_rank)
    assert sorted(r[0]["pp_rank"] for r in per_rank) == [0, 1]
    assert any("tied_copy_grad_rel_err" in r[0] for r in per_rank)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tp2_pp2_matches_hf(tmp_path):
    per_rank = _run([
        {"family": "qwen3", "tie": True, "tp": 2, "pp": 2, "loss": {"name": "grpo"}, "pack_check": True},
    ], 4, tmp_path)
    _check(per_rank)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_dp2_matches_hf_and_micro_batch_invariance(tmp_path):
    per_rank = _run([
        {"family": "qwen3", "tie": False, "tp": 1, "pp": 1, "loss": {"name": "grpo"}, "mb_invariance": True,
         "pack_check": True},
        {"family": "qwen2", "tie": True, "tp": 1, "pp": 1, "dist_opt": True, "loss": {"name": "gspo"},
         "from_dir": True, "actor": UNFUSED},
    ], 2, tmp_path)
    _check(per_rank)
    assert all(r[0]["dp"] == 2 for r in per_rank)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_qwen3_moe_ep2_and_ep1_match_hf(tmp_path):
    """Qwen3-MoE on 2 ranks: EP=2 (each rank holds 2 of 4 experts, tokens all-gathered) and EP=1
    (DP=2), against the transformers Qwen3-MoE model."""
    per_rank = _run([
        {"family": "qwen3_moe", "tie": True, "tp": 1, "pp": 1, "ep": 2, "loss": {"name": "grpo"},
         "pack_check": True},
        {"family": "qwen3_moe", "tie": False, "tp": 1, "pp": 1, "ep": 1, "loss": {"name": "grpo"},
         "mb_invariance": True},
    ], 2, tmp_path)
    _check(per_rank)
    experts = [{n for n in r[0]["grad_names"] if ".mlp.experts." in n} for r in per_rank]
    assert experts[0] and experts[1] and not experts[0] & experts[1]  # disjoint expert shards


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_fusions_on_match_hf(tmp_path):
    """``actor.fusions: on`` (the GPU default: megatron's torch.compile-d SwiGLU, compiled once for
    any length by ``fast_paths``, here through inductor's CPU backend) gives the same results as the
    HF reference. Bias-dropout-add stays unfused: Qwen3 has neither a bias nor dropout there."""
    per_rank = _run([{"family": "qwen3", "tie": False, "tp": 1, "pp": 1, "loss": {"name": "grpo"},
                      "actor": {"fusions": "on"}}], 1, tmp_path)
    _check(per_rank)
    assert per_rank[0][0]["fusions"] == [True, False]


#: fused against materialized LM head (``actor.lm_head``): the same logits, their statistics and
#: the gradient GEMMs taken in vocabulary blocks. fp32: summation order; bf16: the hidden states'
#: gradient sums the blocks' bf16 products in fp32 (ops/lm_head.py), about one bf16 rounding.
#: (measured: fp32 1e-6; bf16 log-probs 1e-6, gradients 2-7e-3 of a tensor's largest entry, one or
#: two bf16 units where a block's GEMM rounds differently from the whole one's)
HEAD_TOL = {"fp32": {"lp": 1e-5, "loss_rel": 1e-5, "grad_rel": 1e-5, "grad_max_rel": 1e-5},
            "bf16": {"lp": 1e-5, "loss_rel": 1e-5, "grad_rel": 1e-2, "grad_max_rel": 2e-2}}


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_fused_lm_head_equals_the_materialized_one(tmp_path):
    """``actor.lm_head: fused`` (the default) against ``materialized`` on the same actor, at
    temperature 0.7, in blocks of 32 of the 256 tokens: log-probs, entropy, the loss and every
    gradient of the model (the output weight's, and through the model the hidden states'), at TP=2
    and TP=1 (x DP=2), tied and untied embeddings, packed and padded, fp32 and bf16. The HF
    comparisons above run the fused head too (with one block per shard at this vocabulary)."""
    base = {"family": "qwen3", "pp": 1, "loss": {"name": "grpo"}, "head_check": True, "head_only": True}
    cases = [
        dict(base, tp=2, tie=False),
        dict(base, tp=2, tie=True, actor={"pack_sequences": False}),
        dict(base, tp=2, tie=True, actor={"precision": "bf16"}),
        dict(base, tp=1, tie=True),
        dict(base, tp=1, tie=False, actor={"precision": "bf16", "pack_sequences": False}),
    ]
    per_rank = _run(cases, 2, tmp_path)
    for rank, results in enumerate(per_rank):
        for c in results:
            tol = HEAD_TOL[c["case"].get("actor", {}).get("precision", "fp32")]
            hc, where = c["head_check"], f"rank {rank}, case {c['case']}"
            assert hc["lp"] <= tol["lp"] and hc["ent"] <= tol["lp"], (where, hc)
            assert hc["loss_rel"] <= tol["loss_rel"], (where, hc)
            assert hc["grad_rel"] <= tol["grad_rel"] and hc["grad_max_rel"] <= tol["grad_max_rel"], (where, hc)
            assert hc["output_grad_rel"] <= tol["grad_max_rel"], (where, hc)
            assert any("output_layer" in n or "word_embeddings" in n for n in hc["names"]), where


CP = {"precision": "fp32", "attention": "sdpa", "pack_sequences": True}


@pytest.mark.distributed
@pytest.mark.second_lane
@pytest.mark.timeout(500)
def test_cp2_matches_hf_and_cp1(tmp_path):
    """Context parallelism (#44) at CP=2 on 2 ranks, packed, rows of uneven lengths (one of 1 token
    and one of 3: fewer than the 4 chunks, some chunks all padding), several micro-batches: against
    the HF reference, and against the same start at CP=1 (the ranks then data-parallel): log-probs,
    entropy, loss and every gradient within fp32 rounding; with full recompute; tied embeddings
    and GSPO's sequence means too; Qwen3-MoE at CP=2, and with its experts spread over the CP
    ranks (EP=2 x CP=2)."""
    per_rank = _run([
        {"family": "qwen3", "tie": False, "tp": 1, "pp": 1, "cp": 2, "short": True, "mb_tokens": 40,
         "loss": {"name": "grpo"}, "cp_check": True, "recompute_check": True},
        {"family": "qwen3", "tie": True, "tp": 1, "pp": 1, "cp": 2, "short": True, "loss": {"name": "gspo"},
         "cp_check": True, "actor": {"lm_head": "materialized"}},
        {"family": "qwen3_moe", "tie": False, "tp": 1, "pp": 1, "cp": 2, "short": True, "loss": {"name": "grpo"},
         "cp_check": True, "recompute_check": True},
        {"family": "qwen3_moe", "tie": True, "tp": 1, "pp": 1, "ep": 2, "cp": 2, "short": True,
         "loss": {"name": "grpo"}, "cp_check": True},
    ], 2, tmp_path)
    _check(per_rank)
    assert all(r[k]["dp"] == 1 and r[k]["cp_check"]["dp"] == 2 for r in per_rank for k in range(4))
    assert any(r[0]["num_micro_batches"] > 1 for r in per_rank)


@pytest.mark.distributed
@pytest.mark.second_lane
@pytest.mark.timeout(600)
def test_tp2_cp2_matches_hf_and_cp1(tmp_path):
    """TP=2 x CP=2 on 4 ranks (#44), with and without sequence parallelism, against the HF reference
    and against TP=2 x DP=2 from the same start."""
    per_rank = _run([
        {"family": "qwen3", "tie": False, "tp": 2, "pp": 1, "cp": 2, "short": True, "loss": {"name": "grpo"},
         "cp_check": True},
        {"family": "qwen3", "tie": True, "tp": 2, "pp": 1, "cp": 2, "short": True, "loss": {"name": "grpo"},
         "cp_check": True, "actor": dict(CP, sequence_parallel=True)},
    ], 4, tmp_path)
    _check(per_rank)
