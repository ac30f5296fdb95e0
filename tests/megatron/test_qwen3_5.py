"""Qwen3.5 (issue #53): a tiny model -- 3 Gated DeltaNet layers and 1 gated attention layer,
hidden 64, ``head_dim`` 32 with RoPE on a quarter of it, 2 key / 4 value heads in the Gated
DeltaNet -- through the actor (megatron's ``HybridModel``, megatron/hybrid.py; the Gated DeltaNet on
the torch stand-in of megatron/gated_delta_rule.py) against transformers' Qwen3.5 in float32, with
packed sequences of several lengths.

* The config and the name tables (no process group): what the family config reads of an HF
  config, a conditional-generation one included (its tensors' names; a config that is neither kind:
  one line naming config.json and the field); every HF tensor mapped once and back.
* The stand-in against transformers' own torch path, packed sequences included.
* Under torchrun (gloo, 2 ranks; workers/equivalence_worker.py, workers/routing_replay_worker.py):
  log-probs and entropy within 1e-5, every gradient within 1e-4 of its tensor's largest entry, the
  loss within 1e-6, the parameters after one AdamW step within 5e-5 -- at TP 1 (DP 2) and TP 2
  (packed against padded and full recompute against none, within 5e-6), PP 2 with tied
  embeddings, CP 2 (megatron's Gated DeltaNet context parallelism, against the same start at CP
  1); Qwen3.5-MoE at TP 2 with
  sequence parallelism, and at EP 2 with routing replay r3, equal to transformers with its routers
  forced to the same experts.
"""
import json
from pathlib import Path

import pytest
import torch

from tests.dist_utils import torchrun
from tests.megatron.helpers import tiny_hf_config

HERE = Path(__file__).parent
EQUIVALENCE = HERE / "workers" / "equivalence_worker.py"
REPLAY = HERE / "workers" / "routing_replay_worker.py"
LOG_PROB_TOL, GRAD_REL_TOL, LOSS_REL_TOL = 1e-5, 1e-4, 1e-6
# the parameters after one AdamW step (lr 1e-3): its first step moves each entry by lr * g / (|g| + eps),
# so an entry whose gradient is near eps (1e-6) moves by lr * its gradient's error / eps -- 1.04e-5 seen
# under ATEN_CPU_CAPABILITY=default, with every gradient within 1e-4 of its tensor's largest entry
PARAM_ABS_TOL = 5e-5
# packed against padded, CP 2 against CP 1, recompute against none: the same arithmetic grouped
# otherwise -- the Gated DeltaNet's chunked scan runs on other rows (packed: one per sequence; padded:
# the micro-batch's), which moves fp32 log-probs by ~1.4e-6 here (the GPT families: under 1e-6)
PACK_TOL = 5e-6


def _hybrid_available():
    from megatron_tepo.megatron.compat import hybrid_model_available, mcore_version
    from packaging.version import Version

    return hybrid_model_available() and mcore_version() >= Version("0.19")


pytestmark = pytest.mark.skipif(not hasattr(__import__("transformers"), "Qwen3_5TextConfig"),
                                reason="this transformers has no Qwen3.5")
needs_gdn = pytest.mark.skipif(not _hybrid_available(), reason="Qwen3.5 needs megatron-core >= 0.19 (HybridModel "
                                                                  "and its Gated DeltaNet package)")


def test_the_family_config_reads_qwen3_5():
    from megatron_tepo.models import family_config_from_hf, layer_mapping
    from megatron_tepo.megatron.family_kwargs import gpt_model_kwargs, transformer_config_kwargs

    fam = family_config_from_hf(tiny_hf_config("qwen3_5"), spec="local")
    assert fam.family == "qwen3_5" and fam.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (fam.attention_output_gate, fam.zero_centered_norms, fam.rotary_percent, fam.head_dim) == (True, True, 0.25, 32)
    la = fam.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (2, 4, 16, 16, 4)
    assert la.in_proj_sections() == (32, 32, 64, 64, 4, 4)
    kw = transformer_config_kwargs(fam)
    assert kw["layernorm_zero_centered_gamma"] and kw["attention_output_gate"] and kw["linear_num_value_heads"] == 4
    assert gpt_model_kwargs(fam)["rotary_percent"] == 0.25
    moe = family_config_from_hf(tiny_hf_config("qwen3_5_moe"), spec="local")
    assert moe.family == "qwen3_5_moe" and moe.moe.num_experts == 4 and moe.moe.router_topk == 2
    assert (moe.moe.shared_expert_ffn_hidden_size, moe.moe.shared_expert_gate, moe.moe.router_pre_softmax) == (48, True, False)
    assert moe.dims().linear_num_key_heads == 2
    # the published conditional-generation config: the text model under text_config
    text = tiny_hf_config("qwen3_5").to_dict()
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
               "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    assert family_config_from_hf(wrapped, spec="local") == fam
    gdn, attn = layer_mapping(fam).for_layer(0), layer_mapping(fam).for_layer(3)
    assert "linear_attn.A_log" in gdn.renames and "self_attn.o_proj.weight" in attn.renames
    assert [g.kind for g in attn.fused] == ["qgkv", "gate_up"] and [g.kind for g in gdn.fused] == ["gdn_in_proj", "gate_up"]


