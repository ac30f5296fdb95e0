"""Partial rollout (trainer/partial.py, the engines' submit / collect / interrupt): an interrupted
response resumes token for token, each token keeps the log-prob and version of the weights that
made it, the staleness bound regenerates what grows too old, a step takes complete groups in
drawing order, and the buffer's snapshot continues exactly. In-process, with the embedded engine."""
import time

import pytest
import torch

from megatron_tepo.batch import RolloutBatch
from megatron_tepo.config import ConfigError, from_dict, validate
from megatron_tepo.rollout.embedded import EmbeddedEngine
from megatron_tepo.rollout.engine import FINISH_ABORT, FINISH_LENGTH, Request, Sample, SamplingParams
from megatron_tepo.trainer.partial import RolloutBuffer, staleness_metrics
from megatron_tepo.trainer.groups import GroupProducer, Task
from tests.rollout.helpers import cut_mid_response, tiny_qwen3

GREEDY = SamplingParams(temperature=1e-5, max_new_tokens=200)


def _collect_all(engine, count, timeout=120.0):
    got, end = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < end:
        got += engine.collect(timeout=0.5)
    assert len(got) == count, f"{len(got)} of {count} requests came back"
    return got


def _wait_for(condition, timeout=120.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _score(model, prompt, tokens):
    """log softmax(logits) of ``tokens`` after ``prompt`` under ``model`` (temperature 1e-5 makes the
    greedy token's log-prob 0: the versions are checked on the token ids, the log-probs at T=1)."""
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens])
        lp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return lp.gather(-1, ids[0, len(prompt):, None]).squeeze(-1)


def test_an_interrupted_response_resumes_as_prompt_plus_partial_plus_continuation():
    """Generated under weights A, interrupted, weights B written, resumed: the response is the
    partial one (A's tokens and log-probs) followed by what B generates from prompt + partial; each
    token's version names its weights; the update is refused while a request generates."""
    a, b = tiny_qwen3(seed=0), tiny_qwen3(seed=1)
    engine = EmbeddedEngine(tiny_qwen3(seed=0), seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=400)
    prompt = [3, 4, 5, 6]
    req = Request(prompt, 400, key="r")
    engine.submit([Request(prompt, 400, key="probe")], params)
    with pytest.raises(RuntimeError, match="interrupt"):  # nothing is generated under weights being written
        engine.update_weights(b.state_dict().items())
    assert [r.key for r, _ in engine.interrupt()] == ["probe"]
    cut_mid_response(engine, req, params, first_wait=0.2, timeout=120.0)
    cut = len(req.token_ids)
    assert 0 < cut < 400
    # the partial tokens' log-probs are A's (sampled at T=1: log softmax of A's logits)
    assert torch.allclose(torch.tensor(req.log_probs), _score(a, prompt, req.token_ids), atol=1e-4)

    engine.update_weights(b.state_dict().items())
    engine.submit([req], params)
    (back, seg2), = _collect_all(engine, 1)
    assert back is req and seg2.finish_reason == FINISH_LENGTH and len(seg2.token_ids) == 400 - cut
    req.extend(seg2, version=2)
    assert req.versions == [1] * cut + [2] * (400 - cut)
    # the continuation's log-probs are B's, given prompt + partial
    assert torch.allclose(torch.tensor(req.log_probs[cut:]), _score(b, prompt + req.token_ids[:cut], req.token_ids[cut:]),
                          atol=1e-4)
    # token for token: greedy, the continuation is what B generates from prompt + partial
    fresh = engine.generate([prompt + req.token_ids[:cut]], temperature=1e-5, max_new_tokens=400 - cut)[0][0]
    greedy = Request(prompt, 400, key="g", token_ids=list(req.token_ids[:cut]), log_probs=list(req.log_probs[:cut]),
                     versions=[1] * cut)
    engine.submit([greedy], SamplingParams(temperature=1e-5, max_new_tokens=400))
    (_, seg3), = _collect_all(engine, 1)
    assert seg3.token_ids == fresh.token_ids
    engine.close()


def test_interrupt_returns_queued_requests_untouched_and_nothing_runs_after():
    engine = EmbeddedEngine(tiny_qwen3(seed=0), seed=0, max_batch_size=1)
    reqs = [Request([3, 4], 400, key=i) for i in range(5)]
    engine.submit(reqs, SamplingParams(temperature=1.0, max_new_tokens=400))
    time.sleep(0.2)
    back = engine.interrupt()
    assert sorted(r.key for r, _ in back) == [0, 1, 2, 3, 4]  # each once
    assert all(s.finish_reason in (FINISH_ABORT, FINISH_LENGTH) for _, s in back)
    # one at a time, 2,000 tokens in all: the last ones were still queued (nothing generated)
    assert any(s.finish_reason == FINISH_ABORT and not s.token_ids for _, s in back)
    assert all(len(s.token_ids) == 400 for _, s in back if s.finish_reason == FINISH_LENGTH)
    assert engine.collect(timeout=0.5) == []  # nothing runs after the interrupt
    engine.update_weights(tiny_qwen3(seed=2).state_dict().items())  # allowed: nothing generates
    engine.close()




