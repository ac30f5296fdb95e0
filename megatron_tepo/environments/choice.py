"""The choice of sandbox from its settings (:func:`make_sandbox`) and of the environment by name
(:func:`make_environment`): a shipped one by its short name (:data:`ENVIRONMENTS`), or a user's
class by import path (``my_pkg.my_module:MyEnv`` or ``path/to/file.py:MyEnv``), built with
``environment.args``; :func:`check_sandbox`, the check a run makes before anything expensive starts
(the trainer before it builds the policy, the launch's fit check before the servers), for an
environment that runs code in a sandbox (:func:`uses_sandbox`). Standard library only."""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, Optional

from megatron_tepo.environments.processes import BubblewrapSandbox, LocalSubprocessSandbox
from megatron_tepo.environments.remote import RemoteSandbox
from megatron_tepo.environments.sandbox import SandboxUnavailable
from megatron_tepo.environments.settings import SandboxConfig

__all__ = ["make_sandbox", "check_sandbox", "uses_sandbox", "make_environment", "ENVIRONMENTS", "environment_class"]

#: the code :func:`check_sandbox` runs, and what it must print
CHECK_CODE, CHECK_OUTPUT = "print(1)", "1\n"

#: the shipped environments by the name the run config's ``environment.name`` gives, and their classes
ENVIRONMENTS = {"python": "megatron_tepo.environments.python_env:PythonTool",
                "python_session": "megatron_tepo.environments.python_session:PythonSession",
                "code_tests": "megatron_tepo.environments.code_tests:CodeTests",
                "guess_number": "megatron_tepo.environments.guess_number:GuessNumber"}


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


def uses_sandbox(name: str, where: str = "environment.name") -> bool:
    """Whether the environment ``name`` (:func:`environment_class`) runs code in a sandbox: its
    constructor takes one (``none``: no environment, False)."""
    if name == "none":
        return False
    return "sandbox" in inspect.signature(environment_class(name, where).__init__).parameters


def environment_class(name: str, where: str = "environment.name"):
    """The environment class ``name`` selects: a short name of :data:`ENVIRONMENTS` or an import
    path ``module:Class`` / ``file.py:Class``. A ``ValueError`` of one line naming ``where`` when it
    cannot be found or is not an :class:`~.base.Environment`."""
    from megatron_tepo.environments.base import Environment

    if name in ENVIRONMENTS:
        mod, attr = ENVIRONMENTS[name].split(":")
        return getattr(importlib.import_module(mod), attr)
    if ":" not in str(name):
        raise ValueError(f"{where}: expected one of none, {', '.join(ENVIRONMENTS)} or an import path "
                         f"'package.module:Class', got {name!r}")
    from megatron_tepo.environments.user_code import load_object

    cls = load_object(name, where)
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ValueError(f"{where}: {name!r} is not a subclass of megatron_tepo.environments.Environment")
    return cls


def make_environment(name: str, sandbox: SandboxConfig, fmt: str = "fenced", where: str = "environment",
                     args: Optional[Dict[str, Any]] = None, max_calls_per_turn: Optional[int] = None):
    """The environment ``name`` (:func:`environment_class`) built with ``args`` (``environment.args``);
    a constructor that takes ``sandbox`` gets the sandbox made from ``sandbox``, one that takes ``fmt``
    the tool-call format, one that takes ``max_calls_per_turn`` the cap. A wrong argument is one line
    naming ``environment.args``."""
    cls = environment_class(name, f"{where}.name")
    params = inspect.signature(cls.__init__).parameters
    kw = dict(args or {})
    if "fmt" in params:
        kw.setdefault("fmt", fmt)
    if "max_calls_per_turn" in params:
        kw.setdefault("max_calls_per_turn", max_calls_per_turn)
    try:
        inspect.signature(cls).bind(**{**kw, **({"sandbox": None} if "sandbox" in params else {})})
    except TypeError as exc:
        raise ValueError(f"{where}.args: {name}: {exc}") from None
    if "sandbox" in params:
        kw["sandbox"] = make_sandbox(sandbox, where=f"{where}.sandbox")
    return cls(**kw)
