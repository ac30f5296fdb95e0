"""MoE routing from SGLang servers (issue #41 point 3; ``actor.routing_replay: r3``): the fleet asks
every ``/generate`` for the routed experts, decodes SGLang 0.5.23's answer (the base64 of int32 ids
``[prompt + output - 1, num_hidden_layers, topk]``, as its tokenizer manager writes it) into
``Sample.routed_experts`` over the MoE layers, and a server that answers without them is an error
naming it, never a silent fall-back. Against fake servers (tests/rollout/fake_sglang.py) that encode
the ids as SGLang does; the launchers start the servers with the flag when replay asks for it.

Issue #50: the requests go to the servers directly, never through sglang-router, which drops the
field (row 1: two real servers and the real router); a server older than routing needs (0.5.7) or
started without the flag is refused before any request (row 4); the compact wire format of SGLang's
newer source (uint8 / uint16, ``meta_info["routed_experts_dtype"]``) decodes by the dtype the answer
names, and the servers are started asking for the narrowest (row 7).

Issue #58 item 3: a multi-turn episode's final turn returns the routing of the whole episode (a
real server, its radix cache on)."""
import base64
import json

import numpy as np
import pytest
import torch

from megatron_tepo.rollout.sglang.client import FleetError
from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet, use_router
from megatron_tepo.rollout.sglang.options import ROUTED_EXPERTS_DTYPE_ENV, ServerConfig, server_command
from megatron_tepo.models import routing_shape_of
from megatron_tepo.rollout.sglang.routing import decode_routed_experts
from megatron_tepo.routing import RoutingShape
from tests.rollout.fake_sglang import FakeSGLang, routed_experts_b64, routed_experts_ids


def _config(tmp_path, **kw):
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
           "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "mlp_only_layers": [],
           "decoder_sparse_step": 1, **kw}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_the_routing_shape_is_the_model_familys(tmp_path):
    """#51 item 4: the routing contract has one maker, the model family's config; no engine reads a
    config.json of its own (the SGLang side once parsed mlp_only_layers / decoder_sparse_step, which the
    family refuses)."""
    assert routing_shape_of(_config(tmp_path)) == RoutingShape(4, (0, 1, 2, 3), 2, 8)
    with pytest.raises(NotImplementedError, match="mlp_only_layers"):  # (dense layers in the stack: refused)
        routing_shape_of(_config(tmp_path, mlp_only_layers=[1]))
    with pytest.raises(NotImplementedError, match="decoder_sparse_step"):
        routing_shape_of(_config(tmp_path, decoder_sparse_step=2))
    dense = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items()
             if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    (tmp_path / "config.json").write_text(json.dumps({**dense, "model_type": "qwen3"}))
    assert routing_shape_of(str(tmp_path)) is None
    with pytest.raises(ValueError, match="config.json: cannot read the model's config"):
        routing_shape_of(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"moe_layers=\(0, 4\) must be increasing layer indices in \[0, 4\)"):
        RoutingShape(4, (0, 4), 2, 8)


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


@pytest.mark.parametrize("wire", ["uint8", "uint16", "int32"])
def test_the_compact_wire_format_decodes_by_the_dtype_the_server_names(wire):
    """Row 7: SGLang's source after 0.5.23 (``srt/state_capturer/routed_experts_wire.py``) sends the
    ids cast to ``SGLANG_ROUTED_EXPERTS_DTYPE`` and names it in ``routed_experts_dtype``: the same
    ids come out, whichever dtype travelled (the old decoder read every answer as int32 and refused
    uint8 and uint16 as mis-sized). An unknown dtype, or bytes that are no whole number of ids, is an
    error naming the server."""
    shape = RoutingShape(4, (0, 2, 3), 2, 200)
    meta = {"routed_experts": routed_experts_b64(5, 4, 2, 200, wire_dtype=wire), "routed_experts_dtype": wire}
    want = torch.from_numpy(routed_experts_ids(5, 4, 2, 200)[:, [0, 2, 3]]).long()
    assert len(base64.b64decode(meta["routed_experts"])) == 5 * 4 * 2 * np.dtype(wire).itemsize
    out = decode_routed_experts(meta, 5, shape, "server X")
    assert out.dtype == torch.int16 and torch.equal(out.long(), want)
    with pytest.raises(ValueError, match=r"^server X returned routed experts in routed_experts_dtype='float32', "
                                         r"expected one of \['int32', 'uint16', 'uint8'\]"):
        decode_routed_experts({**meta, "routed_experts_dtype": "float32"}, 5, shape, "server X")
    if wire != "uint8":
        with pytest.raises(ValueError, match="^server X returned 39 bytes of routed experts, not a whole number"):
            decode_routed_experts({**meta, "routed_experts": base64.b64encode(b"x" * 39).decode()}, 5, shape,
                                  "server X")


