"""The two pythons of a ``launch.device: cuda`` job, checked before anything starts
(:func:`check_pythons`): the trainer's and the SGLang servers'.

A checkout that ran the README's test command holds ``.venv`` (a PyPI torch, without Transformer
Engine or apex) and ``.venv-sglang`` (SGLang's CPU build, ``tools/install_sglang_cpu.sh``), and
both are the launchers' defaults (``TEPO_PYTHON``; ``MTEPO_SGLANG_PYTHON``). A GPU job that took
them started CPU servers with ``--device cuda`` and a trainer that refused the layout only after
the servers were up. So the fit check of a GPU job (``tools/fit_check.py --trainer-python``, which
slurm/lib.sh runs; the nemo-run launcher at submission) asks each python what it has
(``probe_python.py``, run under it) and refuses in one line, a part per python, naming the
variable to set:

* the trainer's python: a CPU build of torch (``torch.version.cuda`` and ``.hip`` both None), or
  no Transformer Engine where the run needs it (``actor.sequence_parallel: true``, or
  ``actor.attention: te``; ``auto`` takes SDPA without it); for a model with Gated DeltaNet layers
  (Qwen3.5), what they need on a GPU (``megatron_tepo/gdn_kernels.py``, the rule the actor's hybrid
  builder reads too): fla-core, and on Hopper GPUs (``nvidia-smi``'s compute capability, where it
  answers) a Triton whose gated backward fla computes right (< 3.4.0 or >= 3.7.1) or tilelang --
  unless ``MTEPO_GDN_KERNELS=torch`` asks for the pure-torch stand-in;
* the SGLang python (``rollout.engine: sglang`` only), found as the serve command finds it
  (``MTEPO_SGLANG_PYTHON``, else ``<repo>/.venv-sglang/bin/python`` where it exists, else the
  trainer's python): one that cannot import sglang, the CPU build (its venv carries the mark of
  ``tools/install_sglang_cpu.sh``), or one with a CPU build of torch;
* on any device, the SGLang python's version against the settings of the job that need a later
  SGLang than the declared floor (``megatron_tepo/rollout/sglang/versions.py``: ``actor.routing_replay:
  r3`` needs 0.5.7, ``launch.device: cpu`` 0.5.14, a Qwen3.5 model 0.5.9), read from its installed metadata before any
  server starts (an older SGLang's servers would die parsing their arguments). A ``cpu`` job is
  probed only when such a setting besides the device is on (its SGLang is tools/install_sglang_cpu.sh's
  0.5.23 otherwise).

It checks installs, not a GPU: the check may run where there is none (a nemo-run submission from
a login node). Left out: the CUDA driver and the GPUs themselves, whether TE imports (the trainer
finds out, in one line), apex, and versions other than SGLang's bound settings (a torch or SGLang
outside the declared ranges passes). ``launch.device: cpu`` jobs are otherwise not checked.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import List, Optional, Tuple

from megatron_tepo.gdn_kernels import kernels_problem
from megatron_tepo.launch.fit import FitError
from megatron_tepo.launch.spec import LaunchSpec

__all__ = ["PROBE", "probe_python", "check_pythons", "gpu_capabilities"]

PROBE = Path(__file__).resolve().with_name("probe_python.py")
SGLANG_HINT = "a python with a CUDA build of SGLang (pyproject.toml's sglang extra)"
TRAINER_HINT = ("a python with a CUDA build of torch and Transformer Engine (pip install '.[gpu]', "
                "or an NGC PyTorch container's)")


def probe_python(python: str, env: Optional[dict] = None, timeout: float = 120.0) -> dict:
    """What ``python`` has (``probe_python.py``'s JSON); ValueError naming the python if it does not
    run or answers something else."""
    try:
        res = subprocess.run([python, str(PROBE)], capture_output=True, text=True, timeout=timeout,
                             env=os.environ if env is None else env)
    except OSError as exc:
        raise ValueError(f"{python} does not run here ({exc.strerror or exc})") from None
    except subprocess.TimeoutExpired:
        raise ValueError(f"{python} does not run here (no answer within {timeout:g} s)") from None
    lines = res.stdout.strip().splitlines()
    try:
        info = json.loads(lines[-1]) if res.returncode == 0 and lines else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        why = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        raise ValueError(f"{python} does not run here ({why[:300]})")
    return info


def _torch(info: dict) -> str:
    t = info.get("torch")
    if not t:
        return "no torch"
    kind = f"CUDA {t['cuda']}" if t.get("cuda") else f"ROCm {t['hip']}" if t.get("hip") else "CPU build"
    return f"torch {t.get('version')} ({kind})"


def _gpu_torch(info: dict) -> bool:
    t = info.get("torch") or {}
    return bool(t.get("cuda") or t.get("hip"))


def _te_needed(spec: LaunchSpec) -> Optional[Tuple[str, str]]:
    """(the setting that needs Transformer Engine, the other way out) or None."""
    actor = spec.cfg.actor
    if actor.sequence_parallel:  # an MoE layer at TP > 1 needs it (the layout rules): no way out
        moe_tp = spec.shape().is_moe and spec.cfg.parallel.tp > 1
        return "actor.sequence_parallel: true", "" if moe_tp else ", or set actor.sequence_parallel: false"
    if actor.attention == "te":
        return "actor.attention: te", ", or set actor.attention: auto"
    return None


def _trainer(spec: LaunchSpec, python: str, setting: str, found: List[str]) -> List[str]:
    who = f"the trainer's python {python}"
    try:
        info = probe_python(python)
    except ValueError as exc:
        return [f"the trainer's python {exc}: set {setting} to {TRAINER_HINT}"]
    te = bool(info.get("transformer_engine"))
    hybrid = spec.shape().linear_layers > 0
    kernels = (f", fla-core {'installed' if info.get('fla') else 'not installed'}, Triton "
               f"{info.get('triton_version') or 'not installed'}, tilelang "
               f"{'installed' if info.get('tilelang') else 'not installed'}") if hybrid else ""
    found.append(f"trainer python: {python}: {_torch(info)}, Transformer Engine {'installed' if te else 'not installed'}"
                 f"{kernels}")
    if not _gpu_torch(info):
        return [f"launch.device: cuda, but {who} has {_torch(info)}: set {setting} to {TRAINER_HINT}"]
    need = _te_needed(spec)
    if need and not te:
        return [f"{need[0]} needs Transformer Engine, which {who} does not have: set {setting} to "
                f"{TRAINER_HINT}{need[1]}"]
    if hybrid:
        problem = kernels_problem(fla=bool(info.get("fla")), triton_version=info.get("triton_version"),
                                  tilelang=bool(info.get("tilelang")), capabilities=gpu_capabilities())
        if problem:
            return [f"{spec.shape().family}'s Gated DeltaNet layers, trained in {who}: {problem}"]
    return []


def gpu_capabilities(timeout: float = 30.0) -> Optional[List[Tuple[int, int]]]:
    """The compute capabilities of this machine's GPUs (``nvidia-smi --query-gpu=compute_cap``: no
    CUDA initialisation here), or None where they cannot be read (no ``nvidia-smi``, a login node
    without GPUs: the Hopper rule is then checked by the trainer when it builds the model)."""
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps = []
    for line in res.stdout.split() if res.returncode == 0 else ():
        major, _, minor = line.strip().partition(".")
        if not (major.isdigit() and minor.isdigit()):
            return None
        caps.append((int(major), int(minor)))
    return caps or None


def version_bound(spec: LaunchSpec) -> List[str]:
    """The settings of ``spec`` that need a later SGLang than the declared floor (keys of
    ``versions.MIN_VERSIONS``)."""
    from megatron_tepo.rollout.sglang.versions import CPU, QWEN3_5, QWEN3_5_FAMILIES, R3

    return [s for s, on in ((R3, spec.cfg.actor.routing_replay == "r3"), (CPU, spec.launch.device == "cpu"),
                            (QWEN3_5, spec.shape().family in QWEN3_5_FAMILIES)) if on]


def _sglang(spec: LaunchSpec, trainer_python: str, found: List[str]) -> List[str]:
    from megatron_tepo.rollout.sglang.options import configured_sglang_python, cpu_build_marker
    from megatron_tepo.rollout.sglang.versions import version_problem

    gpu = spec.launch.device == "cuda"

    python = configured_sglang_python()
    if python is None:
        python, source = trainer_python, "the trainer's python: no MTEPO_SGLANG_PYTHON, no .venv-sglang"
    else:
        source = "MTEPO_SGLANG_PYTHON" if "MTEPO_SGLANG_PYTHON" in os.environ else "the default, .venv-sglang"
    who, fix = f"the SGLang python {python} ({source})", f"set MTEPO_SGLANG_PYTHON to {SGLANG_HINT}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as the serve command runs it
    try:
        info = probe_python(python, env)
    except ValueError as exc:
        return [f"the SGLang python ({source}) {exc}: {fix}"]
    have = info.get("sglang_version") or ("installed" if info.get("sglang") else "not installed")
    found.append(f"SGLang python: {python} ({source}): {_torch(info)}, sglang {have}")
    problem = version_problem(info.get("sglang_version"), version_bound(spec))
    too_old = (f"{problem} in {who}: set MTEPO_SGLANG_PYTHON to a python with a newer SGLang "
               f"(docs/ROLLOUT.md#sglang-versions)")
    if not gpu:
        if not info.get("sglang"):
            return [f"{who} cannot import sglang: set MTEPO_SGLANG_PYTHON to a python with sglang "
                    f"(CPU: bash tools/install_sglang_cpu.sh)"]
        return [too_old] if problem else []
    marker = cpu_build_marker(python, info.get("prefix"))
    if marker is not None:
        return [f"launch.device: cuda, but {who} is SGLang's CPU build (tools/install_sglang_cpu.sh: {marker}): {fix}"]
    if not info.get("sglang"):
        return [f"launch.device: cuda, but {who} cannot import sglang: {fix}"]
    if not _gpu_torch(info):
        return [f"launch.device: cuda, but {who} has {_torch(info)}: {fix}"]
    if spec.launch.colocated and not info.get("torch_memory_saver"):
        return [f"{spec.launch.rollout.key}.placement: colocated starts the servers with SGLang's memory saver, "
                f"which {who} does not have (pip install torch_memory_saver, a dependency of SGLang's CUDA "
                f"install): {fix}"]
    return [too_old] if problem else []


def check_pythons(spec: LaunchSpec, trainer_python: str, setting: str = "TEPO_PYTHON") -> List[str]:
    """On ``launch.device: cuda``: raise :class:`~megatron_tepo.launch.fit.FitError` (one line, a
    part per python, each naming the variable to set; ``setting``: how the trainer's python is set) when the
    trainer's or the SGLang python is not one for a GPU job; return what was found, one line per
    python, for the report. ``launch.device: cpu``: only the SGLang python's version, and only when a
    setting besides the device needs a later SGLang (``actor.routing_replay: r3``); else ``[]``."""
    from megatron_tepo.rollout.sglang.versions import CPU

    found: List[str] = []
    if spec.launch.device != "cuda":
        if spec.cfg.rollout.engine == "sglang" and set(version_bound(spec)) - {CPU}:
            errors = _sglang(spec, trainer_python, found)
            if errors:
                raise FitError("; ".join(errors))
        return found
    errors = _trainer(spec, trainer_python, setting, found)
    if spec.cfg.rollout.engine == "sglang":
        errors += _sglang(spec, trainer_python, found)
    if errors:
        raise FitError("; ".join(errors))
    return found