def _task(n_prompts=12, reward=None):
    prompts = [[3 + i % 7, 4 + i % 5, 5] for i in range(n_prompts)]
    # reward: 1 when the response's first token is even (half the samples, so groups are kept)
    reward = reward or (lambda responses, answers: [float(r[0] % 2 == 0) if r else 0.0 for r in responses])
    return Task(prompts, [str(i) for i in range(n_prompts)], reward, stop_token_ids=[])


def _cfg(**rollout):
    r = {"n_samples": 4, "prompts_per_step": 3, "max_new_tokens": 24, "temperature": 1.0, "partial_rollout": True,
         "max_staleness": 1, **rollout}
    cfg = from_dict({"rollout": r, "train": {"mini_batch_prompts": 3}})
    validate(cfg)
    return cfg


def test_a_step_takes_complete_groups_in_drawing_order_and_every_prompt_is_accounted_for(tmp_path):
    engine = EmbeddedEngine(tiny_qwen3(seed=0), seed=0)
    task, ledger = _task(), tmp_path / "ledger.jsonl"
    buf = RolloutBuffer(engine, GroupProducer(task, _cfg()), version=1, ledger=ledger)
    buf.start()
    trained = []
    for step in (1, 2, 3):
        prompts, groups, rewards, stats = buf.take(step)
        assert len(groups) == 3 and all(len(g) == 4 for g in groups) and rewards.shape == (12,)
        assert all(s.finish_reason == FINISH_LENGTH and len(s.token_ids) == 24 for g in groups for s in g)
        m = staleness_metrics(groups, step)
        assert m["staleness_max"] <= 1
        buf.pause()
        buf.resume(step + 1)
    buf.close()
    lines = [__import__("json").loads(x) for x in ledger.read_text().splitlines()]
    for line in lines:
        gids = [g for g, _ in line["trained"]]
        assert gids == sorted(gids)  # in the order their prompts were drawn
        trained += gids
    dropped = [g for line in lines for g, _ in line["dropped"]]
    held = set(buf.groups)
    assert len(trained) == len(set(trained)) == 9  # nothing trained twice
    assert set(trained) | set(dropped) | held == set(range(buf.next_gid))  # nothing lost
    assert not (set(trained) & set(dropped)) and not (set(trained) & held)


@pytest.mark.parametrize("staleness", [1, 2])
def test_the_default_in_flight_bound_regenerates_nothing(staleness, caplog):
    """The default ``rollout.max_inflight_groups`` is ``max(1, N) x prompts_per_step``: no group is
    drawn more than N steps before the step that trains it, so the bound never has to regenerate
    one (at the old default of 2 x, staleness 1 regenerated about half the samples of the long-tail
    benchmark). A larger setting is allowed, and said once in the log."""
    engine = EmbeddedEngine(tiny_qwen3(seed=0), seed=0)
    buf = RolloutBuffer(engine, GroupProducer(_task(), _cfg(max_staleness=staleness, dynamic_sampling=False)),
                        version=1)
    assert buf.max_groups == staleness * 3
    buf.start()
    for step in (1, 2, 3, 4):
        _, groups, _, _ = buf.take(step)
        assert staleness_metrics(groups, step)["staleness_max"] <= staleness
        buf.pause()
        assert buf.resume(step + 1)["stale_regenerated"] == 0
    buf.close()
    with caplog.at_level("WARNING", logger="megatron_tepo.trainer.partial"):
        RolloutBuffer(engine, GroupProducer(_task(), _cfg(max_staleness=staleness, max_inflight_groups=7)),
                      version=1).close()
    assert [r.getMessage() for r in caplog.records if "max_inflight_groups 7" in r.getMessage()]


