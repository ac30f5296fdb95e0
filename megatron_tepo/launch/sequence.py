"""The launch sequence, once: the steps of a job after its fit check, in order (:data:`STEPS`), the
ones a launch runs (:func:`job_steps`), and the rules of slurm/lib.sh that the nemo-run launcher
runs rather than copies (:func:`node_python`, :func:`trainer_env`).

Both launchers follow :func:`job_steps`: the fit check writes it as ``FIT_STEPS`` and slurm/lib.sh's
``tepo_main`` runs ``tepo_step_<name>`` for each name in turn; the nemo-run launcher renders each
step's part of its batch script and its tasks from the same list (``megatron_tepo/launch/nemo_run.py``).
The steps:

* ``split_nodes`` -- the first ``launch.actor_nodes`` hosts run the trainer, the next
  ``launch.rollout_nodes`` the servers (0: the actor hosts themselves);
* ``job_env`` -- what every step shares: NCCL's network settings (CPU: no visible GPU), the
  servers' API key, the signal traps;
* ``servers`` -- the rollout servers, ``servers_per_node`` on each rollout node, each the serve
  command of ``launch.rollout`` (``FIT_SERVE_ARGS``) on its port and GPUs;
* ``health`` -- a wait until every server answers ``/health``;
* ``trainer`` -- torchrun on the actor nodes with the trainer's own settings; its status is the job's.

``servers`` and ``health`` only when the run attaches to the servers the launch starts
(``rollout.engine`` is ``launch.rollout.engine``; ``embedded`` generates inside the trainer).
The pythons: the one the nodes run the trainer and the serve command with is lib.sh's
``tepo_python`` rule; the serve command finds its SGLang python itself
(``megatron_tepo.rollout.sglang.options.find_sglang_python``), and the fit check of a GPU job checks
both (:mod:`.pythons`). Left out: how each launcher carries a step out (lib.sh's functions, the
nemo-run launcher's setup lines and tasks), and the fit check itself, which comes first.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

from megatron_tepo.config import RunConfig
from megatron_tepo.launch.schema import LaunchLayout

__all__ = ["STEPS", "SERVER_STEPS", "starts_servers", "job_steps", "LIB_SH", "lib_sh", "node_python", "trainer_env"]

STEPS = ("split_nodes", "job_env", "servers", "health", "trainer")
SERVER_STEPS = ("servers", "health")
ROOT = Path(__file__).resolve().parents[2]  # the checkout the job runs (its slurm/, .venv)
LIB_SH = ROOT / "slurm" / "lib.sh"


def starts_servers(cfg: RunConfig, launch: LaunchLayout) -> bool:
    """Whether the job starts rollout servers: the run attaches to the engine the launch serves."""
    return cfg.rollout.engine == launch.rollout.engine


def job_steps(cfg: RunConfig, launch: LaunchLayout) -> Tuple[str, ...]:
    """The steps of the launch of run ``cfg`` on ``launch``, in order (a sub-sequence of :data:`STEPS`)."""
    return tuple(s for s in STEPS if s not in SERVER_STEPS or starts_servers(cfg, launch))


def lib_sh(function: str, *args: str, environ: Mapping[str, str] = os.environ) -> List[str]:
    """The lines slurm/lib.sh's ``function ARGS`` prints, run in bash with ``environ``."""
    res = subprocess.run(["bash", "-c", 'source "$1" && shift && "$@"', "tepo", str(LIB_SH), function, *args],
                         env=dict(environ), capture_output=True, text=True, timeout=60, check=True)
    return res.stdout.splitlines()


def node_python(environ: Mapping[str, str] = os.environ) -> str:
    """The python on the nodes: lib.sh's ``tepo_python`` (``TEPO_PYTHON``, else this checkout's
    ``.venv``, else ``python3``)."""
    return lib_sh("tepo_python", environ={**environ, "TEPO_ROOT": str(ROOT)})[0]


def trainer_env(device: str, environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The trainer step's own settings: lib.sh's ``tepo_trainer_env`` for ``device`` (OMP threads,
    ``CUDA_DEVICE_MAX_CONNECTIONS``, NCCL error handling, ``PYTORCH_CUDA_ALLOC_CONF``), the
    values in ``environ`` winning. Only the trainer's step sets them, never the servers'."""
    lines = lib_sh("tepo_trainer_env", environ={**environ, "FIT_DEVICE": device})
    return dict(line.split("=", 1) for line in lines if "=" in line)
