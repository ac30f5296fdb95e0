"""The choice of sandbox from its settings: :func:`make_sandbox`. Standard library only."""
from __future__ import annotations

from megatron_tepo.environments.processes import BubblewrapSandbox, LocalSubprocessSandbox
from megatron_tepo.environments.remote import RemoteSandbox
from megatron_tepo.environments.settings import SandboxConfig

__all__ = ["make_sandbox"]


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