def test_a_config_that_is_neither_text_only_nor_conditional_generation_is_refused(tmp_path):
    """The text model's names: a conditional-generation config's tensors under ``model.language_model.``
    (the vision tower and ``mtp.*`` carried), a text-only one's as stored. A config that is neither --
    the conditional-generation ``model_type`` / architecture without a ``text_config``, a ``text_config``
    without the text model's fields -- gets one line naming config.json and the field, from the family
    config and from the checkpoint reader alike."""
    from megatron_tepo.checkpoint.hf_io import open_hf_checkpoint
    from megatron_tepo.models import checkpoint_naming, family_config_from_hf

    text = tiny_hf_config("qwen3_5").to_dict()
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}
    naming = checkpoint_naming(wrapped)
    assert naming.text_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert naming.stored_name("model.norm.weight") == "model.language_model.norm.weight"
    assert naming.text_name("lm_head.weight") == "lm_head.weight" and naming.stored_name("lm_head.weight") == "lm_head.weight"
    assert naming.text_name("model.visual.blocks.0.attn.qkv.weight") is None and naming.is_carried("mtp.fc.weight")
    plain = checkpoint_naming(text)
    assert plain.text_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert plain.text_name("mtp.fc.weight") == "mtp.fc.weight"  # (not carried: the mapping names it unknown)
    flat = {k: v for k, v in text.items() if k != "model_type"}
    neither = [({**flat, "model_type": "qwen3_5"}, "text_config is missing"),  # the wrapper's type, fields on top
               ({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"},
                "text_config is missing"),
               ({"model_type": "qwen3_5", "text_config": {"hidden_size": 64}}, "text_config of model_type 'qwen3_5' "
                                                                              "has no num_hidden_layers")]
    for cfg, why in neither:
        for call in (lambda: family_config_from_hf(cfg, spec="local"), lambda: checkpoint_naming(cfg)):
            with pytest.raises(ValueError, match="^config.json: .*" + why) as err:
                call()
            assert "\n" not in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps(neither[0][0]))
    with pytest.raises(ValueError, match=f"^{tmp_path / 'config.json'}: .*text_config is missing"):
        open_hf_checkpoint(tmp_path)


