"""Multi-turn episodes (``rollout/episode.py``, #52): token in, token out (each turn sends the
episode's accumulated ids, exactly the ids the engine returns are appended, the environment's answer
is the chat template's tool turn as ids), the loss mask, the limits, the engine never waiting for a
tool, an interrupt at a clean point, and the template comparator. A scripted engine and environment
(the real engines: test_episode_engines.py)."""
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_tepo.environments import Environment, Reply
from megatron_tepo.environments.python_tool import find_tool_calls
from megatron_tepo.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request, Sample, SamplingParams
from megatron_tepo.rollout.episode import (EpisodeEngine, EpisodeLimits, TurnFormat, compare_with_template,
                                           episode_metrics, final_turn)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "tiny_tir"))
import tir  # noqa: E402

TOK = tir.hf_tokenizer()
EOS = tir.EOS


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptEngine:
    """Interruptible: a request's turn is ``script(prompt_ids)`` (ids; ends with EOS = stop) cut to
    its budget; records every prompt it was sent. ``hold``: requests whose script returns None wait
    until :meth:`release` (an interrupt cuts them with the tokens given so far: none)."""
    interruptible = True

    def __init__(self, script):
        self.script, self.sent, self._done, self._held = script, [], [], []

    def submit(self, requests, params):
        for r in requests:
            self.sent.append(list(r.prompt))
            out = self.script(list(r.prompt))
            if out is None:
                self._held.append(r)
                continue
            out = out[:r.remaining]
            reason = FINISH_STOP if out and out[-1] == EOS else FINISH_LENGTH
            self._done.append((r, Sample(out, [-0.5] * len(out), reason)))

    def collect(self, timeout=0.0):
        out, self._done = self._done, []
        return out

    def interrupt(self):
        out = self._done + [(r, Sample([], [], FINISH_ABORT)) for r in self._held]
        self._done, self._held = [], []
        return out

    def update_weights(self, named):
        pass

    def close(self):
        pass


class Scripted(Environment):
    """Turn 0 is answered with ``message`` (a tool call), every later turn ends the episode."""
    name = "scripted"

    def __init__(self, message="1665", gate=None):
        self.message, self.gate, self.turns = message, gate, []

    def respond(self, turn, turn_index):
        self.turns.append((turn, turn_index))
        if self.gate is not None and "99*99" in turn:
            self.gate.wait(60)
        if turn_index == 0:
            return Reply(done=False, message=self.message, tool_calls=1, tool_seconds=0.25)
        return Reply(done=True)


CALL = ids("```python\nprint(37*45)\n```") + [EOS]
ANSWER = ids("1665") + [EOS]
PROMPT = tir.prompt_ids(TOK, "37*45")


def two_turns(prompt):
    """The model: a tool call first, then the answer (whatever the tool said)."""
    return CALL if prompt == PROMPT else ANSWER


def _engine(script=two_turns, env=None, **limits):
    return EpisodeEngine(ScriptEngine(script), env or Scripted(), TurnFormat(TOK, EOS), EpisodeLimits(**limits))


def test_the_tool_turn_is_the_templates_ids_after_the_models_stop_token():
    fmt = TurnFormat(TOK, EOS)
    conv = [{"role": "user", "content": "37*45"}, {"role": "assistant", "content": "X"},
            {"role": "tool", "content": "1665"}]
    whole = tir.render_ids(TOK, conv, add_generation_prompt=True)
    upto_stop = tir.render_ids(TOK, conv[:2])[:-1]  # the assistant turn, through its <|im_end|>
    assert fmt.answer_ids("1665") == whole[len(upto_stop):]
    assert TOK.decode(fmt.answer_ids("1665")) == \
        "\n<|im_start|>user\n<tool_response>\n1665\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert fmt.turn_text(CALL) == "```python\nprint(37*45)\n```"
    with pytest.raises(ValueError, match="no chat template"):
        TurnFormat(type("T", (), {"chat_template": None})(), EOS)


