"""What the Gated DeltaNet layers of a Qwen3.5 hybrid need to train on a GPU, as one rule read by
both sides: the actor's hybrid builder (``megatron/hybrid.py``, through
``megatron/cpu_patches.py:fla_backward_refusal``), which knows this process's GPU and packages, and
the launch's check of the trainer's python (``launch/pythons.py``), which knows what that python
has installed (``launch/probe_python.py``) before any server starts. Standard library only: the
launch imports it without torch or megatron-core.

A GPU run takes flash-linear-attention's Triton kernels (the ``fla`` module of fla-core), and:

* without fla-core it falls back to the pure-torch stand-in (``megatron/gated_delta_rule.py``: a
  Python loop over 64-token chunks in fp32, every packed sequence padded to the longest), slow
  enough that the launch refuses it unless it is asked for by name (:data:`STAND_IN_ENV` ``=torch``);
* on Hopper (compute capability 9.x) fla-core 0.6 refuses its gated backward with Triton in
  [3.4.0, 3.7.1), which computes it wrong there (fla issue #640), unless tilelang is installed
  (:func:`backward_refusal`).

Left out: whether the kernels compile or run (only a GPU shows that: benchmarks/gpu_check.sh's
``qwen3_5`` step), fla-core's own version range, GPUs other than NVIDIA's.
"""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional, Sequence, Tuple

__all__ = ["STAND_IN_ENV", "FLA_INSTALL", "BAD_TRITON", "WAYS_OUT", "stand_in_chosen", "backward_refusal",
           "kernels_problem", "stand_in_warning"]

#: ``MTEPO_GDN_KERNELS=torch``: train on the pure-torch stand-in, asked for by name
STAND_IN_ENV = "MTEPO_GDN_KERNELS"
#: how to get flash-linear-attention's kernels
FLA_INSTALL = "pip install fla-core"
#: the Triton versions [low, high) whose gated backward fla refuses on Hopper (without tilelang)
BAD_TRITON = ((3, 4, 0), (3, 7, 1))
#: the ways out of a refused backward
WAYS_OUT = (f"install Triton >= 3.7.1 (or < 3.4.0) or tilelang, or set {STAND_IN_ENV}=torch to train on the "
            f"pure-torch stand-in (slower)")


def stand_in_chosen(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the user asked for the pure-torch stand-in by name (``MTEPO_GDN_KERNELS=torch``)."""
    return (os.environ if environ is None else environ).get(STAND_IN_ENV) == "torch"


def _release(version: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``"3.6.0+git1234"`` -> ``(3, 6, 0)``; None when it starts with no number."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    if not m:
        return None
    parts = tuple(int(p) for p in m.group(1).split("."))
    return parts + (0,) * (3 - len(parts))


def backward_refusal(capability: Optional[Sequence[int]], triton_version: Optional[str],
                     tilelang: bool) -> Optional[str]:
    """Why flash-linear-attention's gated backward would refuse to run on a GPU of compute
    ``capability`` (``(9, 0)``; None: unknown, not judged) with Triton ``triton_version`` and
    tilelang installed or not, or None when it runs (any GPU but Hopper, tilelang, or a Triton
    outside [3.4.0, 3.7.1))."""
    have = _release(triton_version)
    if capability is None or int(capability[0]) != 9 or tilelang or have is None:
        return None
    if not BAD_TRITON[0] <= have < BAD_TRITON[1]:
        return None
    return (f"flash-linear-attention refuses the Gated DeltaNet backward on a Hopper GPU with Triton "
            f"{triton_version} (3.4.0 <= Triton < 3.7.1 computes it wrong there: fla issue #640)")


def kernels_problem(*, fla: bool, triton_version: Optional[str], tilelang: bool,
                    capabilities: Optional[Sequence[Sequence[int]]],
                    environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """What keeps a GPU run from training Gated DeltaNet layers on flash-linear-attention's kernels,
    with the ways out (one line), or None: ``fla`` (fla-core installed), ``triton_version`` (None:
    not installed), ``tilelang`` (installed), ``capabilities`` (the GPUs' compute capabilities; None:
    not seen, the Hopper rule is then the trainer's, at model build). The stand-in asked for by name
    needs nothing."""
    if stand_in_chosen(environ):
        return None
    if not fla:
        return (f"Gated DeltaNet layers need flash-linear-attention's kernels on a GPU, and fla-core is not "
                f"installed: {FLA_INSTALL} (on Hopper with Triton >= 3.7.1 or tilelang), or set "
                f"{STAND_IN_ENV}=torch to train on the pure-torch stand-in (a Python loop over 64-token chunks "
                f"in fp32: slow)")
    if triton_version is None:
        return (f"flash-linear-attention's kernels are Triton, which is not installed: install Triton (>= 3.7.1 "
                f"on Hopper, or tilelang), or set {STAND_IN_ENV}=torch to train on the pure-torch stand-in (slower)")
    for cap in sorted({tuple(c) for c in capabilities or ()}):
        why = backward_refusal(cap, triton_version, tilelang)
        if why:
            return f"{why}: {WAYS_OUT}"
    return None


def stand_in_warning(why: str) -> str:
    """The line a GPU run prints (once) when it trains on the stand-in it did not ask for."""
    return (f"WARNING: the Gated DeltaNet layers run on the pure-torch stand-in ({why}): a Python loop over "
            f"64-token chunks in fp32, every packed sequence padded to the longest, many times slower than "
            f"flash-linear-attention's kernels: {FLA_INSTALL} (on Hopper with Triton >= 3.7.1 or tilelang); "
            f"set {STAND_IN_ENV}=torch to choose the stand-in and silence this")