def test_every_hf_tensor_maps_once_and_back_bit_for_bit():
    """The tiny models' HF tensors -> Megatron -> HF: the same names, the same bits (both specs'
    norm names; the MoE's experts and shared expert); the export layout and the TP sections."""
    from megatron_tepo.models import family_config_from_hf, hf_to_megatron, layer_mapping, megatron_to_hf
    from megatron_tepo.models.converters import MegatronToHFLayout
    from tests.megatron.helpers import hf_state, make_hf_model

    for family in ("qwen3_5", "qwen3_5_moe"):
        cfg = tiny_hf_config(family)
        state = hf_state(make_hf_model(cfg))
        for spec in ("local", "te"):
            fam = family_config_from_hf(cfg, spec=spec)
            mg = dict(hf_to_megatron(state, fam))
            back = dict(megatron_to_hf(mg, fam))
            assert sorted(back) == sorted(state), (family, spec)
            assert all(torch.equal(back[n], state[n]) for n in state), (family, spec)
            layout = MegatronToHFLayout(fam, layer_mapping(fam))
            for name, t in mg.items():  # the export's row ranges say the same as the converter
                for hf, ranges in layout(name, t.shape):
                    got = t if ranges is None else torch.cat([t[a:b] for a, b in ranges])
                    assert torch.equal(got, state[hf]), (name, hf)
        in_proj = "decoder.layers.0.self_attention.in_proj.weight"
        assert layout.gated(in_proj) == (32, 32, 64, 64, 4, 4)
        assert layout.gated("decoder.layers.0.self_attention.conv1d.weight") == (32, 32, 64)
        assert layout.gated("decoder.layers.3.self_attention.linear_qkv.weight") is False
        # the gated q_proj: each head's query then its gate -> per query group, queries then gates
        fam = family_config_from_hf(cfg, spec="local")
        q = torch.arange(4 * 64).reshape(4 * 64, 1).float()  # 4 heads x (query 32 + gate 32)
        k, v = torch.full((64, 1), -1.0), torch.full((64, 1), -2.0)
        qkv = dict(hf_to_megatron({**state, "model.layers.3.self_attn.q_proj.weight": q,
                                   "model.layers.3.self_attn.k_proj.weight": k,
                                   "model.layers.3.self_attn.v_proj.weight": v}, fam))[
            "decoder.layers.3.self_attention.linear_qkv.weight"].flatten()
        # group 0 holds heads 0, 1: their queries (rows 0-31, 64-95), their gates (32-63, 96-127), k, v
        want = torch.cat([torch.arange(0, 32), torch.arange(64, 96), torch.arange(32, 64), torch.arange(96, 128)]).float()
        assert torch.equal(qkv[:128], want) and bool((qkv[128:160] == -1).all()) and bool((qkv[160:192] == -2).all())


def test_the_sections_shard_and_unshard():
    """A Gated DeltaNet's in_proj under TP: each rank its share of every section (q, k, v, z, b, a)."""
    from megatron_tepo.megatron.sharding import shard_tensor, unshard_tensors

    full = torch.arange(20).reshape(20, 1)
    sections = (4, 4, 6, 2, 2, 2)
    shards = [shard_tensor(full, 0, sections, r, 2) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 4, 5, 8, 9, 10, 14, 16, 18]
    assert torch.equal(unshard_tensors(shards, 0, sections), full)
    with pytest.raises(ValueError, match="not divisible by tp_size=4"):
        shard_tensor(full, 0, sections, 0, 4)