def test_a_two_turn_episode_is_token_in_token_out_with_the_tools_tokens_masked():
    engine = _engine()
    (group,) = engine.generate([PROMPT], n=1, max_new_tokens=64, stop_token_ids=[EOS])
    s = group[0]
    answer = TurnFormat(TOK, EOS).answer_ids("1665")
    assert s.token_ids == CALL + answer + ANSWER and s.finish_reason == FINISH_STOP
    assert s.loss_mask == [1] * len(CALL) + [0] * len(answer) + [1] * len(ANSWER)
    assert s.log_probs == [-0.5] * len(CALL) + [0.0] * len(answer) + [-0.5] * len(ANSWER)
    # each turn was sent exactly the episode's ids so far (token in), and the whole is the trace the
    # warm-up trains on (the template's own rendering of the conversation)
    assert engine.engine.sent == [PROMPT, PROMPT + CALL + answer]
    assert PROMPT + s.token_ids == tir.tool_trace(TOK, "37*45", "1665")[0]
    assert s.meta["episode"] == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0,
                                 "tool_seconds": 0.25, "env_tokens": len(answer), "messages": ["1665"],
                                 "tool_sandbox_failures": 0, "tool_calls_capped": 0, "end": "answered",
                                 "env": {"state": {}}}
    assert engine.env.turns == [("```python\nprint(37*45)\n```", 0), ("1665", 1)]
    assert final_turn(s) == ANSWER
    assert compare_with_template(TOK, PROMPT, s, EOS) == "equal"
    m = episode_metrics([s, Sample([5], [-1.0], "stop")])
    assert (m["episode_turns_mean"], m["tool_calls"], m["tokens_model"], m["tokens_env"]) == \
        (2.0, 1.0, float(len(CALL) + len(ANSWER)), float(len(answer)))


def test_a_boundary_unlike_the_templates_is_an_error_for_the_comparator():
    """verl #6921's bug, by hand: the newline after the model's stop token dropped from the answer."""
    s = _engine().generate([PROMPT], n=1, max_new_tokens=64, stop_token_ids=[EOS])[0][0]
    answer = TurnFormat(TOK, EOS).answer_ids("1665")
    broken = Sample(CALL + answer[1:] + ANSWER, [0.0] * (len(s.token_ids) - 1), "stop",
                    loss_mask=[1] * len(CALL) + [0] * (len(answer) - 1) + [1] * len(ANSWER), meta=s.meta)
    assert compare_with_template(TOK, PROMPT, broken, EOS) == "error"
    direct = Sample(ANSWER, [0.0] * len(ANSWER), "stop")  # one turn, as the template writes it
    assert compare_with_template(TOK, PROMPT, direct, EOS) == "equal"


def test_the_limits_end_an_episode_as_length():
    # no turn left after the first: the tool's answer is not appended
    s = _engine(max_turns=1).generate([PROMPT], n=1, max_new_tokens=64, stop_token_ids=[EOS])[0][0]
    assert (s.token_ids, s.finish_reason, s.meta["episode"]["turns"]) == (CALL, FINISH_LENGTH, 1)
    # the budget: the first turn fits, the answer does not
    s = _engine().generate([PROMPT], n=1, max_new_tokens=len(CALL) + 3, stop_token_ids=[EOS])[0][0]
    assert (s.token_ids, s.finish_reason) == (CALL, FINISH_LENGTH)
    # a turn's cap: the turn is cut there and the environment answers it as it stands
    s = _engine(max_turn_tokens=5).generate([PROMPT], n=1, max_new_tokens=64, stop_token_ids=[EOS])[0][0]
    assert s.token_ids[:5] == CALL[:5] and s.loss_mask[5] == 0 and s.meta["episode"]["turns"] == 2


def test_the_engine_never_waits_for_a_tool():
    """One episode's tool hangs (a gate): the others' turns go on and they finish first; the hung one
    finishes once its tool answers."""
    gate = threading.Event()
    slow = tir.prompt_ids(TOK, "99*99")
    slow_call = ids("```python\nprint(99*99)\n```") + [EOS]

    def script(prompt):
        if prompt in (PROMPT, slow):
            return CALL if prompt == PROMPT else slow_call
        return ANSWER

    engine = _engine(script, Scripted(gate=gate))
    reqs = [Request(PROMPT, 64, key=k) for k in range(3)] + [Request(slow, 64, key="slow")]
    engine.submit(reqs, SamplingParams(stop_token_ids=[EOS], max_new_tokens=64))
    order, deadline = [], time.monotonic() + 60
    while len(order) < 3 and time.monotonic() < deadline:
        order += [r.key for r, _ in engine.collect(timeout=0.2)]
    assert sorted(order) == [0, 1, 2]  # done while the slow tool still runs
    gate.set()
    while len(order) < 4 and time.monotonic() < deadline:
        order += [r.key for r, _ in engine.collect(timeout=0.2)]
    assert order[-1] == "slow"


