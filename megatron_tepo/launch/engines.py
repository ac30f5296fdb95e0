"""The rollout engines whose servers the launchers start, by name (:data:`SERVED_ENGINES`): what a
launch file's ``launch.rollout.engine`` names (the old ``launch.sglang`` section: ``sglang``).

A served engine is two things of its own package under ``megatron_tepo/rollout/``:

* ``options``: one server's options, a dataclass made with ``device=`` (``launch.device``), whose
  ``launch_keys()`` are the keys of the launch file's section (key -> field), whose ``tp`` is the
  GPUs of one server, whose ``model_path``, ``host`` and ``context_length`` the launcher sets, and
  whose ``to_argv()`` is the serve command's options (sglang:
  :class:`~megatron_tepo.rollout.sglang.options.ServerConfig`);
* ``serve_module``: ``python -m <serve_module> OPTIONS --port P`` runs one server in the foreground
  (slurm/lib.sh's ``tepo_start_sglang`` and the nemo-run launcher's ``step-sglang`` run it, with
  restarts and stops of their own, and wait for its ``/health``).

Another engine is one more entry here, beside its options and serve module (and, for the trainer
to attach to it, its name in ``rollout.engine`` and ``megatron_tepo/rollout/registry.py``). Left
out: the fit check's server arithmetic, which prices SGLang's static memory pool
(``megatron_tepo/launch/memory.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from megatron_tepo.config import ConfigError
from megatron_tepo.rollout.sglang.options import ServerConfig

__all__ = ["ServedEngine", "SERVED_ENGINES", "served_engine"]


@dataclass(frozen=True)
class ServedEngine:
    name: str
    options: type  # one server's options (see the module's docstring)
    serve_module: str  # python -m it: one server in the foreground


SERVED_ENGINES: Dict[str, ServedEngine] = {
    e.name: e for e in (ServedEngine("sglang", ServerConfig, "megatron_tepo.rollout.sglang.server"),)}


def served_engine(name: str, key: str = "launch.rollout.engine", where: Optional[str] = None) -> ServedEngine:
    """The engine called ``name``; ConfigError naming ``key`` (and ``where``: its file and line)."""
    if name not in SERVED_ENGINES:
        loc = f" ({where})" if where else ""
        raise ConfigError(f"{key}{loc}: expected one of {', '.join(map(repr, SERVED_ENGINES))}, found {name!r}")
    return SERVED_ENGINES[name]
