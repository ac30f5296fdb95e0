"""LoRA on the Megatron actor (megatron/lora.py) under torchrun (gloo, 2 processes): one launch
covers TP 1 (two data-parallel ranks), TP 2 and TP 2 with sequence parallelism, one PP 2 and CP 2
(the tiny Qwen3), one EP 2 (the tiny Qwen3-MoE, adapters on every expert) and the tiny Qwen3.5
(adapters on the Gated DeltaNet's ``in_proj`` / ``out_proj`` too); see workers/lora_worker.py for
what each case measures. The adapters train alone (the optimizer holds them and nothing else), step 0 is the
base model, and with nonzero B the actor equals a plain actor on the merged weights
``W + s*B*A``: log-probs, entropy and loss within 1e-6, the adapters' gradients within 1e-6
(relative) of those the merged model's weight gradients give; the weight export carries the
merged weights and an embedded engine updated from it scores as the actor; a checkpoint holds
base and adapters and their Adam states: a fresh actor resumes bit for bit.
"""
import json
from pathlib import Path

import pytest

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "lora_worker.py"
TOL = 1e-6


#: the adapted linears of one stage of the tiny Qwen3 (4 layers): every target of every layer
DENSE = {"linear_qkv": 4, "linear_proj": 4, "linear_fc1": 4, "linear_fc2": 4}


def _run(tmp_path, cases):
    return [r["cases"] for r in torchrun(WORKER, 2, str(tmp_path), json.dumps(cases), tmp_path=tmp_path,
                                         timeout=500)]


