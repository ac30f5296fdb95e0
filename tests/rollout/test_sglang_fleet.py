"""A fleet of REAL SGLang CPU servers (tiny local Qwen3): groups, weight sync in three modes,
a server killed mid-step, and every server gone; each server's API key required and on no command
line. Two servers are started once for the module; the fault tests come last because they destroy
them."""
import time
from pathlib import Path

import pytest
import torch

from megatron_tepo.rollout.engine import FINISH_LENGTH, FINISH_STOP, Request, SamplingParams
from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
from megatron_tepo.rollout.sglang.client import FleetError, RequestFailed
from megatron_tepo.rollout.sglang.server import ServerConfig
from megatron_tepo.algorithms.drift import DriftCheck
from megatron_tepo.rollout.sglang.weight_sync import TensorSync, make_weight_sync
from tests.rollout.helpers import (VOCAB, cmdlines, cut_mid_response, error_with_all_servers_hung,
                                   hf_response_log_probs, kill_during_step, save_tiny_qwen3, tiny_qwen3)

pytestmark = pytest.mark.sglang
SCALE = 0.07  # weights small enough that a bf16 server is within 2e-2 of float32 (bf16 error grows with the logits)
SEQ = [5, 17, 33, 40, 41, 42, 43, 44, 45, 46, 47, 48]
PROMPT_LEN = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    save_tiny_qwen3(str(path), seed=0, scale=SCALE)
    return str(path)


@pytest.fixture(scope="module")
def fleet(sglang_python, model_dir, tmp_path_factory):
    cfg = FleetConfig(num_servers=2, request_timeout=60, step_timeout=120,
                      router="none",  # test_sglang_router.py: routed
                      server_restarts=0,  # the fleet shrinks here; restarts: test_fleet_recovery.py
                      server=ServerConfig(model_path=model_dir, python=sglang_python, startup_timeout=240,
                                          log_dir=str(tmp_path_factory.mktemp("sglang_logs"))))
    f = SGLangFleet(cfg)
    yield f
    f.close()


