"""MoE routing from SGLang servers (issue #41 point 3; ``actor.routing_replay: r3``): the fleet asks
every ``/generate`` for the routed experts, decodes SGLang 0.5.23's answer (the base64 of int32 ids
``[prompt + output - 1, num_hidden_layers, topk]``, as its tokenizer manager writes it) into
``Sample.routed_experts`` over the MoE layers, and a server that answers without them is an error
naming it, never a silent fall-back. Against fake servers (tests/rollout/fake_sglang.py) that encode
the ids as SGLang does; the launchers start the servers with the flag when replay asks for it."""
import base64
import json

import numpy as np
import pytest
import torch

from megatron_tepo.rollout.sglang.client import FleetError
from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
from megatron_tepo.rollout.sglang.routing import RoutingShape, decode_routed_experts, routing_shape_of
from tests.rollout.fake_sglang import FakeSGLang, routed_experts_ids


def _config(tmp_path, **kw):
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
           "mlp_only_layers": [1], "decoder_sparse_step": 1, **kw}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_the_routing_shape_is_the_models_moe_layers(tmp_path):
    assert routing_shape_of(_config(tmp_path)) == RoutingShape(4, (0, 2, 3), 2, 8)
    assert routing_shape_of(_config(tmp_path, mlp_only_layers=[], decoder_sparse_step=2)).moe_layers == (1, 3)
    with pytest.raises(ValueError, match="config.json: no num_experts / num_experts_per_tok: a dense model"):
        routing_shape_of(_config(tmp_path, num_experts=None, num_experts_per_tok=None))


def test_sglangs_encoding_decodes_to_the_moe_layers_ids():
    shape = RoutingShape(4, (0, 2, 3), 2, 8)
    ids = np.random.default_rng(0).integers(0, 8, size=(5, 4, 2), dtype=np.int32)
    meta = {"routed_experts": base64.b64encode(ids.tobytes()).decode("utf-8")}  # SGLang's own writing
    out = decode_routed_experts(meta, 5, shape, "server X")
    assert out.dtype == torch.int8 and out.shape == (5, 3, 2)
    assert torch.equal(out.long(), torch.from_numpy(ids[:, [0, 2, 3]]).long())
    with pytest.raises(ValueError, match="^server X returned no routed experts although asked"):
        decode_routed_experts({}, 5, shape, "server X")
    with pytest.raises(ValueError, match="^server X returned 40 routed-expert ids, expected 6 positions"):
        decode_routed_experts(meta, 6, shape, "server X")
    bad = ids.copy()
    bad[0, 0, 0] = 8
    with pytest.raises(ValueError, match=r"outside \[0, 8\)"):
        decode_routed_experts({"routed_experts": base64.b64encode(bad.tobytes()).decode()}, 5, shape, "server X")
    assert decode_routed_experts(meta, 5, RoutingShape(4, (0, 2, 3), 2, 200), "x").dtype == torch.int16


def _fleet(fakes, shape):
    return SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=30, step_timeout=60,
                                   probe_interval=0.2, probe_timeout=1.0, routing=shape))


def test_the_fleet_asks_for_the_routing_and_each_sample_carries_it():
    shape = RoutingShape(4, (0, 2, 3), 2, 8)
    fakes = [FakeSGLang(routing=(4, 2, 8)), FakeSGLang(routing=(4, 2, 8))]
    fleet = _fleet(fakes, shape)
    try:
        groups = fleet.generate([[1, 2, 3], [4, 5, 6, 7]], n=1, max_new_tokens=2)
        for prompt, (sample,) in zip([[1, 2, 3], [4, 5, 6, 7]], groups):
            want = routed_experts_ids(len(prompt) + 2 - 1, 4, 2, 8)[:, [0, 2, 3]]
            assert torch.equal(sample.routed_experts.long(), torch.from_numpy(want).long())
        bodies = [b for f in fakes for b in f.bodies("/generate")]
        assert bodies and all(b["return_routed_experts"] is True and b["routed_experts_start_len"] == 0
                              for b in bodies)
    finally:
        fleet.close()
        for f in fakes:
            f.close()


