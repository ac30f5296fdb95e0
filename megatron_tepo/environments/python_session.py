"""A stateful Python session, as a user's template (:class:`PythonSession`): the variables one call
of an episode sets are there in its next calls; nothing is shared between episodes. Standard
library only.

How: the episode's state holds the code of its calls so far (``state["cells"]``: plain strings, so
the session survives an interrupt, a checkpoint and a ``kill -9`` and resume exactly). Each call runs
in its own sandboxed interpreter (:mod:`.choice`'s sandbox: bubblewrap by default, its limits per
call), which first replays the episode's earlier calls with their output discarded, then runs the new
one; the interpreter ends with the call, so nothing of an episode outlives it. Per episode:
``max_cells`` calls at most (later calls are refused, said to the model) and ``max_episode_seconds``
of tool time in all.

Left out: a live interpreter kept between calls (its memory could not be checkpointed); code whose
earlier calls are not deterministic (random numbers, the clock, files written) sees them re-run, so a
value drawn in one call is drawn again, differently, in the next.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from megatron_tepo.environments.base import Environment, Reply
from megatron_tepo.environments.python_env import cap_calls, capped_message
from megatron_tepo.environments.python_tool import find_tool_calls, render_result
from megatron_tepo.environments.sandbox import Sandbox

__all__ = ["PythonSession", "session_program"]


def session_program(cells: List[str], code: str) -> str:
    """The program one call runs: the earlier ``cells`` replayed quietly (their errors ignored:
    they failed then too), then ``code`` as the model wrote it."""
    return ("import contextlib as _c, io as _io\n"
            f"_cells = {cells!r}\n"
            "_g = {'__name__': '__main__'}\n"
            "with _c.redirect_stdout(_io.StringIO()), _c.redirect_stderr(_io.StringIO()):\n"
            "    for _cell in _cells:\n"
            "        try:\n"
            "            exec(compile(_cell, '<earlier call>', 'exec'), _g)\n"
            "        except BaseException:\n"
            "            pass\n"
            "del _c, _io, _cells\n"
            f"exec(compile({code!r}, '<call>', 'exec'), _g)\n")


class PythonSession(Environment):
    """The Python tool with variables that live across one episode's calls (see the module
    docstring); ``fmt``: the call format; ``max_calls_per_turn`` as the plain tool's."""

    name = "python_session"

    def __init__(self, sandbox: Sandbox, fmt: str = "fenced", max_calls_per_turn: Optional[int] = None,
                 max_cells: int = 16, max_episode_seconds: float = 60.0):
        find_tool_calls("", fmt)
        self.sandbox, self.fmt, self.max_calls = sandbox, fmt, max_calls_per_turn
        self.max_cells, self.max_episode_seconds = int(max_cells), float(max_episode_seconds)

    def start(self, row: Dict[str, Any], messages: List[Dict[str, str]]) -> Dict[str, Any]:
        return {"cells": [], "seconds": 0.0}

    def step(self, state: Dict[str, Any], turn: str, turn_index: int) -> Reply:
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
            if len(state["cells"]) >= self.max_cells or state["seconds"] >= self.max_episode_seconds:
                answers.append(f"Error: this session's limit is reached ({self.max_cells} calls, "
                               f"{self.max_episode_seconds:g} s of tool time): the call was not run.")
                errors += 1
                continue
            result = self.sandbox.run(session_program(state["cells"], call.code))
            answers.append(render_result(result))
            state["seconds"] += result.seconds
            failed += result.sandbox_failed
            errors += not result.ok and not result.sandbox_failed
            timeouts += result.limit == "wall"
            seconds += result.seconds
            if not result.sandbox_failed:
                state["cells"].append(call.code)
        if capped:
            answers.append(capped_message(capped, self.max_calls))
        return Reply(done=False, message="\n".join(answers), tool_calls=len(calls), tool_errors=errors,
                     tool_timeouts=timeouts, tool_seconds=seconds, sandbox_failures=failed, capped_calls=capped)

    def close(self) -> None:
        self.sandbox.close()