def _fleet(fakes, shape):
    return SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=30, step_timeout=60,
                                   probe_interval=0.2, probe_timeout=1.0, routing=shape, routing_decoders=1))


def test_the_fleet_takes_the_compact_format_from_servers_that_send_it():
    """Row 7 through the fleet: one server sends uint8, the other SGLang 0.5.23's int32 (no
    ``routed_experts_dtype``): every sample carries the same ids."""
    shape = RoutingShape(4, (0, 2, 3), 2, 8)
    fakes = [FakeSGLang(routing=(4, 2, 8), wire_dtype="uint8"), FakeSGLang(routing=(4, 2, 8))]
    fleet = _fleet(fakes, shape)
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
        groups = fleet.generate(prompts, n=1, max_new_tokens=2)
        for prompt, (sample,) in zip(prompts, groups):
            want = routed_experts_ids(len(prompt) + 2 - 1, 4, 2, 8)[:, [0, 2, 3]]
            assert torch.equal(sample.routed_experts.long(), torch.from_numpy(want).long())
        assert all(f.bodies("/generate") for f in fakes)  # both formats were decoded
    finally:
        fleet.close()
        for f in fakes:
            f.close()


def test_a_routing_server_is_started_asking_for_the_narrowest_wire_dtype(tmp_path):
    """Row 7: the servers that return routing are started with SGLANG_ROUTED_EXPERTS_DTYPE, the
    narrowest dtype that holds the model's expert ids (a release without the compact format ignores
    it); the user's own setting stays; a server without routing gets none."""
    def env(experts=None, **kw):
        if experts is not None:
            (tmp_path / "config.json").write_text(json.dumps({"num_experts": experts}))
        cfg = ServerConfig(model_path=str(tmp_path), enable_return_routed_experts=True, **kw)
        return server_command(cfg, 30000, base_env={"PATH": "/bin"})[1]

    assert env()[ROUTED_EXPERTS_DTYPE_ENV] == "uint16"  # no config.json here: uint16 holds any real model's
    assert env(128)[ROUTED_EXPERTS_DTYPE_ENV] == "uint8" and env(256)[ROUTED_EXPERTS_DTYPE_ENV] == "uint8"
    assert env(512)[ROUTED_EXPERTS_DTYPE_ENV] == "uint16"
    assert env(128, env={ROUTED_EXPERTS_DTYPE_ENV: "int32"})[ROUTED_EXPERTS_DTYPE_ENV] == "int32"
    plain = server_command(ServerConfig(model_path=str(tmp_path)), 30000, base_env={"PATH": "/bin"})[1]
    assert ROUTED_EXPERTS_DTYPE_ENV not in plain


def test_routing_goes_to_the_servers_directly_never_through_sglang_router():
    """Row 1: with routing the fleet puts no router in front (sglang-router drops
    return_routed_experts); asking for the router with routing is refused in one line."""
    shape = RoutingShape(4, (0, 2, 3), 2, 8)
    assert not use_router(FleetConfig(router="auto", routing=shape), 8)
    with pytest.raises(ValueError, match=r"^FleetConfig.router=sglang_router \(rollout.router\) with routing replay "
                                         r"\(actor.routing_replay: r3\): sglang-router drops return_routed_experts"):
        use_router(FleetConfig(router="sglang_router", routing=shape), 8)
    from megatron_tepo.config import ConfigError, RunConfig, validate

    cfg = RunConfig()
    cfg.rollout.engine, cfg.rollout.router, cfg.actor.routing_replay = "sglang", "sglang_router", "r3"
    with pytest.raises(ConfigError, match="rollout.router: sglang_router drops return_routed_experts"):
        validate(cfg)


@pytest.mark.parametrize("version", ["0.5.6.post2", "fake"])
def test_a_server_older_than_routing_needs_is_refused_before_any_request(version):
    """Row 4: each server's /server_info version is read when the fleet attaches; one older than
    0.5.7 (or of no version that can be read) is refused in one line naming it, the setting and
    the minimum, before any request; 0.5.7 serves."""
    fakes = [FakeSGLang(routing=(4, 2, 8)), FakeSGLang(routing=(4, 2, 8), version=version)]
    try:
        with pytest.raises(ValueError) as err:
            _fleet(fakes, RoutingShape(4, (0, 2, 3), 2, 8))
        msg = str(err.value)
        assert msg.startswith(f"SGLang server {fakes[1].url}: actor.routing_replay: r3 needs SGLang >= 0.5.7 "
                              f"(--enable-return-routed-experts), ") and "\n" not in msg, msg
        assert not any(f.bodies("/generate") for f in fakes)
    finally:
        for f in fakes:
            f.close()
    fake = FakeSGLang(routing=(4, 2, 8), version="0.5.7")
    fleet = _fleet([fake], RoutingShape(4, (0, 2, 3), 2, 8))
    try:
        assert fleet.generate([[1, 2, 3]], n=1, max_new_tokens=2)[0][0].routed_experts.shape == (4, 3, 2)
    finally:
        fleet.close()
        fake.close()


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
        assert fleet.cfg.server.enable_return_routed_experts  # (the servers it launches start with the flag)
    finally:
        fleet.close()
        for f in fakes:
            f.close()


