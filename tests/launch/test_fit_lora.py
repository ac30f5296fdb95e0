"""The fit check prices LoRA (issue #59 item 2): with ``actor.lora`` the base is frozen (its bf16
weights only: no gradients, no fp32 main copy, no Adam states) and the adapters carry weights,
gradients and the distributed optimizer's state, split by TP as megatron/lora.py splits them. The
Qwen3-14B figures equal a hand computation; the report shows the same layout's full-parameter run
beside the LoRA one; the single-node 14B and 32B LoRA examples pass. (That the priced bytes are what
a built LoRA actor allocates: tests/launch/test_fit_vs_actor.py.)"""
import dataclasses
from pathlib import Path

import pytest

from megatron_tepo.config import LoraConfig
from megatron_tepo.launch import check_fit, load_launch
from megatron_tepo.launch.lora import lora_param_split, lora_params
from megatron_tepo.launch.memory import GiB, actor_memory

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"
Q14_LORA, Q32_LORA = MODELS / "qwen3_14b_lora.yaml", MODELS / "qwen3_32b_lora.yaml"


def _fit(path, *overrides):
    spec = load_launch(path, list(overrides))
    return spec, check_fit(spec.shape(), spec.cfg, spec.launch, raise_error=False)


def test_qwen3_14b_lora_figures_equal_a_hand_computation():
    """Qwen3-14B (h 5120, F 17408, 40 heads, 8 KV groups, d 128, 40 layers), rank 32 on the four
    linears, TP 4, DP 2, bf16, the distributed optimizer: every number written out by hand."""
    spec = load_launch(Q14_LORA)
    m, cfg, launch = spec.shape(), spec.cfg, spec.launch
    assert (cfg.parallel.tp, cfg.parallel.pp, launch.actor_gpus, cfg.actor.lora.rank) == (4, 1, 8, 32)
    r, t = 32, 4
    qkv = r * 5120 + (40 + 2 * 8) * 128 // t * r  # column: A [r, h] whole, B [(nh + 2 ng) d / t, r]
    proj = r * 40 * 128 // t + 5120 * r  # row: A [r, nh d / t], B [h, r] whole
    fc1 = r * 5120 + 2 * 17408 // t * r  # column: B [2F / t, r]
    fc2 = r * 17408 // t + 5120 * r  # row: A [r, F / t]
    adapters = 40 * (qkv + proj + fc1 + fc2)
    assert adapters == 46_858_240  # (as the report and docs/LAUNCH.md print it)
    assert lora_params(m, cfg.actor.lora, t=4) == adapters
    # the whole model's adapters at TP 1: r (in + out) per linear per layer
    whole = 40 * r * ((5120 + 7168) + (5120 + 5120) + (5120 + 34816) + (17408 + 5120))
    assert lora_params(m, cfg.actor.lora) == whole == 108_789_760
    a = actor_memory(m, cfg, launch)
    base = a.dense_params - adapters
    full = dataclasses.replace(cfg.actor, lora=None)
    f = actor_memory(m, dataclasses.replace(cfg, actor=full), launch)
    assert base == f.dense_params == 3_692_395_520 and a.lora_params == adapters
    assert a.weights == 2 * (base + adapters)  # bf16 base and adapters
    assert a.grads == 4 * adapters  # fp32 gradient buffer: the adapters' only
    assert a.optimizer == 12 * adapters / 2  # fp32 main + Adam's two moments, over DP 2
    assert (f.grads, f.optimizer) == (4 * base, 12 * base / 2)  # the full run: the base's too
    # ... while the activations differ by the adapters' h = x A^T: r elements a token per target
    # and layer (dropout 0), bf16
    # (full recompute: one layer's at a time, 16384 tokens)
    assert a.activations - f.activations == pytest.approx(2 * 4 * r * 1 * 16384, rel=1e-12)
    assert a.total / GiB == pytest.approx(14.8, abs=0.05) and f.total / GiB == pytest.approx(48.6, abs=0.05)


def test_the_report_prints_the_lora_run_beside_the_full_run(capsys):
    from tools.fit_check import cli

    assert cli(["--config", str(Q14_LORA)]) == 0
    out = capsys.readouterr().out
    assert ("LoRA rank 32 (alpha 32) on linear_qkv, linear_proj, linear_fc1, linear_fc2: 46,858,240 adapter "
            "parameters on this GPU (1.27% of its 3,692,395,520 frozen base parameters: weights only)") in out
    assert ("the same layout full-parameter: weights 6.9 GiB, grads 13.8 GiB, optimizer 20.6 GiB; total 48.6 GiB "
            "per GPU (LoRA: 14.8 GiB); colocated, its peak 73.1 GiB at offload optimizer_grads (fits), moving "
            "34.4 GiB per GPU each way a step") in out
    assert "weights 7.0 GiB, grads 0.2 GiB, optimizer 0.3 GiB" in out
    assert "peak 73.3 GiB of 80 GiB per GPU: fits" in out


@pytest.mark.parametrize("path,peak,full_total", [(Q14_LORA, 73.3, 48.6), (Q32_LORA, 71.8, 75.3)],
                         ids=["qwen3_14b_lora", "qwen3_32b_lora"])