def test_an_interrupt_returns_every_episode_at_a_clean_point_and_it_resumes():
    """Cut while its second turn runs: it comes back with its first turn and the tool's answer
    (FINISH_ABORT, counts kept); submitted again as prompt + that, it finishes as if uncut."""
    state = {"hold": True}

    def script(prompt):
        if prompt == PROMPT:
            return CALL
        return None if state["hold"] else ANSWER

    engine = _engine(script)
    req = Request(PROMPT, 64, key="e")
    engine.submit([req], SamplingParams(stop_token_ids=[EOS], max_new_tokens=64))
    deadline = time.monotonic() + 30
    while len(engine.engine.sent) < 2 and time.monotonic() < deadline:
        assert engine.collect(timeout=0.1) == []
    ((r, seg),) = engine.interrupt()
    answer = TurnFormat(TOK, EOS).answer_ids("1665")
    assert r is req and seg.finish_reason == FINISH_ABORT and seg.token_ids == CALL + answer
    req.extend(seg, version=1)
    assert req.loss_mask == [1] * len(CALL) + [0] * len(answer) and req.episode["turns"] == 1
    state["hold"] = False
    engine.submit([req], SamplingParams(stop_token_ids=[EOS], max_new_tokens=64))
    got = []
    while not got and time.monotonic() < deadline:
        got = engine.collect(timeout=0.1)
    ((r, rest),) = got
    req.extend(rest, version=2)
    assert req.token_ids == CALL + answer + ANSWER and req.episode["turns"] == 2 and rest.finish_reason == FINISH_STOP
    assert req.to_sample(FINISH_STOP).loss_mask == [1] * len(CALL) + [0] * len(answer) + [1] * len(ANSWER)


def test_a_failing_environment_fails_its_episode_naming_it():
    class Broken(Environment):
        name = "broken"

        def respond(self, turn, turn_index):
            raise OSError("disk full")

    with pytest.raises(RuntimeError, match="environment broken: OSError: disk full"):
        _engine(env=Broken()).generate([PROMPT], n=1, max_new_tokens=64, stop_token_ids=[EOS])


