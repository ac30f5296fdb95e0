"""The first environment: a Python tool (:class:`PythonTool`). A model turn that ends on a tool call
(a fenced ```` ```python ```` block, or Qwen3's ``<tool_call>``: :mod:`.python_tool`) has its code
run in the sandbox (:mod:`.choice`), and the model reads back its output or its error; a turn that
calls nothing is the final answer. Standard library only.

Left out: any tool but Python, state kept between calls (each call runs alone).
"""
from __future__ import annotations

from megatron_tepo.environments.base import Environment, Reply
from megatron_tepo.environments.python_tool import find_tool_calls, render_result
from megatron_tepo.environments.sandbox import Sandbox

__all__ = ["PythonTool"]


class PythonTool(Environment):
    """Runs the code a turn's tool calls hold in ``sandbox`` (in order, each alone) and answers with
    their results (:func:`~.python_tool.render_result`, one after the other); ``fmt``: the call
    format (``fenced`` or ``qwen3``). A malformed call is answered with the line that says why."""

    name = "python"

    def __init__(self, sandbox: Sandbox, fmt: str = "fenced"):
        find_tool_calls("", fmt)  # (a bad format: one line naming it)
        self.sandbox, self.fmt = sandbox, fmt

    def respond(self, turn: str, turn_index: int) -> Reply:
        calls = find_tool_calls(turn, self.fmt)
        if not calls:
            return Reply(done=True)
        answers, errors, timeouts, seconds = [], 0, 0, 0.0
        for call in calls:
            if call.code is None:
                answers.append(call.error or "Error: the tool call could not be read.")
                errors += 1
                continue
            result = self.sandbox.run(call.code)
            answers.append(render_result(result))
            errors += not result.ok
            timeouts += result.limit == "wall"
            seconds += result.seconds
        return Reply(done=False, message="\n".join(answers), tool_calls=len(calls), tool_errors=errors,
                     tool_timeouts=timeouts, tool_seconds=seconds)

    def close(self) -> None:
        self.sandbox.close()
