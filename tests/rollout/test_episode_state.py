"""Episodes with state (#58 item 4-5): an environment opens each episode from its data row, keeps its
state in the request's episode record (so an interrupt and a resume in a fresh engine, as after
``kill -9``, carry it), gives rewards per turn and for the episode, and every episode ends with a
reason; a sandbox failure is never the model's. Scripted engines as in test_episode.py."""
import io
import re
import threading

import pytest
import torch

from megatron_tepo.environments import Environment, Reply, ToolResult
from megatron_tepo.environments.guess_number import GuessNumber
from megatron_tepo.environments.python_env import PythonTool
from megatron_tepo.rollout.engine import FINISH_ABORT, Request, Sample, SamplingParams, from_state, to_state
from megatron_tepo.rollout.episode import EpisodeEngine, EpisodeLimits, TurnFormat, episode_metrics
from megatron_tepo.trainer.scoring import sandbox_failed, score_samples
from tests.rollout.test_episode import EOS, PROMPT, TOK, ScriptEngine, ids

FMT = TurnFormat(TOK, EOS)


def guesser(prompt):
    """The model: bisects 0..63, reading the environment's answers ("((": higher, "))": lower; the
    tiny tokenizer's vocabulary) from the ids."""
    text = TOK.decode(prompt[len(PROMPT):])
    lo, hi = 0, 63
    for guess, hint in re.findall(r"(\d+)<\|im_end\|>.*?<tool_response>\n(\(\(|\)\))\n", text, flags=re.S):
        lo, hi = (int(guess) + 1, hi) if hint == "((" else (lo, int(guess) - 1)
    return ids(str((lo + hi) // 2)) + [EOS]


def game():
    return GuessNumber(higher="((", lower="))")



def _ended_or_held(engine, n: int) -> dict:
    """Collect ``engine``'s episodes until each of the ``n`` has ended (``{key: sample}``, returned) or
    is held by its inner engine at its third turn (``engine.engine._held``)."""
    done = {}
    for _ in range(400):
        for r, s in engine.collect(timeout=0.05):
            r.extend(s, 0)
            done[r.key] = r.to_sample(s.finish_reason)
        if len(engine.engine._held) + len(done) == n:
            break
    return done

def test_64_episodes_each_with_its_own_state_survive_an_interrupt_and_a_resume_in_a_new_engine():
    secrets = [(7 * i + 3) % 64 for i in range(64)]
    rows = [{"prompt": "guess", "secret": s} for s in secrets]
    held = {"on": False}

    class Cut(ScriptEngine):  # turn 3 of every episode is held until the interrupt (it cuts it, empty)
        def submit(self, requests, params):
            for r in requests:
                if held["on"] and TOK.decode(r.prompt).count("<tool_response>") >= 2:
                    self._held.append(r)
                else:
                    super().submit([r], params)

    engine = EpisodeEngine(Cut(guesser), game(), FMT, EpisodeLimits(max_turns=8, tool_workers=8))
    params = SamplingParams(1, 1.0, 1.0, 400, [EOS])
    reqs = [Request(list(PROMPT), 400, key=i, episode={"row": r}) for i, r in enumerate(rows)]
    held["on"] = True
    engine.submit(reqs, params)
    done = _ended_or_held(engine, 64)
    assert 0 < len(done) < 64
    back = engine.interrupt()
    assert len(back) == 64 - len(done) and all(s.finish_reason == FINISH_ABORT for _, s in back)
    for r, s in back:
        r.extend(s, 0)
    # a checkpoint of the buffer (torch.save of the requests' state), read back by a new engine: kill -9
    buf = io.BytesIO()
    torch.save([to_state(r) for r, _ in back], buf)
    buf.seek(0)
    resumed = [from_state(Request, d) for d in torch.load(buf, weights_only=True)]
    assert all(r.episode["env"]["state"]["secret"] == secrets[r.key] for r in resumed)
    fresh = EpisodeEngine(ScriptEngine(guesser), game(), FMT, EpisodeLimits(max_turns=8, tool_workers=8))
    fresh.submit(resumed, params)
    finished = dict(done)
    for _ in range(400):
        for r, s in fresh.collect(timeout=0.05):
            r.extend(s, 1)
            finished[r.key] = r.to_sample(s.finish_reason)
        if len(finished) == 64:
            break
    assert len(finished) == 64
    for key, s in finished.items():
        env = s.meta["episode"]["env"]
        assert env["state"]["guesses"][-1] == secrets[key] and env["reward"] == 1.0, (key, env)
        assert s.meta["episode"]["end"] == "answered"
        # the state was the episode's own: every guess bisects towards its own secret
        assert len(env["state"]["guesses"]) == s.meta["episode"]["turns"]
    scores, _ = score_samples(lambda r, a: pytest.fail("the environment gave every reward"),
                              list(finished.values()), [""] * 64)
    assert scores == [1.0] * 64
    m = episode_metrics(finished.values())
    assert m["episode_end_answered"] == 1.0 and 0 < m["env_turn_reward_mean"] < 1


def bisect(secret, lo=0, hi=63):
    """The guesses of a binary search for ``secret`` in lo..hi (what :func:`guesser` plays)."""
    out = []
    while True:
        out.append((lo + hi) // 2)
        if out[-1] == secret:
            return out
        lo, hi = (out[-1] + 1, hi) if out[-1] < secret else (lo, out[-1] - 1)


def resuming_guesser(prompt):
    """:func:`guesser` for a turn that may have begun before an interrupt: the rest of its guess."""
    text = TOK.decode(prompt[len(PROMPT):])
    begun = text.rsplit("assistant\n", 1)[-1] if "<tool_response>" in text else text
    whole = guesser(prompt[:len(prompt) - len(ids(begun))] if begun else prompt)
    assert whole[:len(ids(begun))] == ids(begun), (begun, TOK.decode(whole))
    return whole[len(ids(begun)):]


class Opened(GuessNumber):
    """:class:`GuessNumber` that records the order its episodes are opened and finished in."""

    def __init__(self):
        super().__init__(higher="((", lower="))")
        self.log, self.lock = [], threading.Lock()

    def start(self, row, messages):
        with self.lock:
            self.log.append(("start", row["secret"]))
        return super().start(row, messages)

    def finish(self, state):
        with self.lock:
            self.log.append(("finish", state["secret"]))
        return super().finish(state)


SECRETS = [(37 * i + 11) % 64 for i in range(64)]  # (64 different secrets)


def _check_every_episode(finished):
    """Each episode ended with its own row's number, after the turns its own binary search takes,
    with the environment's reward (the task's is never asked)."""
    assert sorted(finished) == list(range(64))
    for key, s in finished.items():
        record = s.meta["episode"]
        want = bisect(SECRETS[key])
        assert record["env"]["state"] == {"secret": SECRETS[key], "guesses": want}, (key, record["env"])
        assert record["turns"] == len(want) and record["end"] == "answered" and record["env"]["reward"] == 1.0
        assert record["env"]["turn_rewards"] == [0.0] * (len(want) - 1) + [1.0]
    scores, _ = score_samples(lambda r, a: pytest.fail("the environment gave every reward"),
                              [finished[k] for k in range(64)], [""] * 64)
    assert scores == [1.0] * 64


def test_64_concurrent_episodes_of_the_game_each_keep_their_own_rows_state():
    """#58 acceptance, a stateful environment under 64 concurrent episodes: one environment serves
    them all (every episode opened before any ends), each row with another secret; every episode
    finds its own row's number by its own binary search (its turns, its guesses) and is rewarded by
    the environment."""
    env = Opened()
    engine = EpisodeEngine(ScriptEngine(guesser), env, FMT, EpisodeLimits(max_turns=8, tool_workers=8))
    groups = engine.generate([list(PROMPT)] * 64, n=1, max_new_tokens=400, stop_token_ids=[EOS],
                             rows=[{"prompt": "guess", "secret": s} for s in SECRETS])
    assert [kind for kind, _ in env.log[:64]] == ["start"] * 64  # 64 episodes open at once
    assert sorted(s for kind, s in env.log if kind == "finish") == sorted(SECRETS)  # each finished once
    _check_every_episode({i: g[0] for i, g in enumerate(groups)})
    assert len({len(bisect(s)) for s in SECRETS}) > 2  # (episodes of different lengths ran side by side)


def test_64_concurrent_episodes_cut_mid_guess_by_an_interrupt_and_resubmitted_stay_right():
    """Partial rollout: an interrupt (a weight update) cuts every episode's third turn, a two-digit
    guess after its first digit; the requests are submitted again to the same engine, which goes on
    with the second digit. Each episode's state is still its own: the environment read each cut guess
    whole and once (a half would be another number, or another turn), and every episode ends with its
    own row's number after the turns its binary search takes."""
    cut = {"on": True, "partial": 0}

    class CutThird(ScriptEngine):  # turn 3 of every episode waits for the interrupt, which cuts it
        def submit(self, requests, params):
            for r in requests:
                if cut["on"] and TOK.decode(r.prompt).count("<tool_response>") == 2:
                    self._held.append(r)
                else:
                    super().submit([r], params)

        def interrupt(self):
            out = list(self._done)
            for r in self._held:
                guess = resuming_guesser(list(r.prompt))
                half = guess[:1] if len(guess) > 2 else []  # (a two-digit guess loses its second digit)
                cut["partial"] += bool(half)
                out.append((r, Sample(half, [-0.5] * len(half), FINISH_ABORT)))
            self._done, self._held = [], []
            return out

    engine = EpisodeEngine(CutThird(resuming_guesser), GuessNumber(higher="((", lower="))"), FMT,
                           EpisodeLimits(max_turns=8, tool_workers=8))
    params = SamplingParams(1, 1.0, 1.0, 400, [EOS])
    reqs = [Request(list(PROMPT), 400, key=i, episode={"row": {"secret": s}}) for i, s in enumerate(SECRETS)]
    engine.submit(reqs, params)
    finished = _ended_or_held(engine, 64)
    back = engine.interrupt()
    assert len(back) == 64 - len(finished) > 0 and cut["partial"] > 0
    for r, s in back:
        r.extend(s, 0)
    cut["on"] = False
    assert all(r.episode["env"]["state"]["secret"] == SECRETS[r.key] for r, _ in back)
    engine.submit([r for r, _ in back], params)  # the same requests, as the rollout buffer resubmits them
    for _ in range(400):
        for r, s in engine.collect(timeout=0.05):
            r.extend(s, 1)
            finished[r.key] = r.to_sample(s.finish_reason)
        if len(finished) == 64:
            break
    _check_every_episode(finished)
    two_digit_third = [k for k in finished if len(bisect(SECRETS[k])) > 2 and bisect(SECRETS[k])[2] >= 10]
    assert two_digit_third and all(1 in finished[k].versions and 0 in finished[k].versions for k in two_digit_third)


class Counter(Environment):
    """A stateful environment: counts its episode's turns; a turn "0" ends it; gives no reward."""
    name = "counter"

    def __init__(self):
        self.finished = []

    def start(self, row, messages):
        return {"n": 0, "row": row.get("id"), "user": messages[0]["content"] if messages else None}

    def step(self, state, turn, turn_index):
        state["n"] += 1
        return Reply(done=turn == "0", message=str(state["n"]), tool_calls=1)

    def finish(self, state):
        self.finished.append(dict(state))
        return None


@pytest.mark.parametrize("script, limits, end", [
    (lambda p: ids("0") + [EOS], {}, "answered"),
    (lambda p: ids("1111"), {"max_turn_tokens": 2, "max_turns": 2}, "max_turns"),
    (lambda p: ids("1") + [EOS], {"max_turns": 2}, "max_turns"),
    (lambda p: ids("12341234123412341234") + [EOS], {}, "budget"),
])
def test_every_episode_ends_with_a_reason_and_the_environment_opens_and_finishes_it(script, limits, end):
    env = Counter()
    engine = EpisodeEngine(ScriptEngine(script), env, FMT, EpisodeLimits(**limits))
    (group,) = engine.generate([PROMPT], n=1, max_new_tokens=30 if end == "budget" else 200, stop_token_ids=[EOS],
                               rows=[{"id": "row-7", "prompt": "hello"}])
    record = group[0].meta["episode"]
    assert record["end"] == end, record
    assert env.finished and env.finished[0]["row"] == "row-7" and env.finished[0]["user"] == "hello"
    # with no environment reward, the task's reward scores the final turn
    scores, _ = score_samples(lambda r, a: [0.5] * len(r), group, ["x"])
    assert scores == [0.5]
    assert episode_metrics(group)[f"episode_end_{end}"] == 1.0


def test_a_turn_cut_at_its_cap_that_calls_nothing_ends_as_turn_cap():
    class Stops(Environment):
        def respond(self, turn, turn_index):
            return Reply(done=True)

    engine = EpisodeEngine(ScriptEngine(lambda p: ids("123412341234")), Stops(), FMT,
                           EpisodeLimits(max_turn_tokens=3))
    (group,) = engine.generate([PROMPT], n=1, max_new_tokens=24, stop_token_ids=[EOS])
    assert group[0].meta["episode"]["end"] == "turn_cap"


class FakeSandbox:
    def __init__(self, failed=False):
        self.failed, self.runs = failed, []

    def run(self, code, *, stdin=""):
        self.runs.append(code)
        if self.failed:
            return ToolResult("", "", None, 0.0, error="the sandbox service did not answer", sandbox_failed=True)
        return ToolResult("ok\n", "", 0, 0.01)

    def close(self):
        pass


CALL = ids("```python\nprint(1)\n```") + [EOS]


def test_max_calls_per_turn_runs_the_first_calls_and_tells_the_model():
    box = FakeSandbox()
    turn = "\n".join('<tool_call>{"name": "python", "arguments": {"code": "print(%d)"}}</tool_call>' % i for i in (1, 2, 3))
    reply = PythonTool(box, "qwen3", max_calls_per_turn=2).respond(turn, 0)
    assert box.runs == ["print(1)", "print(2)"] and reply.tool_calls == 2 and reply.capped_calls == 1
    assert "1 more tool call(s) in this turn were not run: at most 2" in reply.message


def test_a_sandbox_failure_is_counted_as_the_sandboxs_and_drops_the_group_or_fails_the_step():
    script = lambda p: CALL if p == PROMPT else ids("5") + [EOS]  # noqa: E731
    engine = EpisodeEngine(ScriptEngine(script), PythonTool(FakeSandbox(failed=True), "fenced"), FMT, EpisodeLimits())
    (group,) = engine.generate([PROMPT], n=2, max_new_tokens=64, stop_token_ids=[EOS])
    record = group[0].meta["episode"]
    assert record["end"] == "sandbox_failure" and record["tool_sandbox_failures"] == 1 and record["tool_errors"] == 0
    assert sandbox_failed(group)
    assert episode_metrics(group)["tool_sandbox_failures"] == 2.0
    failing = EpisodeEngine(ScriptEngine(script), PythonTool(FakeSandbox(failed=True), "fenced"), FMT,
                            EpisodeLimits(on_sandbox_failure="fail"))
    with pytest.raises(RuntimeError, match="the sandbox failed .*on_sandbox_failure is 'fail'"):
        failing.generate([PROMPT], n=1, max_new_tokens=64, stop_token_ids=[EOS])


def test_a_respond_only_environment_still_works_and_an_environment_that_cannot_start_is_named():
    class Bad(Environment):
        name = "bad"

        def start(self, row, messages):
            raise ValueError("no secret in the row")

    with pytest.raises(RuntimeError, match="environment bad: ValueError: no secret in the row"):
        EpisodeEngine(ScriptEngine(lambda p: ids("1") + [EOS]), Bad(), FMT).generate(
            [PROMPT], n=1, max_new_tokens=8, stop_token_ids=[EOS])


def test_an_environment_by_import_path_is_validated_in_the_config_and_built_with_its_args(tmp_path, monkeypatch):
    from megatron_tepo.config import ConfigError, from_dict
    from megatron_tepo.environments.choice import make_environment
    from megatron_tepo.environments.settings import SandboxConfig

    (tmp_path / "my_env.py").write_text(
        "from megatron_tepo.environments import Environment, Reply\n"
        "class Mine(Environment):\n"
        "    def __init__(self, level=1):\n"
        "        self.level = level\n"
        "    def step(self, state, turn, turn_index):\n"
        "        return Reply(done=True)\n"
        "class NotOne:\n"
        "    pass\n")
    monkeypatch.chdir(tmp_path)
    cfg = from_dict({"environment": {"name": "my_env.py:Mine", "args": {"level": 3}}})
    env = make_environment(cfg.environment.name, SandboxConfig(), args=cfg.environment.args)
    assert type(env).__name__ == "Mine" and env.level == 3
    assert from_dict({"environment": {"name": "guess_number"}}).environment.name == "guess_number"
    for name, message in [("my_env.py:NotOne", "environment.name: 'my_env.py:NotOne' is not a subclass of"),
                          ("my_env.py:Gone", "environment.name: 'my_env.py' has no 'Gone'"),
                          ("pythn", "environment.name: expected one of none, python, python_session")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            from_dict({"environment": {"name": name}})
    with pytest.raises(ValueError, match=re.escape("environment.args: my_env.py:Mine: got an unexpected keyword "
                                                   "argument 'speed'")):
        make_environment("my_env.py:Mine", SandboxConfig(), args={"speed": 2})


def test_the_rollout_buffer_opens_each_episode_from_its_row_and_keeps_the_environments_reward():
    """Partial rollout (trainer/partial.py): each drawn prompt's requests carry its row to the episode
    engine, the environment's episode reward is the group's reward (the task's is not asked), and a
    group ended by a sandbox failure is dropped and counted."""
    from megatron_tepo.config import from_dict
    from megatron_tepo.trainer.partial import RolloutBuffer
    from megatron_tepo.trainer.groups import GroupProducer, Task

    class ByRow(Environment):
        name = "by_row"

        def start(self, row, messages):
            return {"id": row["id"]}

        def step(self, state, turn, turn_index):
            if state["id"] == 0:
                return Reply(done=False, message="x", tool_calls=1, sandbox_failures=1)
            return Reply(done=True, episode_reward=0.25 * (state["id"] % 3) + 0.25 * (turn == "5"))

    engine = EpisodeEngine(ScriptEngine(lambda p: ids(str(5 + (len(p) % 2))) + [EOS]), ByRow(), FMT, EpisodeLimits())
    rows = [{"id": i} for i in range(4)]
    task = Task([list(PROMPT)] * 2 + [list(PROMPT) + [24]] * 2, ["x"] * 4,
                lambda r, a: pytest.fail("the environment gave every reward"), [EOS], train_rows=rows)
    cfg = from_dict({"rollout": {"n_samples": 2, "prompts_per_step": 3, "max_new_tokens": 64, "partial_rollout": True,
                                 "max_staleness": 1, "dynamic_sampling": False, "max_inflight_groups": 4},
                     "train": {"mini_batch_prompts": 3, "seed": 0}})
    buf = RolloutBuffer(engine, GroupProducer(task, cfg), version=1)
    buf.start()
    try:
        prompts, groups, rewards, stats = buf.take(1)
    finally:
        buf.close()
    got = {g[0].meta["episode"]["env"]["state"]["id"]: r for g, r in zip(groups, rewards.view(-1, 2).tolist())}
    assert 0 not in got and len(got) == 3 and stats["groups_sandbox_failed"] == 1
    for i, r in got.items():
        turn = "5" if len(task.train_prompts[i]) % 2 == 0 else "6"  # (the script answers by the prompt's length)
        assert r == [0.25 * (i % 3) + 0.25 * (turn == "5")] * 2


def test_the_prompts_the_turn_boundaries_and_the_comparator_render_with_the_templates_arguments(tmp_path):
    """#58 item 4 (its first part): ``data.tools`` and ``data.chat_template_kwargs`` reach the chat
    template of the prompts, of the environment's turn boundaries and of the comparator, which then
    reports no error; without them the comparator sees another conversation."""
    import json

    from megatron_tepo.config import from_dict
    from megatron_tepo.data import load_prompts
    from megatron_tepo.rollout.episode import compare_with_template
    from tests.rollout.test_episode import CALL, ANSWER, tir

    tok = tir.hf_tokenizer()
    tok.chat_template = ("{%- if tools -%}{{- '<|im_start|>user\\n' + (tools | length | string) + '<|im_end|>\\n' -}}"
                         "{%- endif -%}{%- if short is defined and short -%}{{- '<|im_start|>user\\n7<|im_end|>\\n' -}}"
                         "{%- endif -%}" + tir.CHAT_TEMPLATE)
    data = from_dict({"data": {"tools": [{"name": "python"}, {"name": "calc"}],
                               "chat_template_kwargs": {"short": True}}}).data
    kw = data.template_kwargs()
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "37*45", "answer": "1665"}) + "\n")
    (record,) = load_prompts(path, tok, template_kwargs=kw).records
    msgs = [{"role": "user", "content": "37*45"}]
    text = tok.apply_chat_template(msgs, tools=kw["tools"], short=True, add_generation_prompt=True, tokenize=False)
    assert record.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert record.input_ids != load_prompts(path, tok).records[0].input_ids
    assert tok.decode(record.input_ids).startswith("<|im_start|>user\n2<|im_end|>\n<|im_start|>user\n7<|im_end|>")
    fmt = TurnFormat(tok, EOS, template_kwargs=kw)
    script = lambda p: CALL if "<tool_response>" not in tok.decode(p) else ANSWER  # noqa: E731
    engine = EpisodeEngine(ScriptEngine(script), __import__("tests.rollout.test_episode", fromlist=["Scripted"]).Scripted(),
                           fmt, EpisodeLimits())
    groups = engine.generate([record.input_ids], n=1, max_new_tokens=64, stop_token_ids=[EOS])
    assert compare_with_template(tok, record.input_ids, groups[0][0], EOS, kw) == "equal"
    assert engine.step_metrics([record.input_ids], groups)["template_equal_rate"] == 1.0
    # the comparator reads the prompt's user message back only through the same arguments
    from megatron_tepo.rollout.template_check import _messages_of

    text = tok.decode(record.input_ids, skip_special_tokens=False)
    assert _messages_of(tok, text, kw) == msgs and _messages_of(tok, text) != msgs
