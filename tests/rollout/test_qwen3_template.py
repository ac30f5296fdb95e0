"""#58 acceptance, "the Qwen3 template with tools": the prompts the package renders (data/prompts.py,
with ``config/validation.py:template_kwargs``: ``data.tools`` or the environment's own tool,
``data.chat_template_kwargs``) are the template's own rendering with ``tools=`` and those arguments,
and an episode with a tool call and the tool's answer passes the template comparator with no error
(tests/rollout/qwen3_template.py: the template, and how to run these with Qwen3's published one)."""
import json

import pytest

from megatron_tepo.config import from_dict
from megatron_tepo.config.validation import template_kwargs
from megatron_tepo.data import load_prompts
from megatron_tepo.environments import ToolResult
from megatron_tepo.environments.python_env import PythonTool
from megatron_tepo.rollout.episode import EpisodeEngine, EpisodeLimits, TurnFormat, compare_with_template
from tests.rollout.qwen3_template import EOS, templates, tokenizer
from tests.rollout.test_episode import ScriptEngine

TEMPLATES = pytest.mark.parametrize("template", [t for _, t in templates()], ids=[n for n, _ in templates()])
CONFIGS = pytest.mark.parametrize("data", [
    {"chat_template_kwargs": {"enable_thinking": False}},  # the environment's own tool (python, qwen3 calls)
    {},  # thinking on (the template's default)
    {"tools": [{"type": "function", "function": {"name": "calc", "description": "Evaluates an expression.",
                                                  "parameters": {"type": "object", "properties": {
                                                      "expr": {"type": "string"}}}}}],
     "chat_template_kwargs": {"enable_thinking": False}},
], ids=["own_tool_no_thinking", "own_tool_thinking", "data_tools_no_thinking"])


def _config(data):
    return from_dict({"environment": {"name": "python", "format": "qwen3"}, "data": data})


@TEMPLATES
@CONFIGS
def test_the_prompts_are_the_qwen3_templates_rendering_with_tools_and_its_arguments(tmp_path, template, data):
    tok = tokenizer(template)
    kw = template_kwargs(_config(data))
    assert kw["tools"] and kw.get("enable_thinking", True) == data.get("chat_template_kwargs", {}).get(
        "enable_thinking", True)
    rows = [{"prompt": "What is 37*45?", "answer": "1665"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And 12*12?"}],
             "answer": "144"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_prompts(path, tok, template_kwargs=kw).records
    for row, record in zip(rows, records):
        messages = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        assert record.input_ids == tok(want, add_special_tokens=False)["input_ids"]
        text = tok.decode(record.input_ids)
        assert text.startswith("<|im_start|>system\n") and json.dumps(kw["tools"][0]["function"]["name"]) in text
        assert text.endswith("<think>\n\n</think>\n\n") == (kw.get("enable_thinking") is False)


class Box:
    """The sandbox: prints 1665 for any code."""

    def run(self, code, *, stdin=""):
        return ToolResult("1665\n", "", 0, 0.01)

    def close(self):
        pass


CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(37*45)"}}\n</tool_call>'


@TEMPLATES
@CONFIGS
def test_an_episode_with_a_tool_call_passes_the_comparator_with_no_error(tmp_path, template, data):
    """The model calls the Python tool in Qwen3's format and answers after the tool's output; the
    episode's ids are compared with the template's rendering of the conversation. With thinking off
    the template closes an empty ``<think>`` block after each generation prompt, but renders the
    earlier assistant turns of a conversation without it: by design (``thinking``), not an error."""
    tok = tokenizer(template)
    kw = template_kwargs(_config(data))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "What is 37*45?", "answer": "1665"}) + "\n")
    (record,) = load_prompts(path, tok, template_kwargs=kw).records
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [EOS]
    answer = tok("It is 1665.", add_special_tokens=False)["input_ids"] + [EOS]
    script = lambda p: answer if "<tool_response>" in tok.decode(p) else call  # noqa: E731
    env = PythonTool(Box(), "qwen3")
    engine = EpisodeEngine(ScriptEngine(script), env, TurnFormat(tok, EOS, template_kwargs=kw), EpisodeLimits())
    groups = engine.generate([record.input_ids], n=2, max_new_tokens=400, stop_token_ids=[EOS])
    sample = groups[0][0]
    assert sample.meta["episode"]["tool_calls"] == 1 and sample.meta["episode"]["end"] == "answered"
    text = tok.decode(sample.token_ids)
    assert text.startswith(CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n1665\n</tool_response>")
    kind = compare_with_template(tok, record.input_ids, sample, EOS, kw)
    assert kind in ("equal", "thinking"), kind
    metrics = engine.step_metrics([record.input_ids], groups)
    assert metrics["template_error_rate"] == 0.0
    # a turn boundary unlike the template's is still an error
    broken = type(sample)(sample.token_ids[:len(call)] + sample.token_ids[len(call) + 1:], sample.log_probs[1:],
                          sample.finish_reason, loss_mask=sample.loss_mask[1:], meta=sample.meta)
    assert compare_with_template(tok, record.input_ids, broken, EOS, kw) == "error"