def test_the_stand_in_equals_transformers_torch_path():
    """megatron/gated_delta_rule.py against transformers' Qwen3.5 functions, each packed sequence
    alone (its own zero state and convolution window): forward and backward."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from megatron_tepo.megatron import gated_delta_rule as gdn

    torch.manual_seed(0)
    lens = [5, 70, 1, 130, 64]  # under, over and at the 64-token chunk
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    t = int(cu[-1])
    q, k = (torch.randn(1, t, 4, 16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, t, 4, 24, requires_grad=True)
    g, beta = -2 * torch.rand(1, t, 4), torch.rand(1, t, 4)
    out, _ = gdn.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ref = torch.cat([hf.torch_chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                                                     use_qk_l2norm_in_kernel=True)[0] for a, b in zip(cu[:-1], cu[1:])], 1)
    assert float((out - ref).abs().max()) <= 1e-6
    w = torch.randn_like(out)
    mine, theirs = (torch.autograd.grad((o * w).sum(), (q, k, v)) for o in (out, ref))
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(mine, theirs)) <= 1e-5
    whole = gdn.chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70],
                                       use_qk_l2norm_in_kernel=True)[0]  # one unpacked sequence
    assert float((whole - hf.torch_chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g=g[:, :70],
                  beta=beta[:, :70], use_qk_l2norm_in_kernel=True)[0]).abs().max()) <= 1e-6
    x, weight = torch.randn(1, t, 12), torch.randn(12, 4)
    y, _ = gdn.causal_conv1d(x, weight, activation="silu", cu_seqlens=cu)
    ref = torch.cat([hf.causal_conv1d_fn(x[:, a:b].transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
                     for a, b in zip(cu[:-1], cu[1:])], 1)
    assert float((y - ref).abs().max()) <= 1e-6
    assert float((gdn.l2norm(q) - hf.l2norm(q)).abs().max()) <= 1e-6


def _check(per_rank):
    for k in range(len(per_rank[0])):
        covered = set()
        for rank, cases in enumerate(per_rank):
            c = cases[k]
            where = f"rank {rank}, case {c['case']}"
            assert c["logprob_abs_err"] <= LOG_PROB_TOL and c["entropy_abs_err"] <= LOG_PROB_TOL, where
            assert c["loss_rel_err"] <= LOSS_REL_TOL, where
            assert abs(c["grad_norm"] - c["ref_grad_norm"]) <= 1e-5 * c["ref_grad_norm"], where
            bad = {n: e for n, e in c["grad_rel_err"].items() if e > GRAD_REL_TOL}
            assert not bad, (where, bad)
            bad = {n: e for n, e in c["param_abs_err"].items() if e > PARAM_ABS_TOL}
            assert not bad, (where, bad)
            assert c["min_param_update"] > 1e-4, where
            for check in ("pack_check", "cp_check"):
                if c["case"].get(check):
                    got = c[check]
                    assert got["lp"] <= PACK_TOL and got["ent"] <= PACK_TOL, (where, check, got)
                    assert got["loss_rel"] <= PACK_TOL and got["grad_rel"] <= PACK_TOL, (where, check, got)
            if c["case"].get("recompute_check"):
                assert c["recompute_grad_rel_err"] <= PACK_TOL, (where, c["recompute_grad_rel_err"])
            covered |= set(c["grad_names"])
        assert covered == set(per_rank[0][k]["hf_names"]), per_rank[0][k]["case"]


@needs_gdn
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_qwen3_5_matches_hf_at_tp1_tp2_pp2_cp2(tmp_path):
    cases = [
        {"family": "qwen3_5", "tie": False, "tp": 1, "pp": 1, "loss": {"name": "grpo"}},  # DP 2
        {"family": "qwen3_5", "tie": False, "tp": 2, "pp": 1, "loss": {"name": "grpo"}, "pack_check": True,
         "recompute_check": True},
        {"family": "qwen3_5", "tie": True, "tp": 1, "pp": 2, "loss": {"name": "grpo"}},
        {"family": "qwen3_5", "tie": False, "tp": 1, "pp": 1, "cp": 2, "loss": {"name": "grpo"}, "cp_check": True},
        # the MoE at TP 2 (megatron's MoE layer needs sequence parallelism there): the Gated DeltaNet
        # on sequence-parallel input, the experts and the gated shared expert split over the ranks;
        # loaded from a folder that stores the experts stacked, as the published checkpoints do
        # (#56 row 2), and exported so after the step
        {"family": "qwen3_5_moe", "tie": False, "tp": 2, "pp": 1, "loss": {"name": "grpo"},
         "actor": {"precision": "fp32", "attention": "sdpa", "pack_sequences": True, "sequence_parallel": True},
         "from_dir": True, "stacked": True, "export_check": True},
    ]
    per_rank = [r["cases"] for r in torchrun(EQUIVALENCE, 2, json.dumps(cases), tmp_path=tmp_path, timeout=560)]
    _check(per_rank)
    assert sorted(r[2]["pp_rank"] for r in per_rank) == [0, 1]
    exported = [r[4]["export"] for r in per_rank]  # the stacked MoE: rank 0 writes the export
    assert exported[1] is None and exported[0]["same_names_as_source"], exported
    assert len(exported[0]["stacked"]) == 2 * 4, exported  # gate_up_proj and down_proj of each layer
    assert exported[0]["not_trained_params"] == [] and exported[0]["reload_differs"] == [], exported


@needs_gdn
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_qwen3_5_moe_ep2_r3_matches_hf_with_forced_routing(tmp_path):
    cases = [{"family": "qwen3_5_moe", "mode": "r3", "tp": 1, "ep": 2, "pack": True, "recompute": "full"}]
    per_rank = [r["cases"] for r in torchrun(REPLAY, 2, json.dumps(cases), tmp_path=tmp_path, timeout=360)]
    for rank, results in enumerate(per_rank):
        for c in results:
            where = (rank, c["case"])
            assert c["logprob_checked"] > 50 and c["logprob_bad"] == 0, where
            assert c["train_checked"] > 50 and c["train_bad"] == 0, where
            assert c["train_calls_per_layer"] == [2 * c["train_mbs"]] * c["layers"], where
            assert c["forcing_moves_logprobs"] > 1e-2, where
            assert c["logprob_abs_err"] <= LOG_PROB_TOL, where
            assert c["loss_rel_err"] <= LOSS_REL_TOL, where
            bad = {n: e for n, e in c["grad_rel_err"].items() if e > GRAD_REL_TOL}
            assert not bad, (where, bad)
            assert len(c["router_grad_norm"]) == 4 and min(c["router_grad_norm"].values()) > 0, where
            assert c["train_metrics"]["routing_coverage"] == 1.0, where


CONDITIONAL = HERE / "workers" / "conditional_generation_worker.py"


@needs_gdn
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_published_kind_of_checkpoint_loads_trains_exports_and_syncs(tmp_path):
    """A ``Qwen3_5ForConditionalGeneration`` folder (text model under ``model.language_model.``, a tiny
    vision tower, ``mtp.*`` tensors; one process, workers/conditional_generation_worker.py): the actor's
    log-probs equal transformers' text-only forward of it; after a step, ``export_hf`` gives the source's
    config and names, the trained text weights (= the weight sync's stream), the vision and MTP tensors bit
    for bit, and loads as ``Qwen3_5ForConditionalGeneration`` with no missing or unexpected key; the
    checkpoint converts to the same folder after the source is gone; the embedded engine on the source
    folder takes the stream (every parameter) and samples with the trained model's log-probs."""
    import transformers

    from tests.checkpoint.fixtures import load_hf_tensors, make_hf_dir

    hf = make_hf_dir(tmp_path / "hf", "qwen3_5", False, seed=4, conditional_generation=True)
    (r,) = torchrun(CONDITIONAL, 1, str(tmp_path), tmp_path=tmp_path / "run", timeout=360)
    assert r["logprob_abs_err"] <= LOG_PROB_TOL and r["entropy_abs_err"] <= LOG_PROB_TOL, r
    source, exported = load_hf_tensors(hf), load_hf_tensors(tmp_path / "export")
    assert sorted(exported) == sorted(source)
    carried = [n for n in source if n.startswith(("model.visual.", "mtp."))]
    assert len(carried) > 20 and "mtp.fc.weight" in carried
    assert [n for n in carried if not (exported[n].dtype == source[n].dtype and torch.equal(exported[n], source[n]))] == []
    stream = torch.load(tmp_path / "stream.pt")
    stored = {n: "model.language_model." + n[len("model."):] if n.startswith("model.") else n for n in stream}
    assert sorted(stored.values()) == sorted(set(source) - set(carried))
    assert [n for n in stream if not torch.equal(exported[stored[n]], stream[n])] == []
    assert not torch.equal(exported["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"],
                           source["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"])  # trained
    assert json.loads((tmp_path / "export" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    model, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path / "export"),
                                                                              output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    # each checkpoint carries the vision and MTP tensors itself (what the converter writes back from:
    # tests/checkpoint/test_convert_roundtrip.py::test_qwen3_5_tp2_and_ep2_logits_and_roundtrip)
    kept = load_hf_tensors(tmp_path / "sidecars" / "hf_source")
    assert sorted(kept) == sorted(carried) and all(torch.equal(kept[n], source[n]) for n in carried)
    info = json.loads((tmp_path / "sidecars" / "megatron_tepo_checkpoint.json").read_text())
    assert sorted(info["hf_tensors"]) == sorted(source)
    # the embedded engine: transformers maps the folder to the text model (Qwen3_5ForCausalLM, the
    # stream's names); every parameter came from the stream, and its samples' log-probs are the trained model's
    assert r["engine_model"] == "Qwen3_5ForCausalLM" and r["engine_params"] == sorted(stream)
    assert r["engine_differ"] == [] and r["engine_logprob_abs_err"] <= LOG_PROB_TOL, r


def test_gated_delta_net_boundaries_go_to_the_device():
    """megatron's Gated DeltaNet hands the packed boundaries (the ``*_padded`` fields first) to
    flash-linear-attention's Triton kernels, which read them on the device: a host tensor failed
    there ("Pointer argument ... cannot be accessed from Triton (cpu tensor?)", the GPU check of
    2026-11-28). A hybrid's micro-batch carries a device copy in the padded fields; the sdpa
    attention keeps its host boundaries; a dense model's inputs are as before ("meta" stands for
    the GPU here)."""
    from types import SimpleNamespace

    from megatron_tepo.megatron.model import TrainModel, has_gated_delta_net
    from megatron_tepo.models import family_config_from_hf

    assert has_gated_delta_net(family_config_from_hf(tiny_hf_config("qwen3_5"), spec="local"))
    assert not has_gated_delta_net(family_config_from_hf(tiny_hf_config("qwen3"), spec="local"))
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    mb = SimpleNamespace(input_ids=torch.zeros(1, 5, dtype=torch.long), position_ids=torch.zeros(1, 5, dtype=torch.long),
                         cp_splits=None, cu_seqlens=cu, max_seqlen=3)
    for gdn in (True, False):
        me = SimpleNamespace(device=torch.device("meta"), gated_delta_net=gdn,
                             settings=SimpleNamespace(attention="sdpa", precision="fp32"))
        p = TrainModel.inputs(me, mb)["packed_seq_params"]
        assert p.cu_seqlens_q is cu and p.cu_seqlens_kv is cu
        if gdn:
            assert p.cu_seqlens_q_padded.device.type == "meta" and p.cu_seqlens_kv_padded.device.type == "meta"
        else:
            assert p.cu_seqlens_q_padded is None and p.cu_seqlens_kv_padded is None


def test_fla_backward_refusal_is_known_before_the_first_backward(monkeypatch):
    """flash-linear-attention 0.6 refuses its gated backward on Hopper with 3.4.0 <= Triton < 3.7.1
    (no tilelang): the GPU check met it on an H200 with Triton 3.6.0. The condition is named before
    the model is built; ``MTEPO_GDN_KERNELS=torch`` takes the stand-in instead."""
    from megatron_tepo.megatron import cpu_patches

    monkeypatch.delenv("MTEPO_GDN_KERNELS", raising=False)
    why = cpu_patches.fla_backward_refusal((9, 0), "3.6.0", False)
    assert why and "Triton 3.6.0" in why and "Hopper" in why
    for args in (((9, 0), "3.7.1", False), ((9, 0), "3.3.1", False), ((9, 0), "3.6.0", True), ((8, 0), "3.6.0", False),
                 ((10, 0), "3.6.0", False)):
        assert cpu_patches.fla_backward_refusal(*args) is None, args
    monkeypatch.setattr(cpu_patches, "cuda_available", lambda: True)
    monkeypatch.setattr(cpu_patches, "fla_available", lambda: True)
    assert not cpu_patches.CONDITION_PROBES["no_gdn_kernels"]()
    monkeypatch.setenv("MTEPO_GDN_KERNELS", "torch")
    assert cpu_patches.CONDITION_PROBES["no_gdn_kernels"]()
    assert cpu_patches.fla_backward_refusal((9, 0), "3.6.0", False) is None


@needs_gdn
def test_the_stand_in_on_a_gpu_is_said_once_unless_chosen(monkeypatch, capsys):
    """Issue #56 row 5: on a GPU without fla-core the Gated DeltaNet silently ran on the pure-torch
    stand-in (a Python loop over 64-token chunks, fp32). Building a Qwen3.5 stack there now says so
    once, as one warning line naming why it is slow and how to get fla-core; not when the user chose
    it (MTEPO_GDN_KERNELS=torch), and not on CPU (the main job stays quiet)."""
    from megatron_tepo.config import ActorConfig
    from megatron_tepo.megatron import cpu_patches, hybrid
    from megatron_tepo.megatron.resolve import resolve_actor_config
    from megatron_tepo.models import family_config_from_hf

    actor = resolve_actor_config(ActorConfig(precision="fp32", attention="sdpa"), cuda=False, te=False)
    fam = family_config_from_hf(tiny_hf_config("qwen3_5"), spec="local")
    monkeypatch.setattr(cpu_patches, "applied_patches", lambda: ["gdn_kernels"])  # (fla-core missing)
    monkeypatch.setattr(hybrid, "_SAID_STAND_IN", [], raising=False)

    def said(cuda, chosen):
        monkeypatch.setattr(cpu_patches, "cuda_available", lambda: cuda)
        if chosen:
            monkeypatch.setenv("MTEPO_GDN_KERNELS", "torch")
        else:
            monkeypatch.delenv("MTEPO_GDN_KERNELS", raising=False)
        capsys.readouterr()
        for _ in range(2):
            hybrid.hybrid_stack_spec(fam, actor)
        out = capsys.readouterr()
        return [line for line in (out.out + out.err).splitlines() if "stand-in" in line]

    assert said(cuda=False, chosen=False) == []  # CPU: the stand-in is the only way, nothing said
    assert said(cuda=True, chosen=True) == []  # asked for by name
    lines = said(cuda=True, chosen=False)
    assert len(lines) == 1 and "WARNING" in lines[0] and "pip install fla-core" in lines[0], lines
    assert "fla-core is not installed" in lines[0] and "MTEPO_GDN_KERNELS=torch" in lines[0]
    assert said(cuda=True, chosen=False) == []  # once per process