def test_a_server_that_does_not_return_the_routing_is_an_error_naming_it():
    fake = FakeSGLang()  # started without --enable-return-routed-experts: refused when the fleet attaches
    with pytest.raises(ValueError, match=rf"^SGLang server {fake.url} runs without --enable-return-routed-experts, "
                                         r"which actor.routing_replay: r3 needs"):
        _fleet([fake], RoutingShape(4, (0, 2, 3), 2, 8))
    fake.close()
    # one that says it runs with the flag and answers without them (a server that reports no such argument)
    fake = FakeSGLang(info={"enable_return_routed_experts": True})
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


def _tiny_moe(path):
    """A tiny random Qwen3-MoE (2 layers, 8 experts, top-2), saved in ``path``; the HF model."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                                      mlp_only_layers=[], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def moe_servers(sglang_python, tmp_path_factory):
    """Two real SGLang 0.5.23 CPU servers on the tiny MoE, started as the launchers start them
    (--enable-return-routed-experts, one API key for the job), and the HF model."""
    from megatron_tepo.rollout.sglang.server import launch_server, stop_server, wait_ready

    path = tmp_path_factory.mktemp("moe")
    model = _tiny_moe(path)
    cfg = ServerConfig(model_path=str(path), python=sglang_python, dtype="float32", startup_timeout=600,
                       enable_return_routed_experts=True, log_dir=str(tmp_path_factory.mktemp("logs")))
    servers = []
    try:
        servers = [launch_server(cfg, i, "job-key") for i in range(2)]
        wait_ready(servers, cfg.startup_timeout)
        yield cfg, servers, model
    finally:
        for s in servers:
            stop_server(s)


@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_routing_over_two_real_servers_and_sglang_router_reaches_the_batch(moe_servers):
    """Row 1. The trainer's fleet over two servers, with rollout.router: auto in a venv that has
    sglang-router: before #50 it put the router in front and step 1 failed (the router forwards its
    own typed request, without return_routed_experts). Now the requests go to the servers directly:
    every sample carries its routing, equal to what a server answers the same request sent to it
    directly, and RolloutBatch.from_groups puts it in the batch. The real router, in front of the
    same servers, still drops the field (what would tell us that a newer one passes it on). The
    servers' version (0.5.23) passes the fleet's check (row 4), and each reports its running-request
    limit (row 5)."""
    from megatron_tepo.batch import RolloutBatch
    from megatron_tepo.rollout.sglang.client import running_slots
    from megatron_tepo.rollout.sglang.fleet import parse_generate_output
    from megatron_tepo.rollout.sglang.router import launch_router
    from megatron_tepo.rollout.sglang.routing import ROUTING_REQUEST
    from megatron_tepo.rollout.sglang.server import stop_server

    cfg, servers, _ = moe_servers  # (the SGLang venv has sglang-router: launched below)
    shape = routing_shape_of(cfg.model_path)
    fleet = SGLangFleet(FleetConfig(urls=[s.url for s in servers], api_keys=["job-key"] * 2, router="auto",
                                    request_timeout=300, step_timeout=600, routing=shape, server=cfg))
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [3, 4]]
        groups = fleet.generate(prompts, n=1, max_new_tokens=3, temperature=1e-5)  # (near-greedy)
        assert fleet.router is None and all(s.served > 0 for s in fleet.servers)  # both served, directly
        sampling = {"n": 1, "temperature": 1e-5, "top_p": 1.0, "top_k": -1, "max_new_tokens": 3,
                    "stop_token_ids": [], "ignore_eos": True, "skip_special_tokens": False}  # (the fleet's)
        for i, (prompt, (sample,)) in enumerate(zip(prompts, groups)):
            payload = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True,
                       "logprob_start_len": -1, **ROUTING_REQUEST}
            direct = parse_generate_output(servers[i % 2].post("/generate", payload, timeout=300), shape, "direct")
            assert sample.token_ids == direct.token_ids
            assert torch.equal(sample.routed_experts, direct.routed_experts), (sample.routed_experts, direct)
        batch = RolloutBatch.from_groups(prompts, groups, pad_id=0)
        for row, (prompt, (sample,)) in enumerate(zip(prompts, groups)):
            n = len(prompt) + len(sample.token_ids) - 1
            assert torch.equal(batch.routed_experts[row, :n].to(sample.routed_experts.dtype), sample.routed_experts)
        for s in fleet.servers:  # rows 4 and 5: what the fleet reads of a real 0.5.23 server
            info = s.server_info()
            assert info["version"] == "0.5.23" and info["enable_return_routed_experts"] is True
            limit = running_slots(info)
            assert limit == info["internal_states"][0]["effective_max_running_requests_per_dp"] and limit > 0
    finally:
        fleet.close()
    router = launch_router(cfg, servers, "round_robin", 300)
    try:
        out = router.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2},
                                        **ROUTING_REQUEST}, timeout=300)
        out = out[0] if isinstance(out, list) else out
        assert out["meta_info"].get("routed_experts") is None, "sglang-router passed the routing on: see fleet.py"
    finally:
        stop_server(router)


@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_a_real_sglang_cpu_server_returns_the_routing_of_a_tiny_moe(moe_servers):
    """A real SGLang 0.5.23 CPU server on a tiny random Qwen3-MoE (2 layers, 8 experts, top-2),
    started with --enable-return-routed-experts: the fleet asks every request for the routing and
    decodes it. The experts are those of SGLang's own forward: each id in range, one per slot, the
    two slots of a position distinct, the same for the same prompt, HF's router's but for near ties."""
    cfg, servers, model = moe_servers
    shape = routing_shape_of(cfg.model_path)
    assert shape == RoutingShape(2, (0, 1), 2, 8)
    fleet = SGLangFleet(FleetConfig(urls=[servers[0].url], api_keys=["job-key"], router="none", request_timeout=300,
                                    step_timeout=600, routing=shape, server=cfg))
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


@pytest.mark.parametrize("decoders", [2, 0])
def test_the_routed_answers_are_parsed_and_decoded_off_the_request_threads(monkeypatch, decoders):
    """#56 row 10: r3's answers (about 10 GB of base64 JSON a 30B-A3B step on a released SGLang,
    int32) are parsed and their routing decoded in the fleet's decoder processes, which hand back
    the ids in the contract's narrow dtype: no thread of the driver runs ``json.loads`` of a routed
    answer or the base64 decode, which hold the GIL. (Before, the request threads did both, as they
    still do with ``routing_decoders: 0``, the case that shows the check sees them.)"""
    import base64 as b64
    import threading

    seen = []
    real_loads, real_b64 = json.loads, b64.b64decode

    def loads(s, *a, **kw):
        if '"routed_experts"' in (s.decode("utf-8", "replace") if isinstance(s, (bytes, bytearray)) else str(s)):
            seen.append(("json.loads", threading.current_thread().name))
        return real_loads(s, *a, **kw)

    def b64decode(s, *a, **kw):
        seen.append(("b64decode", threading.current_thread().name))
        return real_b64(s, *a, **kw)

    monkeypatch.setattr(json, "loads", loads)
    monkeypatch.setattr(b64, "b64decode", b64decode)
    shape = RoutingShape(4, (0, 2, 3), 2, 8)
    fakes = [FakeSGLang(routing=(4, 2, 8), wire_dtype="uint8"), FakeSGLang(routing=(4, 2, 8))]
    fleet = SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=60, step_timeout=120,
                                    probe_interval=600, routing=shape, routing_decoders=decoders))
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
        groups = fleet.generate(prompts, n=2, max_new_tokens=2)
        for prompt, group in zip(prompts, groups):
            want = torch.from_numpy(routed_experts_ids(len(prompt) + 2 - 1, 4, 2, 8)[:, [0, 2, 3]]).long()
            assert len(group) == 2
            assert all(s.routed_experts.dtype == torch.int8 and torch.equal(s.routed_experts.long(), want)
                       for s in group)
    finally:
        fleet.close()
        for f in fakes:
            f.close()
    if decoders:
        assert seen == [], seen
    else:
        assert {what for what, _ in seen} == {"json.loads", "b64decode"}, seen


def test_a_routing_decoder_that_dies_is_replaced():
    """A decoder process killed (the OOM killer, say) costs no answer: the one in hand is read on its
    thread, said once, and the next starts a new process; after MAX_DECODER_DEATHS every answer is
    read on its thread. A decoder is a plain subprocess: it runs nothing of the driver's __main__."""
    import os
    import signal

    from megatron_tepo.rollout.sglang.routing import MAX_DECODER_DEATHS, RoutingDecoder

    shape = RoutingShape(4, (0, 2, 3), 2, 8)
    body = json.dumps({"output_ids": [7, 8], "meta_info": {"prompt_tokens": 3, "finish_reason": {"type": "length"},
                                                           "routed_experts": routed_experts_b64(4, 4, 2, 8)}}).encode()
    want = routed_experts_ids(4, 4, 2, 8)[:, [0, 2, 3]]
    decoder = RoutingDecoder(shape, 1)
    try:
        assert np.array_equal(decoder.read(body, "x")["meta_info"]["routed_experts"], want)
        for death in range(1, MAX_DECODER_DEATHS + 1):
            (proc,) = decoder._procs
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            for _ in range(2):
                got = decoder.read(body, "x")["meta_info"]["routed_experts"]
                assert got.dtype == np.int8 and np.array_equal(got, want)
            assert decoder.deaths == death and proc not in decoder._procs
        assert decoder._procs == []  # (given up: read on the threads)
        with pytest.raises(ValueError, match="Expecting value"):
            decoder.read(b"<html>", "x")
    finally:
        decoder.close()


