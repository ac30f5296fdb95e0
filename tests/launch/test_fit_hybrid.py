"""The fit check's prices of a hybrid (#53, Qwen3.5): its Gated DeltaNet layers' parameters are the
model's (a tiny Qwen3.5 dense and MoE, every parameter of the transformers model counted), only
its attention layers keep a KV cache on a server, and each running request holds the Gated
DeltaNet layers' recurrent state (the convolution's last inputs, the scan's matrices in fp32)."""
import math

import pytest

from megatron_tepo.launch.memory import linear_state_bytes, param_counts, server_memory, total_params
from megatron_tepo.launch.shape import model_shape
from tests.megatron.helpers import make_hf_model, tiny_hf_config


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tie", [False, True])
def test_the_parameters_priced_are_the_models(family, tie):
    hf = tiny_hf_config(family, tie=tie)
    m = model_shape(hf.to_dict())
    assert total_params(m) == sum(p.numel() for p in make_hf_model(hf).parameters())
    if family.startswith("qwen3_5"):
        assert (m.linear_layers, m.num_hidden_layers, m.attention_output_gate) == (3, 4, True)
        # TP splits every matrix of the Gated DeltaNet but its output norm, and the shared expert's gate
        dense, expert = param_counts(m, t=2)["first"]
        assert dense + expert < total_params(m) and (dense + expert) * 2 > total_params(m)


def test_a_server_prices_the_attention_layers_kv_and_a_requests_recurrent_state():
    from megatron_tepo.config import RunConfig
    from megatron_tepo.launch import LaunchLayout
    from megatron_tepo.launch.schema import RolloutServers
    from megatron_tepo.rollout.sglang.options import ServerConfig

    hf = tiny_hf_config("qwen3_5").to_dict()
    m = model_shape(hf)
    cfg = RunConfig()
    launch = LaunchLayout(gpus_per_node=2, actor_nodes=1, rollout_nodes=1,
                          rollout=RolloutServers(server=ServerConfig(tp=2, max_running_requests=8)))
    s = server_memory(m, cfg, launch)
    # KV: the one attention layer of four; K and V of its KV heads over the two GPUs, bf16
    assert s.kv_bytes_per_token == 2 * 1 * math.ceil(hf["num_key_value_heads"] / 2) * hf["head_dim"] * 2
    qk, v, nv = 2 * 16, 4 * 16, 4  # the tiny config's Gated DeltaNet: 2 key heads, 4 value heads of 16
    conv = 2 * math.ceil((2 * qk + v) / 2) * (4 - 1)
    ssm = 4 * math.ceil(nv / 2) * 16 * 16
    assert s.state_bytes_per_request == linear_state_bytes(m, 2) == 3 * (conv + ssm)
    assert s.state == 8 * s.state_bytes_per_request and s.total == s.weights + s.kv_cache + s.state
    dense = server_memory(model_shape(tiny_hf_config("qwen3").to_dict()), cfg, launch)
    assert dense.state == 0 and dense.state_requests == 0
