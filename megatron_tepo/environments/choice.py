"""The choice of sandbox from its settings (:func:`make_sandbox`) and of the environment by name
(:func:`make_environment`). Standard library only."""
from __future__ import annotations

from megatron_tepo.environments.processes import BubblewrapSandbox, LocalSubprocessSandbox
from megatron_tepo.environments.remote import RemoteSandbox
from megatron_tepo.environments.settings import SandboxConfig

__all__ = ["make_sandbox", "make_environment", "ENVIRONMENTS"]

#: the environments by the name the run config's ``environment.name`` gives
ENVIRONMENTS = ("python",)


def make_sandbox(cfg: SandboxConfig, where: str = "sandbox"):
    """The sandbox ``cfg`` asks for, checked (``ValueError`` naming the field) and made: a bubblewrap
    sandbox checks at once that bwrap runs here (:class:`~.sandbox.SandboxUnavailable`, one line, if
    not); ``none`` says in a warning line that the code runs without isolation."""
    cfg.check(where)
    if cfg.kind == "bubblewrap":
        return BubblewrapSandbox(cfg, where=where)
    if cfg.kind == "remote":
        return RemoteSandbox(cfg)
    return LocalSubprocessSandbox(cfg, where=where)


def make_environment(name: str, sandbox: SandboxConfig, fmt: str = "fenced", where: str = "environment"):
    """The environment ``name`` (of :data:`ENVIRONMENTS`) with its sandbox made from ``sandbox``
    (``python``: :class:`~.python_env.PythonTool`, tool calls in ``fmt``)."""
    from megatron_tepo.environments.python_env import PythonTool

    if name != "python":
        raise ValueError(f"{where}.name: expected one of {', '.join(ENVIRONMENTS)}, got {name!r}")
    return PythonTool(make_sandbox(sandbox, where=f"{where}.sandbox"), fmt)