def test_a_group_drawn_later_never_overtakes_an_earlier_one():
    """A step takes the groups drawn first, once complete: short responses that finish first do
    not jump the queue (that would bias training towards short answers)."""
    from megatron_tepo.trainer.partial import GroupState

    engine = EmbeddedEngine(tiny_qwen3(seed=0), seed=0)
    buf = RolloutBuffer(engine, GroupProducer(_task(), _cfg(prompts_per_step=3, max_inflight_groups=5)),
                        version=1)  # (not started)
    done = lambda gid: GroupState(gid, gid, [Request([3], 24)] * 4, ["length"] * 4, torch.zeros(4))  # noqa: E731
    buf.groups = {0: GroupState(0, 0, [Request([3], 24)] * 4, ["length", None, "length", "length"]),
                  **{g: done(g) for g in (1, 2, 3, 4)}}
    assert [g.gid for g in buf._head()] == [1, 2]  # group 0 is still generating: the step waits
    buf.groups[0] = done(0)
    assert [g.gid for g in buf._head()] == [0, 1, 2]
    buf.close()


def test_a_request_cut_as_it_ended_counts_as_finished():
    """An interrupt can answer after a request's last decode step (SGLang's abort does): a cut
    request with its stop token, or with no tokens left, is finished, never submitted again."""
    from megatron_tepo.trainer.partial import GroupState

    engine = EmbeddedEngine(tiny_qwen3(seed=0), seed=0)
    task = _task()
    task.stop_token_ids = [2]
    buf = RolloutBuffer(engine, GroupProducer(task, _cfg(prompts_per_step=3, max_new_tokens=4)),
                        version=1)  # (not started)
    reqs = [Request([3], 4, key=(0, k)) for k in range(4)]
    buf.groups = {0: GroupState(0, 0, reqs, [None] * 4)}
    buf._finished(reqs[0], Sample([5, 6, 7, 8], [-1.0] * 4, FINISH_ABORT))  # budget used up
    buf._finished(reqs[1], Sample([5, 2], [-1.0] * 2, FINISH_ABORT))  # its stop token
    buf._finished(reqs[2], Sample([5, 6], [-1.0] * 2, FINISH_ABORT))  # really cut
    assert buf.groups[0].finish[:3] == [FINISH_LENGTH, "stop", None] and reqs[2].interrupted == 1
    buf.close()


def test_the_staleness_bound_regenerates_samples_older_than_it():
    """A sample whose oldest token is older than ``version - max_staleness`` at an update starts
    again from its prompt (counted), its group kept; younger ones keep their tokens."""
    engine = EmbeddedEngine(tiny_qwen3(seed=0), seed=0)
    buf = RolloutBuffer(engine, GroupProducer(_task(), _cfg(max_staleness=1, max_inflight_groups=3)), version=1)
    buf.start()
    _wait_for(lambda: any(f for g in buf.groups.values() for f in g.finish))
    buf.pause()  # everything generated so far is version 1's
    held = {gid: [list(r.token_ids) for r in g.requests] for gid, g in buf.groups.items()}
    assert held and any(t for ts in held.values() for t in ts)
    counts = buf.resume(2)  # version 1 is 1 old at version 2: kept
    assert counts["stale_regenerated"] == 0
    buf.pause()
    before = {gid: [list(r.versions) for r in g.requests] for gid, g in buf.groups.items()}
    with_v1 = sum(1 for vs in before.values() for v in vs if v and min(v) == 1)
    counts = buf.resume(3)  # now version 1 is 2 old: regenerated
    assert counts["stale_regenerated"] == with_v1 > 0
    snap = buf.snapshot()
    for d in snap["groups"]:
        for r in d["requests"]:
            assert not r["versions"] or min(r["versions"]) >= 2
    assert sorted(d["gid"] for d in snap["groups"]) == sorted(before)  # the groups stay
    buf.close()


def test_the_snapshot_continues_the_same_groups_with_their_partial_responses():
    engine = EmbeddedEngine(tiny_qwen3(seed=0), seed=0)
    cfg = _cfg(max_new_tokens=400, max_inflight_groups=3)
    buf = RolloutBuffer(engine, GroupProducer(_task(), cfg), version=1)
    buf.start()
    _wait_for(lambda: buf._inflight > 0)
    # Pause until an update lands mid-response: a fixed wait is no good (CI saw one land before the first
    # token on a busy machine; a quiet one generates all 400 tokens of the 12 requests in 0.4 s), so pause
    # at a short interval and go on under the same weights while nothing was cut yet; when every group
    # finished uncut in between, a step takes them and the buffer draws new ones.
    deadline, step = time.monotonic() + 120.0, 0
    while True:
        buf.pause()
        if any(g.finish[k] is None and r.token_ids for g in buf.groups.values() for k, r in enumerate(g.requests)):
            break
        assert time.monotonic() < deadline, "no pause landed mid-response"
        buf.resume(1)
        if all(g.complete for g in buf.groups.values()):
            step += 1
            buf.take(step)
        time.sleep(0.02)
    buf.resume(2)
    snap = buf.snapshot()
    buf.close()
    partial = [(d["gid"], k, r["token_ids"]) for d in snap["groups"] for k, r in enumerate(d["requests"])
               if d["finish"][k] is None and r["token_ids"]]
    assert partial, "nothing was cut mid-response"
    import io
    f = io.BytesIO()
    torch.save(snap, f)  # (what the checkpoint writes: read back with weights_only)
    f.seek(0)
    again = RolloutBuffer(engine, GroupProducer(_task(), cfg), version=2, snapshot=torch.load(f, weights_only=True))
    assert again.resumed_from_checkpoint == len(partial)
    for gid, k, tokens in partial:
        assert again.groups[gid].requests[k].token_ids == tokens
    assert again.next_gid == snap["next_gid"] and again.stream.state() == snap["stream"]
    again.close()


