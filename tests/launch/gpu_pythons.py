"""Stand-in pythons for GPU launches tested on CPU (a ``launch.device: cuda`` job's fit check asks
its pythons what they have: megatron_tepo/launch/pythons.py).

:func:`standin_python` writes ``<folder>/bin/python``, a script that answers the probe
(``megatron_tepo/launch/probe_python.py``, run by path) with what it is told (a CUDA or CPU build of
torch, Transformer Engine, sglang; its ``sys.prefix`` is ``<folder>``) and runs everything else with
the test's own python (the fit check, ``tepo_free_port``). :func:`gpu_pythons` is a GPU job's pair,
as environment variables (``TEPO_PYTHON``, ``MTEPO_SGLANG_PYTHON``)."""
import json
import shlex
import sys
from pathlib import Path
from typing import Dict, Optional

SCRIPT = """#!/bin/bash
case "$*" in
    */megatron_tepo/launch/probe_python.py) printf '%s\\n' {answer}; exit 0 ;;
{cases}esac
exec {real} "$@"
"""


def standin_python(folder: Path, *, cuda: Optional[str] = "12.6", te: bool = True, sglang: bool = False,
                   memory_saver: Optional[bool] = None, sglang_version: Optional[str] = None,
                   fla: bool = True, triton_version: Optional[str] = "3.7.1", tilelang: bool = False,
                   real: str = sys.executable, cases: str = "") -> Path:
    """``cases``: more arms of the script's ``case "$*" in`` (matched on all its arguments);
    ``memory_saver``: whether torch_memory_saver is installed (default: with sglang, as SGLang's
    CUDA install brings it); ``sglang_version``: its SGLang's version (default: 0.5.23, the tests'
    own, with sglang); ``fla`` (fla-core), ``triton_version`` and ``tilelang``: what a Qwen3.5's
    Gated DeltaNet needs (default: fla-core with a Triton whose backward fla computes right)."""
    py = folder / "bin" / "python"
    py.parent.mkdir(parents=True, exist_ok=True)
    torch = {"version": f"2.6.0+cu{cuda.replace('.', '')}" if cuda else "2.6.0+cpu", "cuda": cuda, "hip": None}
    answer = json.dumps({"executable": str(py), "prefix": str(folder), "torch": torch, "transformer_engine": te,
                         "sglang": sglang, "sglang_version": sglang_version or ("0.5.23" if sglang else None),
                         "torch_memory_saver": sglang if memory_saver is None else memory_saver,
                         "fla": fla, "triton_version": triton_version, "tilelang": tilelang})
    py.write_text(SCRIPT.format(answer=shlex.quote(answer), real=shlex.quote(real), cases=cases))
    py.chmod(0o755)
    return py


def gpu_pythons(root: Path) -> Dict[str, str]:
    """A GPU job's trainer python (CUDA torch, Transformer Engine) and SGLang python (CUDA torch,
    sglang), as the launchers' variables."""
    return {"TEPO_PYTHON": str(standin_python(root / "gpu-trainer")),
            "MTEPO_SGLANG_PYTHON": str(standin_python(root / "gpu-sglang", te=False, sglang=True))}
