"""How the command-line tools report errors: a user error is one line and exit status 2.

Every tool (``tools/train.py``, ``tools/evaluate.py``, the converters, ``tools/fit_check.py``,
``tools/launch_nemo_run.py``) runs its work inside :func:`user_errors`:

* a user error -- a bad setting (:class:`~megatron_tepo.config.ConfigError`), a bad value or file
  (``ValueError``, ``OSError``: missing, unreadable, already there), an unsupported model
  (``NotImplementedError``), a checkpoint that cannot be used
  (:class:`~megatron_tepo.checkpoint.store.CheckpointError`), a tool sandbox that cannot start here
  (:class:`~megatron_tepo.environments.sandbox.SandboxUnavailable`: bwrap missing, user namespaces
  forbidden; it would fail again on a new attempt), a missing optional package -- is
  printed as ``<tool>: error: <message>`` on one line (``ErrorType: message`` where the type says
  something), and the process exits with status 2;
* ``--traceback`` (every tool has it) prints the full traceback instead;
* anything else is a bug: its traceback is printed as usual (status 1).

Under torchrun every rank raises the same configuration error: only global rank 0 prints it;
other errors are printed by the rank that hit them, with its rank.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

__all__ = ["UserError", "user_errors", "add_traceback_flag", "missing_package_message", "prog"]


def prog() -> str:
    """The command's name as the user typed it (``train.py``, ``mtepo-train``, ...)."""
    return os.path.basename(sys.argv[0]) or "megatron_tepo"


class UserError(Exception):
    """An error in what the user asked for; the message is the whole story."""


#: optional packages and the extra that installs them
EXTRAS = {"nemo_run": "nemorun", "sglang": "sglang", "transformer_engine": "gpu", "triton": "dev"}


def missing_package_message(exc: ModuleNotFoundError) -> str:
    top = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return (f"the '{top}' package is not installed, a dependency of megatron_tepo: reinstall it "
                f"(pip install -e . after torch, or bash tools/setup_env.sh)")
    return (f"the '{top}' package is not installed: pip install 'megatron_tepo[{extra}]' "
            f"(or bash tools/setup_env.sh)")


def _user_error_types():
    from megatron_tepo.checkpoint.store import CheckpointError
    from megatron_tepo.environments.sandbox import SandboxUnavailable

    return (UserError, ValueError, OSError, NotImplementedError, CheckpointError, SandboxUnavailable,
            ModuleNotFoundError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError):
        return missing_package_message(exc)
    text = " ".join(str(exc).split()) or type(exc).__name__  # one line
    if isinstance(exc, (UserError,)) or type(exc).__name__ in ("ConfigError", "FitError", "SandboxUnavailable"):
        return text
    return f"{type(exc).__name__}: {text}"


def add_traceback_flag(parser) -> None:
    parser.add_argument("--traceback", action="store_true",
                        help="on an error, print the full traceback instead of one line")


@contextlib.contextmanager
def user_errors(prog: str, traceback: bool = False) -> Iterator[None]:
    """Turn a user error raised inside into one line on stderr and ``SystemExit(2)``."""
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 -- sorted below
        if traceback or isinstance(exc, (SystemExit, KeyboardInterrupt)):
            raise
        try:
            kinds = _user_error_types()
        except Exception:  # noqa: BLE001 -- megatron itself missing: still a readable line
            kinds = (UserError, ValueError, OSError, NotImplementedError, ModuleNotFoundError)
        if not isinstance(exc, kinds):
            raise
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or type(exc).__name__ != "ConfigError":
            where = f" (rank {rank})" if rank else ""
            print(f"{prog}{where}: error: {_describe(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