def test_the_batch_carries_each_tokens_version():
    groups = [[Sample([5, 6, 7], [-1.0, -2.0, -3.0], "stop", versions=[3, 3, 4]),
               Sample([8], [-0.5], "stop", versions=[4])]]
    batch = RolloutBatch.from_groups([[1, 2]], groups, pad_id=0)
    assert batch.policy_versions.tolist() == [[3, 3, 4], [4, 0, 0]]
    assert batch.rollout_log_probs.tolist() == [[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]]
    assert batch.select([1]).policy_versions.tolist() == [[4, 0, 0]]
    assert RolloutBatch.from_groups([[1, 2]], [[Sample([5], [-1.0], "stop")]], pad_id=0).policy_versions is None
    assert staleness_metrics(groups, 5) == {"staleness_mean": 1.5, "staleness_max": 2.0}


@pytest.mark.parametrize("rollout,message", [
    ({"max_staleness": 2}, "rollout.max_staleness: 2 needs rollout.partial_rollout: true"),
    ({"max_staleness": -1, "partial_rollout": True}, "rollout.max_staleness: expected an integer >= 0"),
    ({"partial_rollout": True, "colocated": True}, "rollout.partial_rollout: the engine generates while the actor"),
    ({"partial_rollout": True, "max_inflight_groups": 2, "prompts_per_step": 4}, "rollout.max_inflight_groups: 2"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(rollout, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(from_dict({"rollout": rollout, "train": {"mini_batch_prompts": 4}}))


@pytest.mark.sglang
@pytest.mark.slow
def test_tools_train_with_partial_rollout_on_a_real_server(tiny, tmp_path):
    """The composition: ``tools/train.py`` (the launchers' command) with ``rollout.engine: sglang``
    and partial rollout on a real SGLang CPU server. Every step trains on its 16 groups (the
    ledger), no token is older than the bound, and the checkpoint holds the buffer."""
    import json
    import os
    import subprocess
    import sys

    from megatron_tepo.rollout.sglang.server import ServerConfig, launch_server, stop_server, wait_ready
    from tests.rollout.conftest import require_sglang

    server = launch_server(ServerConfig(model_path=str(tiny / "model"), python=require_sglang(), startup_timeout=400,
                                        log_dir=str(tmp_path / "sglang_logs")), 0, None)
    out = tmp_path / "run"
    try:
        wait_ready([server], 400)
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TEPO_SGLANG_URLS": server.url,
               "TEPO_SGLANG_API_KEY": server.api_key or ""}
        cmd = [sys.executable, os.path.join(repo, "tools/train.py"), "--config",
               os.path.join(repo, "examples/tiny_tepo/config.yaml"), f"model.path={tiny / 'model'}",
               f"data.train_files=[{tiny / 'train.jsonl'}]", "reward.kind=exact_match", "rollout.engine=sglang",
               "rollout.partial_rollout=true", "rollout.max_staleness=1", "train.steps=3",
               "rollout.prompts_per_step=16", "rollout.n_samples=4", "train.mini_batch_prompts=16",
               "train.save_every=3", "train.export_hf=false", f"train.output_dir={out}"]
        proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=900)
    finally:
        stop_server(server)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["updates"] == 1.0 for r in rows)
    assert rows[0]["staleness_max"] == 0.0 and all(r["staleness_max"] <= 1.0 for r in rows)
    assert all(0.0 <= r["engine_idle_fraction"] <= 1.0 and r["tokens_per_s"] > 0 for r in rows)
    ledger = [json.loads(x) for x in (out / "checkpoints" / "rollout_ledger.jsonl").read_text().splitlines()]
    assert [len(e["trained"]) for e in ledger] == [16, 16, 16]
    trained = [g for e in ledger for g, _ in e["trained"]]
    assert len(set(trained)) == 48
    assert (out / "checkpoints" / "step_3" / "rollout_buffer.pt").exists()
