"""The Python tool's pure pieces: which turns are tool calls and what code they carry (fenced blocks;
Qwen3's ``<tool_call>`` JSON, malformed calls included), and the text the model reads back."""
import json

import pytest

from megatron_tepo.environments import ToolResult
from megatron_tepo.environments.python_tool import (find_tool_calls, is_tool_call, render_output_block,
                                                    render_result)


def test_a_fenced_python_block_that_ends_the_turn_is_a_call():
    turn = "Let me compute it.\n```python\nx = 2 ** 10\nprint(x)\n```\n"
    (call,) = find_tool_calls(turn)
    assert (call.code, call.error, call.format) == ("x = 2 ** 10\nprint(x)\n", None, "fenced")
    assert turn[call.start:call.end] == "```python\nx = 2 ** 10\nprint(x)\n```"
    for tag in ("py", "python3", "Python"):
        assert find_tool_calls(f"```{tag}\nprint(1)\n```")[0].code == "print(1)\n"
    # the last block runs, not the first; an indented fence and trailing blank lines are fine
    turn = "```python\nprint('first')\n```\nthen\n  ```python\nprint('second')\n  ```\n\n"
    assert [c.code for c in find_tool_calls(turn)] == ["print('second')\n"]


@pytest.mark.parametrize("turn", [
    "The answer is 42.",
    "```python\nprint(1)\n```\nSo the answer is 1.",  # text after the block: a final answer
    "```\nprint(1)\n```",  # a bare block
    "```text\nprint(1)\n```",
    "```python\nprint(1)\n",  # cut before its closing fence
    "```python\nprint(1)\n```\n```python\nprint(2)\n",  # the last block is unclosed
    "",
])
def test_other_turns_are_no_call(turn):
    assert find_tool_calls(turn) == [] and not is_tool_call(turn)


def qwen3_call(code, name="python", as_string=False):
    args = {"code": code}
    return ('<tool_call>\n{"name": "' + name + '", "arguments": '
            + (json.dumps(json.dumps(args)) if as_string else json.dumps(args)) + "}\n</tool_call>")


def test_qwen3_tool_calls():
    turn = "<think>\nneed 2**10\n</think>\n\nI will compute it.\n" + qwen3_call("print(2 ** 10)\nprint('a\"b')")
    (call,) = find_tool_calls(turn, "qwen3")
    assert (call.code, call.error, call.format) == ("print(2 ** 10)\nprint('a\"b')", None, "qwen3")
    assert turn[call.start:call.end] == qwen3_call("print(2 ** 10)\nprint('a\"b')")
    assert find_tool_calls(qwen3_call("print(1)", as_string=True) + "\n", "qwen3")[0].code == "print(1)"
    # several calls end the turn: all run, in order; a call earlier in the turn does not
    turn = qwen3_call("print(0)") + "\ntext\n" + qwen3_call("print(1)") + "\n" + qwen3_call("print(2)")
    assert [c.code for c in find_tool_calls(turn, "qwen3")] == ["print(1)", "print(2)"]
    assert find_tool_calls(qwen3_call("print(1)") + "\nSo the answer is 1.", "qwen3") == []
    assert find_tool_calls("```python\nprint(1)\n```", "qwen3") == []  # the format is the family's
    assert find_tool_calls(qwen3_call("print(1)"), "fenced") == []


@pytest.mark.parametrize("body, error", [
    ('{"name": "python", "arguments": {"code": "print(1)"', "Error: the tool call is not valid JSON ("),
    ('["python"]', 'Error: a tool call is a JSON object {"name": ..., "arguments": {...}}.'),
    ('{"name": "search", "arguments": {"query": "x"}}', "Error: there is no tool 'search'; the one tool is 'python'."),
    ('{"name": "python", "arguments": {"source": "print(1)"}}',
     'Error: the python tool takes {"code": "<python code>"} as its arguments.'),
    ('{"name": "python", "arguments": "{not json"}', "Error: the tool call's arguments are not valid JSON ("),
])
def test_a_malformed_qwen3_call_is_a_call_with_an_error(body, error):
    (call,) = find_tool_calls(f"<tool_call>\n{body}\n</tool_call>", "qwen3")
    assert call.code is None and call.error.startswith(error)
    assert is_tool_call(f"<tool_call>\n{body}\n</tool_call>", "qwen3")


def test_an_unknown_format_is_one_line():
    with pytest.raises(ValueError, match=r"^tool call format: must be one of fenced, qwen3, got 'hermes'$"):
        find_tool_calls("x", "hermes")


def result(**kw):
    return ToolResult(**{"stdout": "", "stderr": "", "exit_code": 0, "seconds": 0.1, **kw})


def test_what_the_model_reads_back():
    assert render_result(result(stdout="1024\n")) == "1024"
    assert render_result(result()) == "(no output)"
    tb = 'Traceback (most recent call last):\n  File "/tmp/main.py", line 1, in <module>\nZeroDivisionError: x\n'
    failed = result(stdout="before\n", stderr=tb, exit_code=1, error="Error: the code exited with status 1.")
    assert render_result(failed) == "before\n" + tb + "Error: the code exited with status 1."
    hang = result(stdout="x" * 4 + "\n[... at least 9 bytes cut ...]\n" + "x" * 4, exit_code=None, limit="output",
                  error="Error: the code printed more than 8 bytes and was stopped.")
    assert render_result(hang) == ("xxxx\n[... at least 9 bytes cut ...]\nxxxx\n"
                                   "Error: the code printed more than 8 bytes and was stopped.")
    assert render_output_block(result(stdout="1024\n")) == "```output\n1024\n```"
