"""Environments an episode talks to; the first is a Python tool that cannot hurt the trainer.

The model writes Python in a turn (a fenced ```` ```python ```` block, or its family's tool-call
format: Qwen3's ``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>``), the code
runs in a sandbox, and the model reads back its stdout and stderr, cut to a budget, or an error
message, and goes on.

- :mod:`.base`: :class:`Environment`, what a user implements in one file (the answer to a model
  turn: :class:`Reply`); :mod:`.python_env`: :class:`PythonTool`, the first one.
- :mod:`.sandbox`: what a run gives back (:class:`ToolResult`), the :class:`Sandbox` protocol, the
  output cap and the messages the model reads.
- :mod:`.processes`: :class:`BubblewrapSandbox` (Debian's bubblewrap: no network, a private
  ``/tmp``, read-only system folders, an empty environment, none of the trainer's files; CPU time,
  memory, process count, output size and wall time limits) and :class:`LocalSubprocessSandbox` (no
  isolation, only on an explicit setting, said in a warning line).
- :mod:`.remote`: :class:`RemoteSandbox`, a SandboxFusion service (``POST /run_code``) behind the same
  protocol, for clusters that forbid user namespaces.
- :mod:`.settings`: :class:`SandboxConfig` (``kind: bubblewrap | remote | none``, the limits, the
  service's URL, the pool size); :mod:`.choice`: :func:`make_sandbox`, the sandbox they ask for.
- :mod:`.python_tool`: the tool's pure pieces: find the code in a model turn, tell whether a turn is
  a tool call, render a result as the text the model reads.
- Task templates (docs/TASKS.md), each with state per episode (:class:`Environment`'s ``start`` /
  ``step`` / ``finish``): :mod:`.python_session` (a Python session: one episode's variables across its
  calls), :mod:`.code_tests` (the row's unit tests; the reward is the share that pass),
  :mod:`.guess_number` (a game whose secret is the row's, no tool code).
- :mod:`.user_code`: a user's class or function by import path (``environment.name``,
  ``reward.function``).

Each sandbox run is alone: nothing carries over from one call to the next in the sandbox itself (the
session replays an episode's earlier calls). Left out here: the episode loop, the chat template's turn
boundaries around the tool's answer and the loss mask (the episode seam's:
:mod:`megatron_tepo.rollout.episode`), and any tool but Python.

Standard library only: nothing of torch or Megatron (``tests/environments/test_import_direction.py``).
"""
from megatron_tepo.environments.base import Environment, Reply  # noqa: F401
from megatron_tepo.environments.sandbox import (LIMITS, OutputCap, Sandbox, SandboxUnavailable,  # noqa: F401
                                                ToolResult)
from megatron_tepo.environments.settings import SANDBOX_KINDS, SandboxConfig  # noqa: F401
from megatron_tepo.environments.choice import make_sandbox  # noqa: F401
from megatron_tepo.environments.python_env import PythonTool  # noqa: F401

__all__ = ["Environment", "Reply", "PythonTool", "LIMITS", "OutputCap", "Sandbox", "SandboxUnavailable", "ToolResult", "SANDBOX_KINDS", "SandboxConfig",
           "make_sandbox"]
