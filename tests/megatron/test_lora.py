"""LoRA on the Megatron actor (megatron/lora.py) under torchrun (gloo, 2 processes): one launch
covers TP 1 (two data-parallel ranks), TP 2 and TP 2 with sequence parallelism (see
workers/lora_worker.py for what each case measures). The adapters train alone (the optimizer holds them and nothing else), step 0 is the
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


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_lora_equals_merged_weights_at_tp1_tp2_and_sequence_parallel(tmp_path):
    cases = [{"tp": 1}, {"tp": 2, "checkpoint": True}, {"tp": 2, "actor": {"sequence_parallel": True}}]
    per_rank = [r["cases"] for r in torchrun(WORKER, 2, str(tmp_path), json.dumps(cases), tmp_path=tmp_path,
                                               timeout=500)]
    for rank, results in enumerate(per_rank):
        for c in results:
            where = f"rank {rank}: {c}"
            assert c["trainable"], where
            assert c["adapters"] == 4 * 4 * 2, where  # 4 layers x 4 linears x (A, B)
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
            assert c["grad_rel_l2"] <= 2 * TOL and c["grad_rel"] <= 1e-5, (where, c["grad_rel_l2"], c["grad_rel"])
            assert c["base_changed"] == [], (where, c["base_changed"])
            assert c["adapters_moved"] > 1e-5, where
            assert c["engine_lp_err"] <= 1e-5, (where, c["engine_lp_err"])
            if c["case"].get("checkpoint"):
                assert c["resume_extra"] == {"step": 1}, where
                assert c["resume_equal"] and c["resume_loss_equal"], where


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
    with pytest.raises(ConfigError, match=r"^actor.lora.target_modules: linear_fc1, linear_fc2 on an MoE model"):
        plan_actor(moe, ParallelLayout(), lora=LoraConfig(), world_size=1)
    attention_only = LoraConfig(target_modules=["linear_qkv", "linear_proj"])
    assert plan_actor(moe, ParallelLayout(), lora=attention_only, world_size=1)[0].lora == attention_only
    assert not dist.is_initialized()
