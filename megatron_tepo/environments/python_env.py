"""The first environment: a Python tool (:class:`PythonTool`). A model turn that ends on a tool call
(a fenced ```` ```python ```` block, or Qwen3's ``<tool_call>``: :mod:`.python_tool`) has its code
run in the sandbox (:mod:`.choice`), and the model reads back its output or its error; a turn that
calls nothing is the final answer. Standard library only.

``max_calls_per_turn`` (``environment.max_calls_per_turn``) runs a turn's first calls only and
tells the model how many were left out; a call the sandbox itself failed (``ToolResult.sandbox_failed``)
is counted as the sandbox's (``Reply.sandbox_failures``), never as the model's error.

Left out: any tool but Python, state kept between calls (each call runs alone: the stateful one is
:mod:`.python_session`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_tepo.environments.base import Environment, Reply
from megatron_tepo.environments.python_tool import find_tool_calls, render_result, tool_schema
from megatron_tepo.environments.sandbox import Sandbox, ToolResult

__all__ = ["PythonTool", "cap_calls", "capped_message"]


def cap_calls(calls: List, max_calls: Optional[int]) -> Tuple[List, int]:
    """A turn's calls cut to ``max_calls`` (``environment.max_calls_per_turn``; None: all), and how
    many were left out."""
    if max_calls is None or len(calls) <= max_calls:
        return list(calls), 0
    return list(calls[:max_calls]), len(calls) - max_calls


def capped_message(capped: int, max_calls: int) -> str:
    """What the model reads about the calls it made past the cap."""
    return (f"Note: {capped} more tool call(s) in this turn were not run: at most {max_calls} "
            f"call(s) run per turn.")


class PythonTool(Environment):
    """Runs the code a turn's tool calls hold in ``sandbox`` (in order, each alone) and answers with
    their results (:func:`~.python_tool.render_result`, one after the other); ``fmt``: the call
    format (``fenced`` or ``qwen3``). A malformed call is answered with the line that says why."""

    name = "python"

    @classmethod
    def tool_schemas(cls, fmt: str) -> List[Dict[str, Any]]:
        """The Python tool's schema for Qwen3's ``<tool_call>`` format (a fenced block needs none)."""
        return [tool_schema()] if fmt == "qwen3" else []

    def __init__(self, sandbox: Sandbox, fmt: str = "fenced", max_calls_per_turn: Optional[int] = None):
        find_tool_calls("", fmt)  # (a bad format: one line naming it)
        self.sandbox, self.fmt, self.max_calls = sandbox, fmt, max_calls_per_turn

    def respond(self, turn: str, turn_index: int) -> Reply:
        return self.answer(turn, self.sandbox.run)

    def answer(self, turn: str, run: Callable[[str], ToolResult]) -> Reply:
        """The reply to ``turn``: each of its calls' code run by ``run`` (the sandbox's, or a
        session's: :mod:`.python_session`), the results one after the other."""
        calls = find_tool_calls(turn, self.fmt)
        if not calls:
            return Reply(done=True)
        calls, capped = cap_calls(calls, self.max_calls)
        answers, errors, timeouts, seconds, failed = [], 0, 0, 0.0, 0
        for call in calls:
            if call.code is None:
                answers.append(call.error or "Error: the tool call could not be read.")
                errors += 1
                continue
            result = run(call.code)
            answers.append(render_result(result))
            failed += result.sandbox_failed  # (the sandbox's failure: not counted as the model's error)
            errors += not result.ok and not result.sandbox_failed
            timeouts += result.limit == "wall"
            seconds += result.seconds
        if capped:
            answers.append(capped_message(capped, self.max_calls))
        return Reply(done=False, message="\n".join(answers), tool_calls=len(calls), tool_errors=errors,
                     tool_timeouts=timeouts, tool_seconds=seconds, sandbox_failures=failed, capped_calls=capped)

    def close(self) -> None:
        self.sandbox.close()