def _check_exact(c, where, linears, grad_l2=2 * TOL, grad_max=1e-5):
    """The case ``c`` of one rank: its stage adapted ``linears`` (kind -> count), only the adapters
    train, B = 0 is the base, and with nonzero B it equals the merged weights."""
    assert c["linears"] == linears, (where, c["linears"])
    assert c["trainable"], where
    assert c["adapters"] == 2 * sum(linears.values()), where  # (A, B) per linear
    assert c["optimizer_params"] == c["adapters"], where
    assert c["step0_lp_err"] <= 1e-5, where  # B = 0: the HF base model (the suite's HF tolerance)
    assert c["export_names_equal"] and c["export_err"] <= TOL, (where, c["export_err"])
    # fp32: x W^T + s (x A^T) B^T against x (W + s B A)^T rounds differently: 1e-6 of the
    # log-probs' size (a few units in the last place of a log-prob near -5)
    assert c["lp_err"] <= TOL * max(1.0, c["lp_scale"]), (where, c["lp_err"], c["lp_scale"])
    assert c["ent_err"] <= TOL * max(1.0, c["lp_scale"]), (where, c["ent_err"])
    assert c["loss_err"] <= TOL * max(1.0, abs(c["loss_err"])), where
    # the same sums in another order (fp32 G, then G A^T, against the chain through h = x A^T):
    # 2e-6 relative L2 over all the adapters' gradients (seen: ~1.2e-6), 1e-5 of each
    # tensor's max (seen: ~2.3e-6); a wrong split or scale is off by O(1)
    assert c["grad_names"] == c["adapters"], where
    assert c["grad_rel_l2"] <= grad_l2 and c["grad_rel"] <= grad_max, (where, c["grad_rel_l2"], c["grad_rel"],
                                                                       c["grad_rel_worst"])
    assert c["base_changed"] == [], (where, c["base_changed"])
    assert c["adapters_moved"] > 1e-5, where


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_lora_equals_merged_weights_at_tp1_tp2_and_sequence_parallel(tmp_path):
    cases = [{"tp": 1}, {"tp": 2, "checkpoint": True}, {"tp": 2, "actor": {"sequence_parallel": True}}]
    for rank, results in enumerate(_run(tmp_path, cases)):
        for c in results:
            where = f"rank {rank}: {c}"
            _check_exact(c, where, DENSE)
            assert c["engine_lp_err"] <= 1e-5, (where, c["engine_lp_err"])
            if c["case"].get("checkpoint"):
                assert c["resume_extra"] == {"step": 1}, where
                assert c["resume_equal"] and c["resume_loss_equal"], where


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_lora_equals_merged_weights_at_pp2_and_cp2(tmp_path):
    """PP 2: each stage holds two layers' adapters (the export and the merged weights compared over
    both stages); CP 2: every rank the whole batch's half of each sequence."""
    per_rank = _run(tmp_path, [{"tp": 1, "pp": 2, "engine": False}, {"tp": 1, "cp": 2, "engine": False}])
    assert sorted(r[0]["pp_rank"] for r in per_rank) == [0, 1]
    half = {k: v // 2 for k, v in DENSE.items()}
    for rank, (pp, cp) in enumerate(per_rank):
        _check_exact(pp, f"rank {rank}: {pp}", half)
        assert cp["dp"] == 1, cp
        _check_exact(cp, f"rank {rank}: {cp}", DENSE)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_lora_equals_merged_weights_on_moe_experts_at_ep2_and_on_qwen3_5(tmp_path):
    """EP 2 on the tiny Qwen3-MoE (4 experts a layer): each rank adapts its own 2 experts' linears
    (their adapters reduced over the expert-data-parallel group, here the rank alone, while the
    attention's are averaged over both); the tiny Qwen3.5 (3 Gated DeltaNet layers, 1 attention
    layer) at TP 1: the Gated DeltaNet's in_proj and out_proj adapted as well."""
    cases = [{"tp": 1, "ep": 2, "family": "qwen3_moe", "engine": False},
             {"tp": 1, "family": "qwen3_5", "engine": False}]
    per_rank = _run(tmp_path, cases)
    for rank, (moe, hybrid) in enumerate(per_rank):
        experts = {"linear_qkv": 4, "linear_proj": 4, "expert.linear_fc1": 4 * 2, "expert.linear_fc2": 4 * 2}
        _check_exact(moe, f"rank {rank}: {moe}", experts)
        assert moe["dp"] == 2, moe
        # the Gated DeltaNet's chunked recurrence (the pure-torch kernel here) carries the two
        # roundings further than a GPT layer: its log-probs still within 1e-6 of their size, its
        # gradients within 1e-5 relative L2 (seen: 5.5e-6) and 1e-4 of each tensor's max (seen:
        # 1.0e-5; the suite's Qwen3.5-vs-HF gradient tolerance); a wrong split or scale is O(1)
        mixers = {"in_proj": 3, "out_proj": 3, "linear_qkv": 1, "linear_proj": 1, "linear_fc1": 4, "linear_fc2": 4}
        _check_exact(hybrid, f"rank {rank}: {hybrid}", mixers, grad_l2=1e-5, grad_max=1e-4)


def test_lora_settings_are_checked_before_any_process_group():
    import torch.distributed as dist

    from megatron_tepo.actor.actor import plan_actor
    from megatron_tepo.config import ConfigError, LoraConfig
    from megatron_tepo.layout import ParallelLayout
    from tests.megatron.helpers import tiny_hf_config

    dense, moe = tiny_hf_config("qwen3"), tiny_hf_config("qwen3_moe")
    settings, _ = plan_actor(dense, ParallelLayout(), lora={"rank": 4}, world_size=1)  # plain data, as a keyword
    assert settings.lora == LoraConfig(rank=4)
    assert plan_actor(dense, ParallelLayout(), world_size=1)[0].lora is None
    with pytest.raises(ValueError, match=r"^actor.lora.rank: must be > 0"):
        plan_actor(dense, ParallelLayout(), lora=LoraConfig(rank=0), world_size=1)
    assert plan_actor(moe, ParallelLayout(), lora=LoraConfig(), world_size=1)[0].lora == LoraConfig()  # the experts too
    with pytest.raises(ConfigError, match=r"^actor.lora.target_modules: linear_fc1, linear_fc2 on an MoE model "
                                          r".* parallel.tp: 2 splits"):
        plan_actor(moe, ParallelLayout(tp=2), lora=LoraConfig(), world_size=2)
    # Transformer Engine's grouped experts are not adapted: the local ones asked for
    import dataclasses

    import megatron_tepo.megatron.model as model_mod

    real = model_mod.resolve_actor_config
    with pytest.MonkeyPatch.context() as mp:  # (moe_grouped_gemm resolves to on where Transformer Engine is)
        mp.setattr(model_mod, "resolve_actor_config", lambda a: dataclasses.replace(
            real(dataclasses.replace(a, moe_grouped_gemm="off")), moe_grouped_gemm="on"))
        with pytest.raises(ConfigError, match=r"^actor.lora.target_modules: linear_fc1, linear_fc2 on an MoE model "
                                              r".* set actor.moe_grouped_gemm: off"):
            plan_actor(moe, ParallelLayout(), lora=LoraConfig(), world_size=1)
        attention_only = LoraConfig(target_modules=["linear_qkv", "linear_proj"])
        assert plan_actor(moe, ParallelLayout(), lora=attention_only, world_size=1)[0].lora == attention_only
    assert not dist.is_initialized()
