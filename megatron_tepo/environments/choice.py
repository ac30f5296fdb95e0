"""The choice of sandbox from its settings (:func:`make_sandbox`) and of the environment by name
(:func:`make_environment`); :func:`check_sandbox`, the check a run makes before anything expensive
starts (the trainer before it builds the policy, the launch's fit check before the servers).
Standard library only."""
from __future__ import annotations

from megatron_tepo.environments.processes import BubblewrapSandbox, LocalSubprocessSandbox
from megatron_tepo.environments.remote import RemoteSandbox
from megatron_tepo.environments.sandbox import SandboxUnavailable
from megatron_tepo.environments.settings import SandboxConfig

__all__ = ["make_sandbox", "check_sandbox", "make_environment", "ENVIRONMENTS"]

#: the code :func:`check_sandbox` runs, and what it must print
CHECK_CODE, CHECK_OUTPUT = "print(1)", "1\n"

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


def check_sandbox(cfg: SandboxConfig, where: str = "sandbox") -> str:
    """Makes the sandbox ``cfg`` asks for, runs :data:`CHECK_CODE` in it and closes it: a sandbox that
    cannot start or run it raises :class:`~.sandbox.SandboxUnavailable` (one line naming the setting
    or saying what failed). Returns one line for the log (the kind and the seconds the run took)."""
    sandbox = make_sandbox(cfg, where=where)
    try:
        result = sandbox.run(CHECK_CODE)
    finally:
        sandbox.close()
    if result.stdout != CHECK_OUTPUT or not result.ok:
        why = (result.error or result.stderr or repr(result.stdout)).strip().splitlines()
        raise SandboxUnavailable(f"{where}.kind={cfg.kind}: the sandbox could not run {CHECK_CODE!r} here "
                                 f"({why[0] if why else 'no output'})")
    return f"{where}: {cfg.kind} ran {CHECK_CODE!r} in {result.seconds:.2f} s"


def make_environment(name: str, sandbox: SandboxConfig, fmt: str = "fenced", where: str = "environment"):
    """The environment ``name`` (of :data:`ENVIRONMENTS`) with its sandbox made from ``sandbox``
    (``python``: :class:`~.python_env.PythonTool`, tool calls in ``fmt``)."""
    from megatron_tepo.environments.python_env import PythonTool

    if name != "python":
        raise ValueError(f"{where}.name: expected one of {', '.join(ENVIRONMENTS)}, got {name!r}")
    return PythonTool(make_sandbox(sandbox, where=f"{where}.sandbox"), fmt)