def test_single_node_lora_examples_fit(path, peak, full_total):
    """One 8-GPU node of 80 GiB, colocated, at the offload level the file asks (optimizer): the
    peaks quoted in the files and docs/LAUNCH.md; the same layout full-parameter needs far more."""
    spec, report = _fit(path)
    check_fit(spec.shape(), spec.cfg, spec.launch)  # raises if it does not fit
    assert spec.launch.actor_nodes == 1 and spec.launch.gpus_per_node == 8 and spec.launch.colocated
    assert spec.cfg.actor.lora is not None and spec.cfg.actor.offload == "optimizer"
    assert report.colocated.phases.peak / GiB == pytest.approx(peak, abs=0.05)
    assert report.full_actor.total / GiB == pytest.approx(full_total, abs=0.05)
    assert report.actor.total < 0.35 * report.full_actor.total


def test_a_full_parameter_report_has_no_lora_lines(capsys):
    from tools.fit_check import cli

    assert cli(["--config", str(MODELS / "qwen3_14b_colocated.yaml")]) == 0
    out = capsys.readouterr().out
    assert "LoRA" not in out and "full-parameter" not in out


def test_attention_only_targets_and_fewer_layers_per_stage():
    """Attention targets only: no MLP adapters; PP 2: half the layers' adapters on a stage."""
    spec = load_launch(Q14_LORA)
    lora = LoraConfig(rank=8, target_modules=["linear_qkv", "linear_proj"])
    assert lora_params(spec.shape(), lora, t=2, p=2) == 20 * (8 * 5120 + 7168 // 2 * 8 + 8 * 5120 // 2 + 5120 * 8)


def test_mlp_targets_on_an_moe_model_adapt_every_expert_and_need_expert_tp_1():
    """An MoE model's MLP targets adapt each expert (megatron/lora.py), whole on its rank: at TP 2
    (expert TP 2) refused in one line naming the fields; the experts' adapters counted per EP rank
    by hand, their optimizer state over the experts' data-parallel group."""
    spec = load_launch(MODELS / "qwen3_30b_a3b.yaml", ["actor.attention=sdpa", "actor.lora.rank=8"])
    with pytest.raises(ValueError, match=r"^actor.lora.target_modules: linear_fc1, linear_fc2 "
                       r"on an MoE model .* parallel.tp: 2 splits .*linear_qkv and linear_proj only$"):
        check_fit(spec.shape(), spec.cfg, spec.launch, raise_error=False)
    m, lora = spec.shape(), spec.cfg.actor.lora
    assert (m.hidden_size, m.num_hidden_layers, m.num_experts, m.moe_intermediate_size) == (2048, 48, 128, 768)
    dense, expert = lora_param_split(m, lora, t=1, p=1, e=8)
    r, qkv, proj = 8, (2048, (32 + 2 * 4) * 128), (32 * 128, 2048)
    assert dense == 48 * r * (sum(qkv) + sum(proj))  # attention: every layer, TP 1
    assert expert == 48 * (128 // 8) * r * ((2048 + 2 * 768) + (768 + 2048))  # 16 experts a rank, each whole
    spec = load_launch(MODELS / "qwen3_30b_a3b.yaml", ["actor.attention=sdpa", "actor.lora.rank=8",
                                                        "actor.lora.target_modules=[linear_qkv,linear_proj]"])
    report = check_fit(spec.shape(), spec.cfg, spec.launch, raise_error=False)
    assert report.actor.lora_params > 0 and report.actor.grads == 4 * report.actor.lora_params


def test_a_hybrids_gated_deltanet_projections_are_priced_and_absent_targets_skipped():
    """Qwen3.5's Gated DeltaNet layers: ``in_proj`` (column) and ``out_proj`` (row) on those layers
    only; on a dense Qwen3 the two names are skipped (no such linear), as the actor skips them."""
    from megatron_tepo.layer_kinds import linear_dims

    spec = load_launch(MODELS / "qwen3.5_27b.yaml")
    m = spec.shape()
    assert m.linear_layers > 0
    qk, v, nv = linear_dims(m)
    lora = LoraConfig(rank=16, target_modules=["in_proj", "out_proj"])
    want = m.linear_layers * (16 * m.hidden_size + (2 * qk + 2 * v + 2 * nv) // 2 * 16
                              + 16 * v // 2 + m.hidden_size * 16)
    assert lora_param_split(m, lora, t=2) == (want, 0)
    dense_model = load_launch(Q14_LORA).shape()
    assert lora_params(dense_model, lora) == 0


def test_adapters_sync_needs_the_servers_on_the_trainers_node():
    """``actor.lora.sync: adapters`` hands the adapters over in shared memory: the one-node examples
    take it (their servers share the node); servers on their own nodes are one line naming the field."""
    from megatron_tepo.config import ConfigError

    spec = load_launch(Q14_LORA, ["actor.lora.sync=adapters"])
    assert spec.cfg.actor.lora.sync == "adapters" and spec.launch.actor_nodes == 1
    with pytest.raises(ConfigError, match=r"^actor.lora.sync: adapters .* servers on other nodes cannot read "
                                          r"\(2 actor node\(s\), launch.rollout_nodes: 2\): use sync: merged"):
        load_launch(MODELS / "qwen3_14b.yaml", ["actor.attention=sdpa", "actor.lora.rank=8",
                                                 "actor.lora.sync=adapters"])
