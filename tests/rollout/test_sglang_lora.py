"""LoRA adapters into a REAL SGLang CPU server (``actor.lora.sync: adapters``,
``rollout/sglang/weight_sync/lora.py``): a server started with LoRA on (``ServerConfig.max_lora_rank``)
-- which on CPU needs the server patch for SGLang's pinned memory (``sglang_cpu/mtepo_sglang_cpu.py``,
work-around 5) -- takes the adapters of a tiny Qwen3 in PEFT's names, twice (the second replaces
the first), and scores a fixed continuation under the served adapter as the merged path does (the
merged weights ``W + s*B*A`` pushed by the ``tensor`` sync and scored without an adapter) and as
the HF model holding those merged weights does, within the bf16 server's 2e-2 of the other sglang
log-prob tests (a float32 server here); clearly apart from the base model's. The bytes of both syncs are reported."""
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
from megatron_tepo.rollout.sglang.server import ServerConfig
from megatron_tepo.rollout.sglang.weight_sync import LoraAdapterSync, TensorSync
from tests.rollout.helpers import hf_response_log_probs, save_tiny_qwen3, tiny_qwen3, tiny_qwen3_config

pytestmark = pytest.mark.sglang
SCALE = 0.07
SEQ = [5, 17, 33, 40, 41, 42, 43, 44, 45, 46, 47, 48]
PROMPT_LEN = 3
RANK, ALPHA = 4, 8.0
MODULES = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
#: this checkout's CPU server patches (the SGLang venv's .pth names the checkout it was installed from)
PATCHES = str(Path(__file__).resolve().parents[2] / "megatron_tepo" / "rollout" / "sglang_cpu")


def _adapters(seed: int):
    """Random adapters of every target of the tiny Qwen3 (megatron names: shared A, fused B), in
    PEFT's names with PEFT's config."""
    from megatron_tepo.config import LoraConfig
    from megatron_tepo.megatron.lora_peft import PeftAdapters, megatron_to_peft, peft_adapter_config
    from megatron_tepo.models import family_config_from_hf
    from tests.megatron.helpers import adapted_linears

    cfg = family_config_from_hf(tiny_qwen3_config(), "local")
    g = torch.Generator().manual_seed(seed)
    full = {}
    for base, (rows, cols) in adapted_linears(cfg).items():
        full[f"{base}.lora_A"] = (torch.rand(RANK, cols, generator=g) * 2 - 1) / math.sqrt(cols)
        full[f"{base}.lora_B"] = 0.3 * torch.randn(rows, RANK, generator=g)
    lora = LoraConfig(rank=RANK, alpha=ALPHA)
    return PeftAdapters(megatron_to_peft(full.items(), cfg), peft_adapter_config(lora, cfg, "tiny"))


def _merged(adapters):
    """The tiny Qwen3 (seed 0) with every adapted weight replaced by ``W + s*B*A`` (fp32)."""
    model = tiny_qwen3(seed=0, scale=SCALE)
    tensors, s = dict(adapters), ALPHA / RANK
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            module = name[len("base_model.model."):-len(".lora_A.weight")]
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            params[f"{module}.weight"].add_(s * (b @ a))
    return model


@pytest.fixture(scope="module")
def fleet(sglang_python, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    save_tiny_qwen3(str(path), seed=0, scale=SCALE)
    cfg = FleetConfig(num_servers=1, request_timeout=120, step_timeout=240, router="none", server_restarts=0,
                      # (float32: the adapters' and the merged weights' products round alike; a bf16 server
                      # rounds W + s*B*A once and W, B, A each, 2e-2 apart at these sizes)
                      server=ServerConfig(model_path=str(path), python=sglang_python, startup_timeout=420, dtype="float32",
                                          max_lora_rank=RANK, lora_target_modules=MODULES, env={"PYTHONPATH": PATCHES},
                                          log_dir=str(tmp_path_factory.mktemp("sglang_logs"))))
    f = SGLangFleet(cfg)
    yield f
    f.close()


def test_adapters_sync_scores_as_the_merged_weights(fleet):
    def score():
        return torch.tensor(fleet.score([SEQ], [PROMPT_LEN])[0])

    base = score()
    sync = LoraAdapterSync(fleet)
    first = _adapters(seed=1)
    stats1 = sync.push(first)
    assert fleet.lora_name == "policy-1"
    lp1 = score()
    ref1 = hf_response_log_probs(_merged(first), SEQ, PROMPT_LEN)
    assert float((lp1 - ref1).abs().max()) < 2e-2, (lp1, ref1)
    assert float((base - ref1).abs().max()) > 0.1, (base, ref1)  # the adapter changed the policy

    second = _adapters(seed=2)  # the next update: a new adapter, the first unloaded
    stats2 = sync.push(second)
    assert fleet.lora_name == "policy-2" and sync.loaded == "policy-2"
    lp2 = score()
    merged2 = _merged(second)
    ref2 = hf_response_log_probs(merged2, SEQ, PROMPT_LEN)
    assert float((lp2 - ref2).abs().max()) < 2e-2, (lp2, ref2)
    assert float((lp1 - ref2).abs().max()) > 0.1
    with pytest.raises(Exception):  # the first version is gone from the server
        fleet.servers[0].post("/generate", {"input_ids": SEQ, "lora_path": "policy-1",
                                            "sampling_params": {"max_new_tokens": 0}}, timeout=60)

    # the merged path: the same policy as merged weights (tensor sync), requests naming no adapter
    fleet.lora_name = None
    merged_stats = TensorSync(fleet).push(merged2.state_dict().items())
    lp_merged = score()
    assert float((lp_merged - ref2).abs().max()) < 2e-2, (lp_merged, ref2)
    assert float((lp2 - lp_merged).abs().max()) < 2e-2, (lp2, lp_merged)

    n_bytes = sum(t.numel() * t.element_size() for _, t in second)
    assert stats1.bytes == stats2.bytes == n_bytes and stats2.tensors == len(second) == 2 * 7 * 2
    assert merged_stats.bytes == sum(t.numel() * t.element_size() for t in merged2.state_dict().values())
    print(json.dumps({"adapters_sync_bytes": stats2.bytes, "adapters_tensors": stats2.tensors,
                      "merged_sync_bytes": merged_stats.bytes, "merged_tensors": merged_stats.tensors,
                      "ratio": stats2.bytes / merged_stats.bytes}))
