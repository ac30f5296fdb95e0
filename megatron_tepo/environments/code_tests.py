"""Code with tests, as a user's template (:class:`CodeTests`): each row carries unit tests (``tests``:
a list of Python statements, each an ``assert`` on the solution); the model's turn holds its solution
(its last fenced ```` ```python ```` block, or its last tool call); the solution and the tests run in
the sandbox, each test alone after the solution, and the episode's reward is the share of tests that
pass. With ``attempts`` > 1 a turn whose share is below 1 is answered with the failing tests and the
model tries again. Standard library only.

A row: ``{"prompt": "Write f(x) returning x + 1.", "tests": ["assert f(1) == 2", "assert f(-1) == 0"]}``.

Left out: hidden tests (every test's result is shown on a retry), tests in other languages.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List

from megatron_tepo.environments.base import Environment, Reply
from megatron_tepo.environments.python_tool import find_tool_calls
from megatron_tepo.environments.sandbox import Sandbox

__all__ = ["CodeTests", "tests_program"]

_MARK = "MTEPO-TESTS:"


def tests_program(solution: str, tests: List[str]) -> str:
    """The program that runs ``solution`` and then each test alone; its last line says which passed."""
    return ("import contextlib as _c, io as _io, json as _j\n"
            "_g = {'__name__': '__main__'}\n"
            "_ok = []\n"
            "with _c.redirect_stdout(_io.StringIO()), _c.redirect_stderr(_io.StringIO()):\n"
            "    try:\n"
            f"        exec(compile({solution!r}, '<solution>', 'exec'), _g)\n"
            "        _loaded = True\n"
            "    except BaseException:\n"
            "        _loaded = False\n"
            f"    for _t in {list(tests)!r}:\n"
            "        try:\n"
            "            exec(compile(_t, '<test>', 'exec'), dict(_g)) if _loaded else 1 / 0\n"
            "            _ok.append(True)\n"
            "        except BaseException:\n"
            "            _ok.append(False)\n"
            f"print({_MARK!r} + _j.dumps(_ok))\n")


class CodeTests(Environment):
    """See the module docstring; ``field``: the row's field with the tests; ``attempts``: turns the
    model may try."""

    name = "code_tests"

    def __init__(self, sandbox: Sandbox, fmt: str = "fenced", field: str = "tests", attempts: int = 1):
        find_tool_calls("", fmt)
        self.sandbox, self.fmt, self.field, self.attempts = sandbox, fmt, field, int(attempts)

    def start(self, row: Dict[str, Any], messages: List[Dict[str, str]]) -> Dict[str, Any]:
        tests = row.get(self.field)
        if not (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
            raise ValueError(f"code_tests: the row's {self.field!r} must be a non-empty list of test statements, "
                             f"got {tests!r}")
        return {"tests": list(tests), "passed": 0.0}

    def step(self, state: Dict[str, Any], turn: str, turn_index: int) -> Reply:
        calls = [c for c in find_tool_calls(turn, self.fmt) if c.code is not None]
        if not calls:
            return Reply(done=True, episode_reward=state["passed"])
        result = self.sandbox.run(tests_program(calls[-1].code, state["tests"]))
        if result.sandbox_failed:
            return Reply(done=False, message=result.error or "the sandbox failed", tool_calls=1, sandbox_failures=1,
                         tool_seconds=result.seconds)
        lines = [ln for ln in result.stdout.splitlines() if ln.startswith(_MARK)]
        ok = json.loads(lines[-1][len(_MARK):]) if lines else [False] * len(state["tests"])
        share = sum(ok) / len(ok)
        state["passed"] = max(state["passed"], share)
        reply = dict(tool_calls=1, tool_errors=int(not lines), tool_timeouts=int(result.limit == "wall"),
                     tool_seconds=result.seconds, reward=share)
        if share == 1.0 or turn_index + 1 >= self.attempts:
            return Reply(done=True, episode_reward=state["passed"], **reply)
        failing = "\n".join(t for t, passed in zip(state["tests"], ok) if not passed)
        return Reply(done=False, message=f"{sum(ok)} of {len(ok)} tests pass. Failing:\n{failing}", **reply)

    def close(self) -> None:
        self.sandbox.close()