def test_servers_are_keyed_and_local(fleet):
    """Every server requires its own random API key, and the key is on no command line: not in
    ``/proc/<pid>/cmdline`` of the server or of any process it starts (scheduler, detokenizer), nor
    in its start-up log. It reaches SGLang through the environment (``TEPO_SGLANG_API_KEY``, read
    inside the server by megatron_tepo/rollout/sglang/launch.py)."""
    import requests

    assert len(fleet.servers) == 2
    assert len({s.api_key for s in fleet.servers}) == 2  # one key each (no router to share one)
    body = {"input_ids": [5, 17, 33], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    for s in fleet.servers:
        key = s.api_key
        assert s.url.startswith("http://127.0.0.1:") and key and len(key) >= 32 and s.pid
        seen = cmdlines(s.pid)
        assert len(seen) >= 2, seen  # the launcher and SGLang's scheduler process at least
        for pid, cmd in seen.items():
            assert key not in cmd and "--api-key" not in cmd, (pid, cmd)
        assert any("rollout/sglang/launch.py" in c for c in seen.values()), seen
        assert requests.get(s.url + "/health", timeout=30).status_code == 200  # probes need no key
        for headers in ({}, {"Authorization": "Bearer wrong"}):  # no key, a wrong one: refused
            assert requests.post(s.url + "/generate", json=body, headers=headers, timeout=60).status_code == 401
        ok = requests.post(s.url + "/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2, ok.text[:300]
        log = Path(s.log_path).read_text(errors="replace")
        assert "server_args=" in log and key not in log, log[-LONG:]


def test_generate_groups(fleet):
    prompts = [[5, 17, 33], [9], [100, 101, 102, 103]]
    groups = fleet.generate(prompts, n=3, temperature=0.7, max_new_tokens=6)
    assert len(groups) == 3 and all(len(g) == 3 for g in groups)
    model = tiny_qwen3(seed=0, scale=SCALE)
    for p, g in zip(prompts, groups):
        for s in g:
            assert len(s.token_ids) == len(s.log_probs) == 6 and s.finish_reason == FINISH_LENGTH
            assert all(0 <= t < VOCAB for t in s.token_ids)
            # the engine's log-probs are those of logits / T (bf16 server vs float32 reference)
            ref = hf_response_log_probs(model, p + s.token_ids, len(p), temperature=0.7)
            assert torch.allclose(torch.tensor(s.log_probs), ref, atol=5e-2), (s.log_probs, ref)
    assert all(s.served > 0 for s in fleet.servers)  # spread over both servers


def test_stop_tokens(fleet):
    stop = list(range(0, VOCAB, 2))
    groups = fleet.generate([[5, 17, 33], [9, 8]], n=4, temperature=1.0, max_new_tokens=16, stop_token_ids=stop)
    seen = set()
    for g in groups:
        for s in g:
            seen.add(s.finish_reason)
            if s.finish_reason == FINISH_STOP:
                assert s.token_ids[-1] in stop and not any(t in stop for t in s.token_ids[:-1])
    assert FINISH_STOP in seen


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_weight_sync_modes_single_process(fleet, mode, tmp_path):
    seed = {"tensor": 11, "distributed": 12, "disk": 13}[mode]
    new = tiny_qwen3(seed=seed, scale=SCALE)
    ref = hf_response_log_probs(new, SEQ, PROMPT_LEN)
    before = [torch.tensor(x) for x in fleet.score([SEQ] * 2, [PROMPT_LEN] * 2)]
    # distributed: bf16 on the wire, as the trainer sends (rollout.sync_dtype), and a first push of
    # other weights: the second is received straight into the parameters (CPU server patch 3)
    wire = torch.bfloat16 if mode == "distributed" else None
    own = {"shared_dir": str(tmp_path)} if mode == "disk" else {}
    ws = make_weight_sync(mode, fleet, bucket_bytes=100_000, wire_dtype=wire, **own)
    try:
        if mode == "distributed":
            ws.push(tiny_qwen3(seed=seed + 100, scale=SCALE).state_dict().items())
        stats = ws.push(new.state_dict().items())
    finally:
        ws.close()
    assert stats.tensors == len(new.state_dict()) and stats.buckets > 1
    assert stats.peak_bucket_bytes <= max(100_000, max(t.numel() * 4 for t in new.state_dict().values()))
    # each of the two requests goes to a different server (least-loaded): both were updated
    after = [torch.tensor(x) for x in fleet.score([SEQ] * 2, [PROMPT_LEN] * 2)]
    for b, a in zip(before, after):
        assert float((a - ref).abs().max()) < 2e-2, (mode, a, ref)
        assert float((b - ref).abs().max()) > 0.1  # clearly different before the sync
    drift = DriftCheck()(after, [ref, ref])
    assert drift["rollout/logprob_drift_max"] < 2e-2
    for s in fleet.servers:  # every server holds the new weights
        out = s.post("/generate", {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 0},
                                   "return_logprob": True, "logprob_start_len": PROMPT_LEN - 1})
        lp = torch.tensor([t[0] for t in out["meta_info"]["input_token_logprobs"][1:]])
        assert float((lp - ref).abs().max()) < 2e-2
        if mode == "distributed":  # ... and the second push went straight into its parameters
            assert "received straight into the parameters" in Path(s.log_path).read_text()


def test_weight_sync_from_tp2_actor(fleet, model_dir, tmp_path):
    """Actor at TP=2 (torchrun, 2 ranks) -> both servers, each mode: server == float32 reference of
    the actor's weights within 2e-2 (bf16 server), and clearly different before the sync."""
    import json

    from safetensors.torch import save_file

    from tests.dist_utils import REPO, torchrun

    new = tiny_qwen3(seed=21, scale=SCALE)
    new.config.to_json_file(str(tmp_path / "config.json"))
    save_file({k: v.contiguous() for k, v in new.state_dict().items()}, str(tmp_path / "actor.safetensors"))
    ref = hf_response_log_probs(new, SEQ, PROMPT_LEN)
    args = {"urls": [s.url for s in fleet.servers], "keys": [s.api_key for s in fleet.servers],
            "model_dir": model_dir, "weights": str(tmp_path / "actor.safetensors"),
            "config_dir": str(tmp_path), "modes": ["distributed", "tensor", "disk"], "seq": SEQ,
            "prompt_len": PROMPT_LEN, "bucket_bytes": 100_000, "shared_dir": str(tmp_path)}
    res = torchrun(REPO / "tests/rollout/sync_worker.py", 2, json.dumps(args), tmp_path=tmp_path, timeout=600)
    modes = res[0]["modes"]
    assert sorted(modes) == ["disk", "distributed", "tensor"]
    for mode, r in modes.items():
        assert r["tensors"] == len(new.state_dict()) and r["buckets"] > 1
        for before, after in zip(r["before"], r["after"]):
            assert float((torch.tensor(after) - ref).abs().max()) < 2e-2, (mode, after, ref)
            assert float((torch.tensor(before) - ref).abs().max()) > 0.1, mode


def test_sync_while_a_request_still_runs(fleet, tmp_path):
    """A request still running on a server (one that timed out on our side and was retried on
    another) made the cache flush of a sync fail with HTTP 400. The sync aborts it, updates,
    flushes and lets generation continue."""
    import threading

    s = fleet.servers[0]
    result = {}

    def long_request():  # 16 x 500 tokens: seconds of work for the CPU server
        result["out"] = s.post("/generate", {"input_ids": SEQ[:PROMPT_LEN], "sampling_params": {
            "max_new_tokens": 500, "ignore_eos": True, "temperature": 1.0, "n": 16}}, timeout=300)

    def start():
        t = threading.Thread(target=long_request, daemon=True)
        t.start()
        return t

    # the fault, reproduced: a flush while it runs is refused with HTTP 400
    t, refused = start(), None
    deadline = time.monotonic() + 30
    while refused is None and t.is_alive() and time.monotonic() < deadline:
        try:
            s.post("/flush_cache", {})
            time.sleep(0.05)
        except RequestFailed as e:
            refused = str(e)
    assert refused and "HTTP 400" in refused, "the request finished before a flush was refused"
    t.join(300)
    # the same situation during a weight sync: the sync goes through
    new = tiny_qwen3(seed=33, scale=SCALE)
    t = start()
    time.sleep(0.5)
    ws = TensorSync(fleet)
    ws.push(list(new.state_dict().items()))
    t.join(300)
    assert not t.is_alive()
    finish = [o["meta_info"]["finish_reason"] for o in result["out"]]
    assert all(f["type"] in ("abort", "length") for f in finish) and any(f["type"] == "abort" for f in finish)
    ref = hf_response_log_probs(new, SEQ, PROMPT_LEN)
    for got in fleet.score([SEQ] * 2, [PROMPT_LEN] * 2):  # both servers have the new weights
        assert float((torch.tensor(got) - ref).abs().max()) < 2e-2
    groups = fleet.generate([[5, 17]], n=2, max_new_tokens=4)  # generation continues
    assert len(groups[0]) == 2 and all(len(x.token_ids) == 4 for x in groups[0])

LONG = 480  # response tokens (the tiny model's context is 512)


def _close(server, reference) -> bool:
    """A bf16 server's log-probs against the float32 model's: within 1e-2 on average, 5e-2 at most."""
    d = (torch.tensor(server) - reference).abs()
    return float(d.mean()) < 1e-2 and float(d.max()) < 5e-2


def test_a_response_interrupted_by_a_weight_update_resumes_token_for_token(fleet, tmp_path):
    """Partial rollout on real servers: requests cut by an interrupt come back with their tokens and
    log-probs (weights A's), the update is refused while any generates, and after the update (B)
    each resumes from prompt + partial: its continuation is B's (log-probs and, greedy, tokens)."""
    a, b = tiny_qwen3(seed=0, scale=SCALE), tiny_qwen3(seed=21, scale=SCALE)
    fleet.update_weights(a.state_dict().items())
    prompt = [5, 17, 33]
    sampled = cut_mid_response(fleet, Request(prompt, LONG, key="sampled"), SamplingParams(max_new_tokens=LONG))
    greedy = cut_mid_response(fleet, Request(prompt, LONG, key="greedy"),
                               SamplingParams(temperature=1e-7, max_new_tokens=LONG))
    cut = len(sampled.token_ids)
    ref_a = hf_response_log_probs(a, prompt + sampled.token_ids, len(prompt))
    assert _close(sampled.log_probs, ref_a)  # A's, token by token

    fleet.submit([Request(prompt, LONG, key="probe")], SamplingParams(max_new_tokens=LONG))
    with pytest.raises(RuntimeError, match="interrupt"):  # nothing generates under weights being written
        fleet.update_weights(b.state_dict().items())
    assert [r.key for r, _ in fleet.interrupt()] == ["probe"]
    fleet.update_weights(b.state_dict().items())

    fleet.submit([sampled], SamplingParams(temperature=1.0, max_new_tokens=LONG))
    fleet.submit([greedy], SamplingParams(temperature=1e-7, max_new_tokens=LONG))
    done, end = {}, time.monotonic() + 300
    while len(done) < 2:
        assert time.monotonic() < end, "the resumed requests did not finish"
        for r, seg in fleet.collect(timeout=1.0):
            assert seg.finish_reason == FINISH_LENGTH
            done[r.key] = (len(r.token_ids), seg)
            r.extend(seg, version=2)
    assert len(sampled.token_ids) == LONG and sampled.versions == [1] * cut + [2] * (LONG - cut)
    ref_b = hf_response_log_probs(b, prompt + sampled.token_ids, len(prompt))
    ref_a_all = hf_response_log_probs(a, prompt + sampled.token_ids, len(prompt))
    assert _close(sampled.log_probs[cut:], ref_b[cut:]) and _close(sampled.log_probs[:cut], ref_a_all[:cut])
    assert float((torch.tensor(sampled.log_probs[cut:]) - ref_a_all[cut:]).abs().mean()) > 0.1  # ... not A's
    # token for token: the greedy continuation is what B generates from prompt + partial
    g_cut, g_seg = done["greedy"]
    fresh = fleet.generate([prompt + greedy.token_ids[:g_cut]], n=1, temperature=1e-7, max_new_tokens=LONG - g_cut)
    assert g_seg.token_ids == fresh[0][0].token_ids and len(greedy.token_ids) == LONG


class _Recorder:
    """The fleet, recording the prompt of every turn it is sent and the ids it returns."""

    def __init__(self, fleet):
        self.fleet, self.sent, self.returned = fleet, [], []

    def __getattr__(self, name):
        return getattr(self.fleet, name)

    def submit(self, requests, params):
        self.sent += [list(r.prompt) for r in requests]
        self.fleet.submit(requests, params)

    def collect(self, timeout=0.0):
        out = self.fleet.collect(timeout)
        self.returned += [list(s.token_ids) for _, s in out]
        return out


def test_a_two_turn_episode_with_its_tool_call_in_the_sandbox(fleet):
    """#52's acceptance on real servers: a two-turn episode whose tool call runs in the bubblewrap
    sandbox. Each turn is sent exactly the episode's ids so far and exactly the ids the server
    returned are kept; the tool's answer is the chat template's tool turn (masked); the model's
    tokens' log-probs equal the float32 model's within the single-turn tests' bound."""
    import sys

    from megatron_tepo.environments import Environment, Reply, SandboxConfig, make_sandbox
    from megatron_tepo.environments.python_tool import render_result
    from megatron_tepo.rollout.episode import EpisodeEngine, EpisodeLimits, TurnFormat
    from tests.environments.conftest import require_bwrap

    require_bwrap()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "tiny_tir"))
    import tir

    class OneCall(Environment):  # the first turn calls the tool (whatever it says), the second ends
        name = "one-call"

        def __init__(self):
            self.sandbox = make_sandbox(SandboxConfig(wall_seconds=60, cpu_seconds=10))

        def respond(self, turn, turn_index):
            if turn_index:
                return Reply(done=True)
            result = self.sandbox.run("print(6 * 7)")
            return Reply(done=False, message=render_result(result), tool_calls=1, tool_errors=not result.ok)

    model = tiny_qwen3(seed=0, scale=SCALE)
    fleet.update_weights(model.state_dict().items())
    tok = tir.hf_tokenizer()  # (ids < 32 < the tiny model's 256: its chat template around the tool's answer)
    fmt = TurnFormat(tok, tir.EOS)
    recorder = _Recorder(fleet)
    engine = EpisodeEngine(recorder, OneCall(), fmt, EpisodeLimits(max_turns=2, max_turn_tokens=6))
    prompt = tir.prompt_ids(tok, "6*7")
    try:
        (group,) = engine.generate([prompt], n=1, temperature=1.0, max_new_tokens=64, stop_token_ids=[tir.EOS])
    finally:
        engine.env.close()
    s = group[0]
    turn1, turn2 = recorder.returned
    # the environment's ids: the tool's answer, after the end-of-turn token when turn 1 was cut at its cap
    answer = ([] if turn1[-1:] == [tir.EOS] else [tir.EOS]) + fmt.answer_ids("42")
    assert recorder.sent == [prompt, prompt + turn1 + answer]  # token in: the ids so far, exactly
    assert s.token_ids == turn1 + answer + turn2  # token out: exactly what the server returned
    assert s.loss_mask == [1] * len(turn1) + [0] * len(answer) + [1] * len(turn2)
    assert s.meta["episode"]["messages"] == ["42"] and s.meta["episode"]["tool_errors"] == 0
    ref = hf_response_log_probs(model, prompt + s.token_ids, len(prompt))
    own = torch.tensor(s.loss_mask, dtype=torch.bool)
    assert _close(torch.tensor(s.log_probs)[own].tolist(), ref[own])


# ---------------------------------------------------------------- faults (destroy the fleet: last)
def test_server_killed_mid_step(fleet):
    victim = fleet.servers[0]

    def wait_for_victim(step):  # kill the victim while it holds requests (a loaded CI machine
        deadline = time.monotonic() + 60  # can be slow to start)
        while victim.inflight == 0 and step.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert victim.inflight > 0, "no request reached the victim while the step ran"

    kill_during_step(fleet, victim, wait_for_victim, join_timeout=180)
    assert not victim.alive and fleet.servers[1].alive
    assert "connection" in (victim.last_error or "").lower()


def test_all_servers_gone_clear_error_within_timeout(fleet):
    error_with_all_servers_hung(fleet)  # whatever the previous test left alive
    t0 = time.monotonic()
    with pytest.raises(FleetError, match="no SGLang server is left"):
        fleet.generate([[1, 2, 3]], n=1, max_new_tokens=4)
    assert time.monotonic() - t0 < 15.0