def test_every_episode_metric_is_drawn_by_the_plot_tool(tmp_path):
    """A step's episode metrics (turns, tool calls, tokens by source, the comparator) each have a panel
    of ``mtepo-plot-metrics``, which draws them from a metrics log."""
    import json

    from megatron_tepo.commands.plot_metrics import PANELS, plot

    engine = _engine()
    groups = engine.generate([PROMPT], n=2, max_new_tokens=64, stop_token_ids=[EOS])
    metrics = engine.step_metrics([PROMPT], groups)
    drawn = {k for _, keys, _ in PANELS for k in keys}
    assert set(metrics) <= drawn, sorted(set(metrics) - drawn)
    assert metrics["template_equal_rate"] == 1.0 and metrics["episode_tool_calls_mean"] == 1.0
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, **metrics}) + "\n" for s in (1, 2)))
    assert plot([str(log)], ["tir"], tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_a_turn_cut_at_its_cap_is_closed_by_the_environment_as_the_template_closes_it():
    """A turn that ends at ``max_turn_tokens`` has no stop token of the model's: the environment's
    answer starts with it (not trained), so the conversation is the template's (SmolLM2 once answered
    a capped turn without it: the comparator's error)."""
    s = _engine(max_turn_tokens=len(CALL) - 1).generate([PROMPT], n=1, max_new_tokens=64, stop_token_ids=[EOS])[0][0]
    cut = len(CALL) - 1
    answer = TurnFormat(TOK, EOS).answer_ids("1665")
    assert s.token_ids[:cut] == CALL[:cut] and s.token_ids[cut:cut + 1 + len(answer)] == [EOS] + answer
    assert s.loss_mask[cut:cut + 1 + len(answer)] == [0] * (1 + len(answer))
    assert compare_with_template(TOK, PROMPT, s, EOS) == "equal"


def test_qwen3s_thinking_rules_are_by_design_for_the_comparator():
    """With a template to Qwen3's rules (benchmarks/template_comparator.py's: the last assistant turn
    always gets a <think> block, empty when the model wrote none), an episode whose ids are the
    engine's is classed ``thinking``, not ``error``; a wrong boundary still is an error."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from template_comparator import QWEN3_RULES

    tok = tir.hf_tokenizer(extra_words=("<think>", "</think>"))
    tok.chat_template = QWEN3_RULES
    prompt = tir.render_ids(tok, [{"role": "user", "content": "37*45"}], add_generation_prompt=True)
    assert prompt == PROMPT  # (the same user turn and generation prompt as the ChatML template's)
    engine = EpisodeEngine(ScriptEngine(two_turns), Scripted(), TurnFormat(tok, EOS), EpisodeLimits())
    s = engine.generate([prompt], n=1, max_new_tokens=64, stop_token_ids=[EOS])[0][0]
    assert compare_with_template(tok, prompt, s, EOS) == "thinking"
    think = tok("<think>\n2 digits\n</think>\n\n", add_special_tokens=False)["input_ids"]
    reasoned = Sample(think + ANSWER, [0.0] * (len(think) + len(ANSWER)), "stop")  # the model's own block
    assert compare_with_template(tok, prompt, reasoned, EOS) in ("equal", "thinking")
    answer = TurnFormat(tok, EOS).answer_ids("1665")
    broken = Sample(CALL + answer[1:] + ANSWER, [0.0] * (len(s.token_ids) - 1), "stop",
                    loss_mask=[1] * len(CALL) + [0] * (len(answer) - 1) + [1] * len(ANSWER), meta=s.meta)
    assert compare_with_template(tok, prompt, broken, EOS) == "error"


class CutOnce(ScriptEngine):
    """The first request of ``prompt`` is held and an interrupt cuts it after ``half`` (finish
    abort, those ids with their log-probs); every later request runs ``script``. Records each
    request's token budget."""

    def __init__(self, script, prompt, half):
        super().__init__(script)
        self.prompt, self.half, self.caps, self.cut = prompt, half, [], False

    def submit(self, requests, params):
        for r in requests:
            self.caps.append(r.remaining)
            if list(r.prompt) == self.prompt and not self.cut:
                self.sent.append(list(r.prompt))
                self._held.append(r)
            else:
                super().submit([r], params)

    def interrupt(self):
        out = self._done + [(r, Sample(self.half, [-0.25] * len(self.half), FINISH_ABORT)) for r in self._held]
        self._done, self._held, self.cut = [], [], True
        return out


class Calls(Environment):
    """Answers a turn that is a tool call of ``fmt`` (python_tool's parser) with 1665, and ends the
    episode on any other turn; records every turn it reads."""
    name = "calls"

    def __init__(self, fmt):
        self.fmt, self.turns = fmt, []

    def respond(self, turn, turn_index):
        self.turns.append((turn, turn_index))
        calls = find_tool_calls(turn, self.fmt)
        return Reply(done=not calls, message="1665", tool_calls=len(calls))


#: the tiny tokenizer with the pieces of a Hermes-style call as words (its characters are digits only)
QWEN3_TOK = tir.hf_tokenizer(extra_words=("<tool_call>", "</tool_call>", '{"name": "python", "arguments": {"code": "',
                                          '"}}'))
QWEN3_CALL = QWEN3_TOK('<tool_call>\n{"name": "python", "arguments": {"code": "print(37*45)"}}\n</tool_call>',
                       add_special_tokens=False)["input_ids"] + [EOS]


@pytest.mark.parametrize("fmt,call,tok", [("fenced", CALL, TOK), ("qwen3", QWEN3_CALL, QWEN3_TOK)])
def test_a_tool_call_cut_mid_turn_reaches_the_environment_whole_and_once(fmt, call, tok):
    """A weight update cuts the first turn half-way through its tool call (```` ```python\\nprint( ````);
    submitted again, the rest comes under the new weights: the environment reads the whole call as one
    turn, once (it used to read the second half alone: no call, the episode ended with reward 0), and
    the turn's cap counts both halves."""
    half, rest = call[:len(call) // 2], call[len(call) // 2:]
    answer = TurnFormat(tok, EOS).answer_ids("1665")

    def script(prompt):
        if prompt == PROMPT + half:
            return rest
        assert prompt == PROMPT + call + answer, "a turn went out without the whole call before it"
        return ANSWER

    env = Calls(fmt)
    cap = len(call) + 4
    engine = EpisodeEngine(CutOnce(script, PROMPT, half), env, TurnFormat(tok, EOS),
                           EpisodeLimits(max_turn_tokens=cap))
    params = SamplingParams(stop_token_ids=[EOS], max_new_tokens=200)
    req = Request(PROMPT, 200, key="e")
    engine.submit([req], params)
    ((r, seg),) = engine.interrupt()
    assert r is req and seg.finish_reason == FINISH_ABORT and seg.token_ids == half and env.turns == []
    req.extend(seg, version=1)
    engine.submit([req], params)
    deadline, got = time.monotonic() + 30, []
    while not got and time.monotonic() < deadline:
        got = engine.collect(timeout=0.1)
    ((r, tail),) = got
    req.extend(tail, version=2)
    assert [t for t, _ in env.turns] == [tok.decode(call[:-1]), tok.decode(ANSWER[:-1])], env.turns
    assert find_tool_calls(env.turns[0][0], fmt)[0].code.strip() == "print(37*45)"
    assert [i for _, i in env.turns] == [0, 1]
    assert tail.finish_reason == FINISH_STOP and req.episode["turns"] == 2 and req.episode["tool_calls"] == 1
    assert req.token_ids == call + answer + ANSWER and req.versions == [1] * len(half) + [2] * (len(req.token_ids) - len(half))
    assert engine.engine.caps[:2] == [cap, cap - len(half)]  # the resumed half's cap: what the turn has left


def test_a_turn_cut_exactly_at_its_cap_ends_there_and_reaches_the_environment():
    """Cut with every token of its cap generated: submitted again it is not sent to the engine with
    no room; the environment reads it as a turn cut at its cap."""
    half = CALL[:-1]  # the call without its stop token: the whole cap
    env = Calls("fenced")
    engine = EpisodeEngine(CutOnce(lambda p: ANSWER, PROMPT, half), env, TurnFormat(TOK, EOS),
                           EpisodeLimits(max_turn_tokens=len(half)))
    params = SamplingParams(stop_token_ids=[EOS], max_new_tokens=200)
    req = Request(PROMPT, 200, key="e")
    engine.submit([req], params)
    ((_, seg),) = engine.interrupt()
    req.extend(seg, version=1)
    engine.submit([req], params)
    deadline, got = time.monotonic() + 30, []
    while not got and time.monotonic() < deadline:
        got = engine.collect(timeout=0.1)
    ((_, tail),) = got
    assert [t for t, _ in env.turns][0] == TOK.decode(half) and env.turns[0][1] == 0
    assert tail.token_ids[0] == EOS  # the environment closed the capped turn as the template closes it


def test_the_episode_engine_forwards_the_engine_contract_by_name():
    """#57: no catch-all ``__getattr__``: what the trainer reads of an engine (the weight sync, the
    sampling RNG's state, the fleet's health) is forwarded to the wrapped engine, each by name, and
    nothing else is."""
    import torch

    inner = ScriptEngine(lambda prompt: [EOS])
    got = []
    inner.weight_sync, inner.servers = "the fleet's sync", ["a server"]
    inner.rng_state, inner.set_rng_state = (lambda: torch.tensor([1, 2, 3], dtype=torch.uint8)), got.append
    inner.health_metrics = lambda: {"servers_lost": 1.0}
    engine = EpisodeEngine(inner, Scripted(), TurnFormat(TOK, EOS))
    try:
        assert engine.weight_sync == "the fleet's sync" and engine.rng_state().tolist() == [1, 2, 3]
        engine.set_rng_state(torch.tensor([4], dtype=torch.uint8))
        assert [t.tolist() for t in got] == [[4]] and engine.health_metrics() == {"servers_lost": 1.0}
        with pytest.raises(AttributeError):
            engine.servers  # noqa: B018 -- (not part of the contract: not forwarded)
    finally:
        engine.close()
