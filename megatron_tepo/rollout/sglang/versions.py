"""Which SGLang release each version-bound setting needs (:data:`MIN_VERSIONS`), and the one-line
refusal of a server or SGLang python older than a setting it is asked to serve
(:func:`version_problem`, :func:`check_version`).

``pyproject.toml`` declares ``sglang>=0.5.6,<0.6``: 0.5.6 is the floor of everything the fleet does
by default. A few settings need a later release; each is a row of :data:`MIN_VERSIONS`, read in
the releases' own sources:

* ``actor.routing_replay: r3`` -- ``--enable-return-routed-experts`` and ``/generate``'s
  ``return_routed_experts``: first in 0.5.7 (absent from 0.5.6.post2's ``server_args.py`` and
  ``io_struct.py``; 0.5.7 returns the routing of ``[0, prompt + output - 1)``, base64 int32, the
  layout :mod:`.routing` decodes; ``routed_experts_start_len``, which the fleet sends as 0, came in
  0.5.8 and an earlier server ignores it, answering the same range). On an older SGLang the
  servers die parsing their arguments.
* ``launch.device: cpu`` -- the CPU servers' ``--cuda-graph-backend-decode`` /
  ``--cuda-graph-backend-prefill`` (:func:`~megatron_tepo.rollout.sglang.options.server_command`):
  first in 0.5.14 (0.5.6 - 0.5.13 name it ``--disable-cuda-graph``). tools/install_sglang_cpu.sh
  installs 0.5.23.
* a Qwen3.5 model (HF ``model_type`` ``qwen3_5`` / ``qwen3_5_moe``, the project's families of the
  same names) -- SGLang's ``qwen3_5`` models (``python/sglang/srt/models/qwen3_5.py``:
  ``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``): first in 0.5.9
  (absent from 0.5.8.post1's wheel, which has ``qwen3_next.py`` only). On an older SGLang the
  servers die on an unknown architecture after loading nothing.

Who checks: the launch, before any server starts (the fit check reads the SGLang python's version:
``megatron_tepo/launch/pythons.py``), and the fleet, for servers it attaches to by URL with
routing replay on (each server's ``/server_info`` reports its ``version``: ``fleet.py``). A Qwen3.5
model is the launch's check only: a server the fleet attaches to that answers has loaded the model
already, and one the fleet starts itself on an older SGLang dies before it is healthy, naming the
architecture in its log.

Left out: the upper bound (``<0.6``, the first minor not read), and versions that are not releases
(a source checkout's ``0.5.24.dev0`` counts as 0.5.24).
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, Optional, Tuple

__all__ = ["DECLARED_MINIMUM", "R3", "CPU", "QWEN3_5", "QWEN3_5_FAMILIES", "MIN_VERSIONS", "parse_version", "version_problem", "check_version"]

#: the floor of pyproject.toml's ``sglang`` extra (tests/rollout/test_dependency_ranges.py holds them equal)
DECLARED_MINIMUM = "0.5.6"

R3 = "actor.routing_replay: r3"
CPU = "launch.device: cpu"
QWEN3_5 = "a Qwen3.5 model"
#: the model families (``GPTFamilyConfig.family``, the HF ``model_type``) that need :data:`QWEN3_5`'s release
QWEN3_5_FAMILIES = ("qwen3_5", "qwen3_5_moe")
#: setting (as the user writes it) -> (the first SGLang release that has what it needs, what that is)
MIN_VERSIONS: Dict[str, Tuple[str, str]] = {
    R3: ("0.5.7", "--enable-return-routed-experts"),
    CPU: ("0.5.14", "the CPU servers' --cuda-graph-backend-decode/-prefill"),
    QWEN3_5: ("0.5.9", "its qwen3_5 models, Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration"),
}


def parse_version(version: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``"0.5.6.post2"`` -> ``(0, 5, 6)``: the release numbers a version starts with (a ``.postN``,
    ``rcN`` or ``.devN`` tail dropped); None when it starts with none (missing, ``"fake"``)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def version_problem(version: Optional[str], settings: Iterable[str]) -> Optional[str]:
    """What is wrong with serving ``settings`` (keys of :data:`MIN_VERSIONS`; others need only the
    declared floor) on SGLang ``version``, or None when nothing is:
    ``"actor.routing_replay: r3 needs SGLang >= 0.5.7 (--enable-return-routed-experts), found 0.5.6"``
    (the caller says where it was found). A version that cannot be read is a problem for every
    bound setting (it may be older)."""
    bound = [(s, *MIN_VERSIONS[s]) for s in settings if s in MIN_VERSIONS]
    have = parse_version(version)
    short = [(s, need, what) for s, need, what in bound if have is None or have < parse_version(need)]
    if not short:
        return None
    found = f"found {version}" if have is not None else f"its version is unknown ({version!r})"
    return "; ".join(f"{s} needs SGLang >= {need} ({what})" for s, need, what in short) + f", {found}"


def check_version(version: Optional[str], settings: Iterable[str], where: str) -> None:
    """ValueError (one line, naming ``where``, each setting and its minimum) when ``version`` is
    older than a bound setting of ``settings`` needs."""
    problem = version_problem(version, settings)
    if problem is not None:
        raise ValueError(f"{where}: {problem} (docs/ROLLOUT.md#sglang-versions)")