def test_a_server_that_does_not_return_the_routing_is_an_error_naming_it():
    fake = FakeSGLang()  # started without --enable-return-routed-experts: answers without them
    fleet = _fleet([fake], RoutingShape(4, (0, 2, 3), 2, 8))
    try:
        with pytest.raises(FleetError, match=rf"request rejected by {fake.url}: an SGLang server returned no routed "
                                             r"experts although asked"):
            fleet.generate([[1, 2, 3]], n=1, max_new_tokens=2)
        assert len(fake.bodies("/generate")) == 1  # not retried elsewhere as if the server had failed
    finally:
        fleet.close()
        fake.close()


def test_without_replay_nothing_is_asked():
    fake = FakeSGLang(routing=(4, 2, 8))
    fleet = _fleet([fake], None)
    try:
        (sample,), = fleet.generate([[1, 2, 3]], n=1, max_new_tokens=2)
        assert sample.routed_experts is None and "return_routed_experts" not in fake.bodies("/generate")[0]
    finally:
        fleet.close()
        fake.close()


def test_the_launchers_start_the_servers_returning_routing_when_replay_asks():
    from megatron_tepo.launch import load_launch, serve_args
    from megatron_tepo.rollout.sglang.options import ServerConfig, server_command
    from tests.launch.test_scripts import ROOT

    spec = load_launch(ROOT / "examples/models/qwen3_30b_a3b.yaml")
    assert spec.cfg.actor.routing_replay == "r3" and "--enable-return-routed-experts" in serve_args(spec)
    dense = load_launch(ROOT / "examples/models/qwen3_14b.yaml")
    assert "--enable-return-routed-experts" not in serve_args(dense)
    cmd, _ = server_command(ServerConfig(model_path="/m", enable_return_routed_experts=True), 30000)
    assert "--enable-return-routed-experts" in cmd


@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_a_real_sglang_cpu_server_returns_the_routing_of_a_tiny_moe(tmp_path, sglang_python):
    """The fleet launches a real SGLang 0.5.23 CPU server on a tiny random Qwen3-MoE (2 layers, 8
    experts, top-2) with ``routing``: it starts it with --enable-return-routed-experts, asks every
    request for the routing and decodes it. The experts are those of SGLang's own forward: each id
    in range, one per slot, the two slots of a position distinct, the same for the same prompt."""
    import transformers

    from megatron_tepo.rollout.sglang.options import ServerConfig

    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                                      mlp_only_layers=[], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    model.save_pretrained(tmp_path / "moe")
    shape = routing_shape_of(str(tmp_path / "moe"))
    assert shape == RoutingShape(2, (0, 1), 2, 8)
    fleet = SGLangFleet(FleetConfig(num_servers=1, router="none", request_timeout=300, step_timeout=600,
                                    routing=shape,
                                    server=ServerConfig(model_path=str(tmp_path / "moe"), python=sglang_python,
                                                        dtype="float32", startup_timeout=600,
                                                        log_dir=str(tmp_path / "logs"))))
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        groups = fleet.generate(prompts, n=2, max_new_tokens=3, temperature=1e-5)  # (near-greedy)
        for prompt, group in zip(prompts, groups):
            for s in group:
                r = s.routed_experts
                assert r.shape == (len(prompt) + len(s.token_ids) - 1, 2, 2), r.shape
                assert int(r.min()) >= 0 and int(r.max()) < 8 and bool((r[..., 0] != r[..., 1]).all()), r
            assert torch.equal(group[0].routed_experts, group[1].routed_experts)  # greedy: the same routing
            # HF's router on the same tokens (fp32 both): the same experts, but for near ties
            s = group[0]
            ids = torch.tensor([prompt + s.token_ids[:-1]])
            with torch.no_grad():
                logits = model(input_ids=ids, output_router_logits=True).router_logits
            hf = torch.stack([lg.view(ids.shape[1], -1).topk(2, -1).indices for lg in logits], 1)  # [pos, layer, k]
            same = (hf.sort(-1).values == s.routed_experts.long().sort(-1).values).all(-1).float().mean()
            assert same >= 0.9, (same, hf, s.routed_experts)
    finally:
        fleet.close()
