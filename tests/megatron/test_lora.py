"""LoRA on the Megatron actor (megatron/lora.py) under torchrun (gloo, 2 processes): one launch
covers TP 1 (two data-parallel ranks), TP 2 and TP 2 with sequence parallelism, one PP 2 and CP 2
(the tiny Qwen3), one EP 2 (the tiny Qwen3-MoE, adapters on every expert) and the tiny Qwen3.5
(adapters on the Gated DeltaNet's ``in_proj`` / ``out_proj`` too); see workers/lora_worker.py for
what each case measures. The adapters train alone (the optimizer holds them and nothing else), step 0 is the
base model, and with nonzero B the actor equals a plain actor on the merged weights
``W + s*B*A``: log-probs, entropy and loss within 1e-6, the adapters' gradients within 1e-6
(relative) of those the merged model's weight gradients give; the weight export carries the
merged weights and an embedded engine updated from it scores as the actor; a checkpoint holds
the adapters and their Adam states and references the base's HF folder (a base given as a state
dict is saved in full): a fresh actor resumes bit for bit at the same layout, and at TP 1 / PP 2
from a TP 2 checkpoint with the same log-probs (fp32 rounding).
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
    if "peft_modules" in c:  # (rank 0: the adapters gathered in PEFT's names, every adapted module once)
        assert c["peft_modules"] == c["peft_want"] and c["peft_want"], (where, c["peft_modules"], c["peft_want"])


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
                # (a base from a state dict cannot be referenced: saved in full, and said so)
                assert c["base_file"]["saved_in_full"] and c["base_file"]["base"] is None, (where, c["base_file"])


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


def _write_base(path):
    """The tiny Qwen3 of the worker (seed 0) as an HF folder: config.json + model.safetensors."""
    from safetensors.torch import save_file

    from tests.megatron.helpers import hf_state, make_hf_model, tiny_hf_config

    cfg = tiny_hf_config("qwen3", tie=False)
    path.mkdir(parents=True)
    cfg.to_json_file(str(path / "config.json"))
    save_file({n: t.contiguous() for n, t in hf_state(make_hf_model(cfg, seed=0)).items()},
              str(path / "model.safetensors"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_lora_checkpoint_references_its_base_and_resumes_at_another_tp_or_pp(tmp_path):
    """A LoRA actor built from an HF folder saves the adapters and their Adam states and a
    reference to the folder, no base tensor; a fresh actor on a random base resumes from it bit
    for bit at the same layout (the base read from the folder), and at TP 1 and at PP 2 (the
    adapters and Adam states resharded) with the uninterrupted run's log-probs before and after
    the next step; a changed base is refused in one line."""
    base = tmp_path / "base"
    _write_base(base)
    per_rank = _run(tmp_path, [{"resume": True}])
    for rank, (c,) in enumerate(per_rank):
        where = f"rank {rank}"
        ref = c["base_file"]
        assert ref["saved_in_full"] is False and ref["base"]["path"] == str(base), (where, ref)
        assert list(ref["base"]["fingerprint"]) == ["model.safetensors"], (where, ref)
        assert c["base_keys"] == [], (where, c["base_keys"])  # not one base tensor in the checkpoint
        same = c["same"]
        assert same["extra"] == {"step": 1} and same["lp_equal"] and same["after_equal"] and same["loss_equal"], \
            (where, same)
        tol = TOL * c["lp_scale"]  # another layout sums in another order: fp32 rounding
        for layout in ("tp1", "pp2"):
            got = c[layout]
            assert got["extra"] == {"step": 1}, (where, layout, got)
            assert got["lp_err"] <= tol and got["after_err"] <= tol, (where, layout, got)
            assert got["loss_err"] <= TOL and got["grad_norm_err"] <= TOL * 10, (where, layout, got)
        # the weights alone (no Adam states, no LR schedule): the next step goes elsewhere
        assert c["model_only"]["lp_err"] <= tol and c["model_only"]["after_err"] > 1e-3, (where, c["model_only"])
        err = c["changed_base_error"]
        assert err is not None and "\n" not in err, (where, err)
        assert f"its LoRA base {base} changed since the save (model.safetensors differs" in err, (where, err)


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
    # adapters-only sync: SGLang serves no expert adapter; a dense model's default targets go
    with pytest.raises(ConfigError, match=r"^actor.lora.sync: adapters .* none of an MoE expert's linears "
                                          r"\(actor.lora.target_modules: linear_fc1, linear_fc2 on qwen3_moe\)"):
        plan_actor(moe, ParallelLayout(), lora=LoraConfig(sync="adapters"), world_size=1)
    assert plan_actor(dense, ParallelLayout(), lora=LoraConfig(sync="adapters"), world_size=1)[0].lora.sync == "adapters"
    assert not dist.is_initialized()


def test_the_base_reference_is_a_folder_of_safetensors_and_its_fingerprint_a_spot_check(tmp_path):
    """``lora_base.json``'s reference (actor/lora_checkpoint.py): a folder of safetensors (a state
    dict, None or a folder of pickles: None, saved in full); its fingerprint changes with a file's
    size or either end of it, not with a byte in the middle of a file over 2 MiB (a spot check);
    a missing or changed base is one line naming the checkpoint and the base."""
    import torch

    from megatron_tepo.actor.lora_checkpoint import base_reference, check_base, fingerprint
    from megatron_tepo.checkpoint.store import CheckpointError

    assert base_reference(None) is None and base_reference({"w": torch.zeros(1)}) is None
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "pytorch_model.bin").write_bytes(b"x")
    assert base_reference(pickles) is None and base_reference(str(tmp_path / "nowhere")) is None
    folder = tmp_path / "base"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(bytes(3 << 20))
    (folder / "config.json").write_text("{}")
    ref = base_reference(str(folder))
    assert ref == {"path": str(folder.absolute()), "fingerprint": fingerprint(folder)}
    assert list(ref["fingerprint"]) == ["model.safetensors"]  # (config.json is not a weight file)
    check_base(tmp_path / "ckpt", ref)  # unchanged: no error

    def poke(offset):
        data = bytearray(weights.read_bytes())
        data[offset] ^= 1
        weights.write_bytes(bytes(data))

    poke(len(bytes(3 << 20)) // 2)  # the middle: not seen
    assert fingerprint(folder) == ref["fingerprint"]
    for offset in (0, (3 << 20) - 1):  # either end: seen
        poke(offset)
        with pytest.raises(CheckpointError, match=r"^\S+ckpt: its LoRA base \S+base changed since the save "
                                                  r"\(model.safetensors differs"):
            check_base(tmp_path / "ckpt", ref)
        poke(offset)
    check_base(tmp_path / "ckpt", ref)
    weights.unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors differs"):
        check_base(tmp_path / "ckpt", ref)
    with pytest.raises(CheckpointError, match=r"^\S+ckpt: its LoRA base \S+gone .* is not there"):
        check_base(tmp_path / "ckpt", dict(ref, path=str(tmp_path / "gone")))


def test_a_qwen3_5_lora_checkpoint_is_not_resharded_to_another_tp():
    """A Gated DeltaNet in_proj's B is saved as plain rows (megatron/lora.py, "Left out"): a load at
    another TP is refused in one line; at the same TP, without in_proj adapters, or on a GPT model
    it goes on."""
    from types import SimpleNamespace

    from megatron_tepo.actor.checkpointing import lora_tp_problem
    from megatron_tepo.config import LoraConfig

    def model(gdn, lora=LoraConfig()):
        return SimpleNamespace(settings=SimpleNamespace(lora=lora), gated_delta_net=gdn)

    tp2, tp1 = {"tp": 2}, {"tp": 1}
    problem = lora_tp_problem(model(True), tp2, tp1)
    assert problem.startswith("a LoRA checkpoint with Gated DeltaNet in_proj adapters loads at its own TP only "
                              "(saved at TP 2, this actor is TP 1)") and "\n" not in problem
    assert lora_tp_problem(model(True), tp2, tp2) == ""
    assert lora_tp_problem(model(False), tp2, tp1) == ""
    assert lora_tp_problem(model(True, None), tp2, tp1) == ""
    assert lora_tp_problem(model(True, LoraConfig(target_modules=["linear_qkv", "out_proj"])), tp2, tp1) == ""
