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
* ``release`` -- colocated launches (``launch.rollout.placement: colocated``): every server releases
  its memory (:func:`release_servers`: ``/release_memory_occupation`` with :data:`RELEASE_TAGS`), so
  that the actor is built on free GPUs, and the trainer is told so (``TEPO_SGLANG_RELEASED``, the
  fleet's initial state);
* ``trainer`` -- torchrun on the actor nodes with the trainer's own settings; its status is the job's.

``servers``, ``health`` and ``release`` only when the run attaches to the servers the launch starts
(``rollout.engine`` is ``launch.rollout.engine``; ``embedded`` generates inside the trainer).
The pythons: the one the nodes run the trainer and the serve command with is lib.sh's
``tepo_python`` rule; the serve command finds its SGLang python itself
(``megatron_tepo.rollout.sglang.options.find_sglang_python``), and the fit check of a GPU job checks
both (:mod:`.pythons`). The ``release`` step is :func:`release_servers`: lib.sh runs it in the batch
shell (``python -m megatron_tepo.launch.release``), the nemo-run launcher in its trainer task.
Left out: how each launcher carries a step out (lib.sh's functions, the nemo-run launcher's setup
lines and tasks), and the fit check itself, which comes first.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_tepo.config import RunConfig
from megatron_tepo.launch.schema import LaunchLayout

__all__ = ["STEPS", "SERVER_STEPS", "RELEASE_TAGS", "starts_servers", "job_steps", "release_servers", "LIB_SH",
           "lib_sh", "node_python", "trainer_env"]

STEPS = ("split_nodes", "job_env", "servers", "health", "release", "trainer")
SERVER_STEPS = ("servers", "health", "release")
#: what the release step frees on every server (SGLang's tags; the engine's colocated phases name
#: the same three: megatron_tepo/rollout/engine.py's MEMORY_TAGS)
RELEASE_TAGS = ("weights", "kv_cache", "cuda_graph")
ROOT = Path(__file__).resolve().parents[2]  # the checkout the job runs (its slurm/, .venv)
LIB_SH = ROOT / "slurm" / "lib.sh"


def starts_servers(cfg: RunConfig, launch: LaunchLayout) -> bool:
    """Whether the job starts rollout servers: the run attaches to the engine the launch serves."""
    return cfg.rollout.engine == launch.rollout.engine


def job_steps(cfg: RunConfig, launch: LaunchLayout) -> Tuple[str, ...]:
    """The steps of the launch of run ``cfg`` on ``launch``, in order (a sub-sequence of :data:`STEPS`)."""
    return tuple(s for s in STEPS if (s not in SERVER_STEPS or starts_servers(cfg, launch))
                 and (s != "release" or launch.colocated))


def release_servers(urls: Sequence[str], api_key: Optional[str], tags: Sequence[str] = RELEASE_TAGS,
                    timeout: float = 600.0, log=print) -> None:
    """The ``release`` step: every server in ``urls`` frees the memory of ``tags``, one after the
    other, each answered before the next (SGLang answers once its memory is free), with the SGLang
    fleet's own calls (``megatron_tepo.rollout.sglang.client``: its API key header) and in its order:
    ``/pause_generation`` (abort: SGLang releases only when idle), ``/release_memory_occupation``,
    ``/continue_generation``. RuntimeError naming the server that refused. Once per job, after the
    health wait and before the trainer starts (a second release of released weights would stash
    garbage)."""
    from megatron_tepo.rollout.sglang.client import RequestFailed, SGLangServer  # (requests)

    for url in urls:
        server = SGLangServer(url, api_key)
        t0 = time.monotonic()
        try:
            server.post("/pause_generation", {"mode": "abort"}, timeout=timeout)
            try:
                server.post("/release_memory_occupation", {"tags": list(tags)}, timeout=timeout)
            finally:
                server.post("/continue_generation", {}, timeout=timeout)
        except RequestFailed as exc:
            raise RuntimeError(f"release: {' '.join(str(exc).split())}") from None
        log(f"released {','.join(tags)} on {url} in {time.monotonic() - t0:.1f} s")


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