@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_a_real_sglang_server_returns_an_episodes_whole_routing_with_its_final_turn(moe_servers):
    """#58 item 3 on a real SGLang 0.5.23 CPU server: three-turn episodes (two environment answers)
    through the episode engine, each turn one request over the whole episode so far (its prefix from
    the server's radix cache where that holds it). The episode's sample carries the final turn's
    routing, one entry for every position but the last: HF's router's on the whole sequence but for
    near ties, in the earlier turns and the answers as in the final turn; with its routers forced to
    it, HF scores the model's tokens at the server's log-probs within 1e-4 (float32 on both sides;
    read here: within 5e-7), and forced to other experts it does not."""
    import sys
    from pathlib import Path

    from megatron_tepo.rollout.episode import EpisodeEngine, EpisodeLimits, TurnFormat
    from tests.rollout.test_episode_routing import ThreeTurns, _forward

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "tiny_tir"))
    import tir

    cfg, servers, model = moe_servers
    shape = routing_shape_of(cfg.model_path)
    fleet = SGLangFleet(FleetConfig(urls=[servers[0].url], api_keys=["job-key"], router="none", request_timeout=300,
                                    step_timeout=600, routing=shape, server=cfg))
    tok = tir.hf_tokenizer()  # (ids < 32 < the tiny MoE's 256: its chat template around the answers)
    engine = EpisodeEngine(fleet, ThreeTurns(), TurnFormat(tok, tir.EOS), EpisodeLimits(max_turns=3, max_turn_tokens=4))
    prompts = [tir.prompt_ids(tok, "37*45"), tir.prompt_ids(tok, "12*3")]
    try:
        groups = engine.generate(prompts, n=2, temperature=1.0, max_new_tokens=80, stop_token_ids=[tir.EOS])
    finally:
        engine.close()
    agree = {"earlier turns and answers": [], "final turn": []}
    for prompt, group in zip(prompts, groups):
        for s in group:
            assert s.meta["episode"]["turns"] == 3 and 0 in s.loss_mask, s.meta
            seq = prompt + s.token_ids
            assert s.routed_experts.shape == (len(seq) - 1, 2, 2), s.routed_experts.shape
            _, hf, _ = _forward(model, seq, topk=2)
            same = (hf[:-1] == s.routed_experts.long().sort(-1).values).all(-1).all(-1)
            last_answer = len(prompt) + max(i for i, m in enumerate(s.loss_mask) if not m)
            agree["earlier turns and answers"] += same[len(prompt):last_answer + 1].tolist()
            agree["final turn"] += same[last_answer + 1:].tolist()
            own = torch.tensor(s.loss_mask, dtype=torch.bool)
            forced, _, _ = _forward(model, seq, forced=s.routed_experts, topk=2)
            assert float((forced[len(prompt) - 1:][own] - torch.tensor(s.log_probs)[own]).abs().max()) < 1e-4
            shuffled, _, _ = _forward(model, seq, forced=(s.routed_experts.long() + 1) % 8, topk=2)  # (must show)
            assert float((shuffled[len(prompt) - 1:][own] - torch.tensor(s.log_probs)[own]).abs().max()) > 1e-3
    for part, same in agree.items():  # (fp32 on both sides: a disagreement is a near tie)
        assert len(same) > 0 and sum(same) / len(same) >= 0.9, (part, sum(same), len(same))
