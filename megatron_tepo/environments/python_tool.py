"""The Python tool's pure pieces: find the code a model turn asks to run, tell whether the turn is a
tool call, and render a :class:`~.sandbox.ToolResult` as the text the model reads back.

Two formats of a call:

- ``fenced``: a Markdown block, the family-neutral form ToRL and SimpleTIR train::

      ```python
      print(2 ** 10)
      ```

  The turn is a tool call when its last non-blank line is the closing fence of a block opened with
  ```` ```python ```` (or ``py``, ``python3``); the code is that block's. Other blocks (a bare
  ```` ``` ````, ```` ```text ````), earlier ones and an unclosed block (a turn cut at its token
  limit) are not run.
- ``qwen3``: the Qwen2.5/Qwen3 chat templates' tool call (Hermes style), as the templates render an
  assistant's ``tool_calls`` and transformers' response parser for ``qwen3`` reads them
  (``transformers/cli/serving/utils.py``: ``<tool_call>`` JSON ``</tool_call>``)::

      <tool_call>
      {"name": "python", "arguments": {"code": "print(2 ** 10)"}}
      </tool_call>

  The turn is a tool call when it ends with ``</tool_call>``; every call of the run of calls that
  ends it (several are allowed, separated by whitespace) is returned, in order. ``arguments`` may be
  an object or a JSON string of one (the template renders either). A call that is not valid JSON,
  names another tool or has no string ``code`` is still a call: it comes back with ``code=None``
  and the error the model is told, so the episode answers it instead of ending.

Both expect the turn's text to include the closing fence / ``</tool_call>``: an engine that stops
on them must keep the stop text (SGLang's ``no_stop_trim``, or a stop on the token id).

The answer: :func:`render_result` is the message's content (stdout, then stderr, then the error line;
``(no output)`` when there is none); the family's turn boundary around it (Qwen3's ``<|im_start|>user
<tool_response> ... </tool_response><|im_end|>``) is the episode's, as token ids.
:func:`render_output_block` wraps it as ToRL's ```` ```output ```` block for the fenced format.

Stateless: each call runs alone, nothing carries over to the next (no stateful kernel). Standard
library only.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import List, Optional

from megatron_tepo.environments.sandbox import ToolResult

__all__ = ["FORMATS", "PYTHON_TAGS", "ToolCall", "find_tool_calls", "is_tool_call", "render_result",
           "render_output_block", "tool_schema"]

FORMATS = ("fenced", "qwen3")
#: The info strings of a fenced block that runs.
PYTHON_TAGS = ("python", "py", "python3")

_FENCE = re.compile(r"[ \t]*```[ \t]*([^\s`]*)[ \t]*\Z")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call found in a turn: ``code`` to run, or ``code=None`` and ``error``, the line the model
    is told about a malformed call. ``start``/``end``: the call's span in the turn's text."""
    code: Optional[str]
    error: Optional[str]
    format: str
    start: int
    end: int


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"tool call format: must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _fenced(turn: str) -> List[ToolCall]:
    lines = turn.splitlines(keepends=True)
    offsets, pos = [], 0
    for line in lines:
        offsets.append(pos)
        pos += len(line)
    opened = None  # (line index, tag) of the block open at this line
    last = None  # (open line, close line, tag) of the last closed block
    for i, line in enumerate(lines):
        m = _FENCE.match(line.rstrip("\r\n"))
        if not m:
            continue
        if opened is None:
            opened = (i, m.group(1).lower())
        elif not m.group(1):  # a bare fence closes the open block
            last = (opened[0], i, opened[1])
            opened = None
    if last is None or opened is not None:
        return []
    first, close, tag = last
    if tag not in PYTHON_TAGS or any(line.strip() for line in lines[close + 1:]):
        return []
    code = "".join(lines[first + 1:close])
    return [ToolCall(code=code, error=None, format="fenced", start=offsets[first],
                     end=offsets[close] + len(lines[close].rstrip("\r\n")))]


def _parse_qwen3(body: str, tool_name: str) -> tuple:
    """(code, error) of one ``<tool_call>`` body."""
    try:
        call = json.loads(body)
    except ValueError as e:
        return None, f"Error: the tool call is not valid JSON ({e})."
    if not isinstance(call, dict) or "name" not in call:
        return None, 'Error: a tool call is a JSON object {"name": ..., "arguments": {...}}.'
    if call["name"] != tool_name:
        return None, f"Error: there is no tool {call['name']!r}; the one tool is {tool_name!r}."
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            return None, f"Error: the tool call's arguments are not valid JSON ({e})."
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        return None, f'Error: the {tool_name} tool takes {{"code": "<python code>"}} as its arguments.'
    return args["code"], None


def _qwen3(turn: str, tool_name: str) -> List[ToolCall]:
    text = turn.rstrip()
    if not text.endswith("</tool_call>"):
        return []
    matches = list(_TOOL_CALL.finditer(text))
    run = []  # the calls that end the turn, separated only by whitespace
    end = len(text)
    for m in reversed(matches):
        if text[m.end():end].strip():
            break
        run.append(m)
        end = m.start()
    calls = []
    for m in reversed(run):
        code, error = _parse_qwen3(m.group(1).strip(), tool_name)
        calls.append(ToolCall(code=code, error=error, format="qwen3", start=m.start(), end=m.end()))
    return calls


#: what :func:`tool_schema` tells the model the tool does, by default (each call alone)
STATELESS = ("Run Python 3 code in a sandbox and return what it prints (stdout, then stderr); each call starts a "
             "fresh interpreter with no network.")


def tool_schema(tool_name: str = "python", description: str = STATELESS) -> dict:
    """The tool's JSON schema in the form chat templates take (``tools=``; Qwen3's renders it in its
    system turn): one string argument ``code``, as :func:`find_tool_calls` reads a ``qwen3`` call."""
    return {"type": "function", "function": {
        "name": tool_name,
        "description": description,
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the code to run"}},
                       "required": ["code"]}}}


def find_tool_calls(turn: str, fmt: str = "fenced", *, tool_name: str = "python") -> List[ToolCall]:
    """The tool calls that end ``turn`` (the module docstring has the rules), in order; empty when
    the turn is no tool call (a final answer, or a turn cut before its call closed)."""
    _check_format(fmt)
    return _fenced(turn) if fmt == "fenced" else _qwen3(turn, tool_name)


def is_tool_call(turn: str, fmt: str = "fenced", *, tool_name: str = "python") -> bool:
    """Whether ``turn`` ends on a tool call (its closing fence / ``</tool_call>``)."""
    return bool(find_tool_calls(turn, fmt, tool_name=tool_name))


def render_result(result: ToolResult) -> str:
    """What the model reads back from one run: its stdout, then its stderr (each already cut to the
    sandbox's budget, with the marker saying how much was cut), then the error line if the run
    failed; ``(no output)`` when there is nothing. Trailing newlines are dropped: the template's
    turn boundary follows."""
    parts = [s.rstrip("\n") for s in (result.stdout, result.stderr) if s.strip()]
    if result.error:
        parts.append(result.error)
    return "\n".join(parts) if parts else "(no output)"


def render_output_block(result: ToolResult) -> str:
    """:func:`render_result` as ToRL's ```` ```output ```` block, for the fenced format."""
    return f"```output\n{render_result(result)}\n```"
