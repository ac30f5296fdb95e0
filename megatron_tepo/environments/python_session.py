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

from megatron_tepo.environments.base import Reply
from megatron_tepo.environments.python_env import PythonTool
from megatron_tepo.environments.python_tool import tool_schema
from megatron_tepo.environments.sandbox import Sandbox, ToolResult

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


class PythonSession(PythonTool):
    """The Python tool with variables that live across one episode's calls (see the module
    docstring); ``fmt``: the call format; ``max_calls_per_turn`` as the plain tool's."""

    name = "python_session"

    @classmethod
    def tool_schemas(cls, fmt: str) -> List[Dict[str, Any]]:
        """The session's schema for Qwen3's ``<tool_call>`` format: it says that variables live on."""
        return [tool_schema(description="Run Python 3 code in a sandboxed session and return what it prints "
                                        "(stdout, then stderr); variables and imports of earlier calls of this "
                                        "conversation are still defined; no network.")] if fmt == "qwen3" else []

    def __init__(self, sandbox: Sandbox, fmt: str = "fenced", max_calls_per_turn: Optional[int] = None,
                 max_cells: int = 16, max_episode_seconds: float = 60.0):
        super().__init__(sandbox, fmt, max_calls_per_turn)
        self.max_cells, self.max_episode_seconds = int(max_cells), float(max_episode_seconds)

    def start(self, row: Dict[str, Any], messages: List[Dict[str, str]]) -> Dict[str, Any]:
        return {"cells": [], "seconds": 0.0}

    def step(self, state: Dict[str, Any], turn: str, turn_index: int) -> Reply:
        return self.answer(turn, lambda code: self._run(state, code))

    def _run(self, state: Dict[str, Any], code: str) -> ToolResult:
        """One call of the episode: its earlier calls replayed, then ``code``; refused past the
        episode's limits."""
        if len(state["cells"]) >= self.max_cells or state["seconds"] >= self.max_episode_seconds:
            return ToolResult("", "", None, 0.0, error=f"Error: this session's limit is reached ({self.max_cells} "
                              f"calls, {self.max_episode_seconds:g} s of tool time): the call was not run.")
        result = self.sandbox.run(session_program(state["cells"], code))
        state["seconds"] += result.seconds
        if not result.sandbox_failed:
            state["cells"].append(code)
        return result
