"""The ``adapters`` weight sync (``rollout/sglang/weight_sync/lora.py``) against recording servers:
each push loads a new served adapter on every server and names it to the fleet, then unloads the
previous version where that server process holds it -- not on a server restarted since (which holds
none: asking it would fail the sync); and the fleet's ``/generate`` requests carry the served name.
The real server: ``test_sglang_lora.py``."""
import pytest
import torch

from megatron_tepo.rollout.sglang.weight_sync import LoraAdapterSync
from megatron_tepo.megatron.lora_peft import PeftAdapters

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj"]}


class _Server:
    def __init__(self, url):
        self.url, self.incarnation, self.tp_size, self.posts = url, 0, 1, []

    def post(self, path, payload=None, timeout=60.0):
        self.posts.append((path, payload))
        if path == "/unload_lora_adapter" and payload["lora_name"] not in self.loaded():
            raise RuntimeError(f"HTTP 400: {payload['lora_name']} is not loaded")
        return {"success": True}

    def loaded(self):
        names = set()
        for path, payload in self.posts:
            if path == "/load_lora_adapter_from_tensors":
                names.add(payload["lora_name"])
            elif path == "/unload_lora_adapter":
                names.discard(payload["lora_name"])
        return names


class _Fleet:
    def __init__(self, servers):
        self.servers, self.lora_name = servers, None

    def alive_servers(self):
        return list(self.servers)


def _adapter(seed):
    g = torch.Generator().manual_seed(seed)
    return PeftAdapters([("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.randn(2, 8, generator=g)),
                         ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.randn(8, 2, generator=g))],
                        CONFIG)


def test_each_push_serves_a_new_adapter_and_unloads_the_last_where_it_is():
    a, b = _Server("http://a"), _Server("http://b")
    fleet = _Fleet([a, b])
    sync = LoraAdapterSync(fleet)
    stats = sync.push(_adapter(1))
    assert fleet.lora_name == "policy-1" and a.loaded() == b.loaded() == {"policy-1"}
    assert stats.bytes == (16 + 16) * 4 and stats.tensors == 2
    load = next(p for path, p in a.posts if path == "/load_lora_adapter_from_tensors")
    assert load["config_dict"] == CONFIG and load["load_format"] == "flattened_bucket"
    assert len(load["serialized_named_tensors"]) == 1  # one entry per TP rank
    b.incarnation, b.posts = 1, []  # b restarted: it holds no adapter
    sync.push(_adapter(2))
    assert fleet.lora_name == "policy-2" and a.loaded() == b.loaded() == {"policy-2"}
    assert not any(path == "/unload_lora_adapter" for path, _ in b.posts)
    with pytest.raises(ValueError, match="not a PEFT LoRA adapter"):
        sync.push([("x", torch.zeros(1))])


def test_the_fleets_generate_requests_name_the_served_adapter():
    from megatron_tepo.rollout.sglang.dispatch import with_adapter

    payload = {"input_ids": [1, 2], "sampling_params": {}}
    assert with_adapter("/generate", payload, "policy-3") == {**payload, "lora_path": "policy-3"}
    assert with_adapter("/generate", payload, None) is payload  # the base model: nothing added
    assert with_adapter("/flush_cache", {}, "policy-3") == {}
