"""LoRA adapters in PEFT's format (megatron/lora_peft.py): the fused linears' adapters as PEFT's
per-module ones and back, with the family's own splits; refusals naming ``actor.lora.init_from``;
and under torchrun (gloo, TP 2) the export that ``peft`` loads onto the HF base (its logits the
merged model's, its log-probs the actor's) and the import a run starts from (the same adapters,
bit for bit)."""
import json
from pathlib import Path

import pytest
import torch

from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "lora_peft_worker.py"


def _family(family="qwen3"):
    from megatron_tepo.models import family_config_from_hf
    from tests.megatron.helpers import tiny_hf_config

    return family_config_from_hf(tiny_hf_config(family), "local")


def _random_adapters(cfg, r, seed=0):
    """Full megatron adapters of every target linear of the tiny model, random A and B."""
    from tests.megatron.helpers import adapted_linears

    g = torch.Generator().manual_seed(seed)
    out = {}
    for base, (rows, cols) in adapted_linears(cfg).items():
        out[f"{base}.lora_A"] = torch.randn(r, cols, generator=g)
        out[f"{base}.lora_B"] = torch.randn(rows, r, generator=g)
    return out


def test_peft_names_split_the_fused_adapters_like_their_weights_and_come_back_equal():
    from megatron_tepo.config import LoraConfig
    from megatron_tepo.megatron.lora_peft import megatron_to_peft, peft_to_megatron
    from megatron_tepo.models import layer_mapping, megatron_to_hf

    cfg, lora = _family(), LoraConfig(rank=3, alpha=6.0)
    adapters = _random_adapters(cfg, 3)
    peft = dict(megatron_to_peft(adapters.items(), cfg))
    assert len(peft) == cfg.num_layers * 7 * 2
    pre = "base_model.model.model.layers.1."
    qkv = adapters["decoder.layers.1.self_attention.linear_qkv.lora_B"]
    # B's rows are the weight's: the converter's split of a weight holding B gives the same parts
    weight_parts = dict(megatron_to_hf({"decoder.layers.1.self_attention.linear_qkv.weight": qkv}.items(), cfg))
    for p in "qkv":
        assert torch.equal(peft[f"{pre}self_attn.{p}_proj.lora_B.weight"], weight_parts[f"model.layers.1.self_attn.{p}_proj.weight"])
        assert torch.equal(peft[f"{pre}self_attn.{p}_proj.lora_A.weight"],
                           adapters["decoder.layers.1.self_attention.linear_qkv.lora_A"])
    # the q rows of the first query group are not B's first rows in general (interleaved per group)
    assert peft[f"{pre}self_attn.k_proj.lora_B.weight"].shape == (cfg.num_query_groups * cfg.head_dim, 3)
    fc1 = adapters["decoder.layers.1.mlp.linear_fc1.lora_B"]
    assert torch.equal(peft[f"{pre}mlp.gate_proj.lora_B.weight"], fc1[: cfg.ffn_hidden_size])
    assert torch.equal(peft[f"{pre}mlp.up_proj.lora_B.weight"], fc1[cfg.ffn_hidden_size:])
    assert torch.equal(peft[f"{pre}self_attn.o_proj.lora_B.weight"],
                       adapters["decoder.layers.1.self_attention.linear_proj.lora_B"])
    back = dict(peft_to_megatron(peft, cfg, lora))
    assert sorted(back) == sorted(adapters) and all(torch.equal(back[n], adapters[n]) for n in adapters)
    assert layer_mapping(cfg) is not None


def test_a_peft_adapter_that_is_not_one_fused_adapter_is_refused_naming_init_from(tmp_path):
    from megatron_tepo.config import LoraConfig
    from megatron_tepo.megatron.lora import LoraError
    from megatron_tepo.megatron.lora_peft import megatron_to_peft, peft_to_megatron, read_peft_adapter, write_peft_adapter

    cfg, lora = _family(), LoraConfig(rank=3, alpha=6.0)
    peft = dict(megatron_to_peft(_random_adapters(cfg, 3).items(), cfg))
    own_a = dict(peft)
    own_a["base_model.model.model.layers.2.self_attn.k_proj.lora_A.weight"] = torch.randn(3, cfg.hidden_size)
    with pytest.raises(LoraError, match=r"^actor.lora.init_from: q_proj, k_proj, v_proj of layer 2 have different lora_A"):
        dict(peft_to_megatron(own_a, cfg, lora))
    missing = {n: t for n, t in peft.items() if ".layers.0.mlp.up_proj." not in n}
    with pytest.raises(LoraError, match=r"^actor.lora.init_from: the adapter has no lora_A / lora_B for model.layers.0.mlp.up_proj"):
        dict(peft_to_megatron(missing, cfg, lora))
    with pytest.raises(LoraError, match=r"^actor.lora.init_from: adapters on modules the actor does not adapt"):
        dict(peft_to_megatron(peft, cfg, LoraConfig(rank=3, alpha=6.0, target_modules=["linear_qkv", "linear_proj"])))
    write_peft_adapter(tmp_path / "a", peft.items(), lora, cfg, "base")
    with pytest.raises(LoraError, match=r"^actor.lora.init_from: .*adapter_config.json: r is 3, actor.lora.rank is 4"):
        read_peft_adapter(tmp_path / "a", cfg, LoraConfig(rank=4, alpha=6.0))
    with pytest.raises(LoraError, match=r"^actor.lora.init_from: .*lora_alpha is 6.0, actor.lora.alpha is 16.0"):
        read_peft_adapter(tmp_path / "a", cfg, LoraConfig(rank=3, alpha=16.0))
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert conf["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert conf["peft_type"] == "LORA" and conf["r"] == 3 and conf["lora_alpha"] == 6.0
    with pytest.raises(LoraError, match=r"^actor.lora.init_from: .*adapter_config.json is missing"):
        read_peft_adapter(tmp_path, cfg, lora)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_exported_peft_adapter_loads_in_peft_as_the_merged_model_and_imports_back_equal_at_tp2(tmp_path):
    pytest.importorskip("peft")
    per_rank = torchrun(WORKER, 2, str(tmp_path), "2", tmp_path=tmp_path, timeout=500)
    r0 = per_rank[0]
    assert "base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight" in r0["peft_names"]
    assert len(r0["peft_names"]) == 4 * 7 * 2
    assert r0["adapter_config"]["r"] == 4 and r0["adapter_config"]["lora_alpha"] == 8.0
    # fp32: W x + s B (A x) against (W + s B A) x, the same sums in another order
    assert r0["peft_vs_merged"] <= 1e-5, r0["peft_vs_merged"]
    assert r0["peft_vs_actor"] <= 1e-5 * max(1.0, r0["lp_scale"]), r0["peft_vs_actor"]
    for rank, r in enumerate(per_rank):
        assert r["import_equal"], rank
        assert r["import_lp_err"] == 0.0, (rank, r["import_lp_err"])
