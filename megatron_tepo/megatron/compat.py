"""The one place where megatron_tepo asks which megatron-core it runs on.

Supported: :data:`SUPPORTED` (megatron-core 0.16.1, the newest for Python 3.11, up to 0.19.x,
which needs Python >= 3.12; both ends are tested). Everything that differs between those versions
and that megatron_tepo calls goes through this module (or, for the CPU work-arounds, through
``cpu_patches.VERSIONS``), so that no other module compares version numbers.

Leaves out: versions outside the range (:func:`check_supported` refuses them with a one-line
error; ``MTEPO_ALLOW_UNTESTED_MCORE=1`` lets a developer try one anyway).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["SUPPORTED", "mcore_version", "reported_version", "check_supported", "LEGACY_COMMON_FILE",
           "common_state_in_dcp", "dist_ckpt_common_files", "save_strategy_base", "adopt_current_lr_in_saved_groups",
           "whole_layer_cuda_graph_kwargs", "async_save_kwargs", "hybrid_model_available"]

#: the megatron-core versions this package is tested with (keep in step with pyproject.toml)
SUPPORTED = SpecifierSet(">=0.16.1,<0.20")


@functools.lru_cache(maxsize=None)
def mcore_version() -> Version:
    """The installed megatron-core's version (from its package metadata)."""
    try:
        return Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("megatron-core is not installed: pip install 'megatron-core"
                           f"{SUPPORTED}' (see README.md)") from None


def reported_version() -> str:
    """The version megatron-core says it is (``megatron.core.__version__``; ``"?"`` where it says
    none): what a converted checkpoint's sidecar records."""
    import megatron.core

    return getattr(megatron.core, "__version__", "?")


def check_supported(version: Version | None = None) -> Version:
    """Return the megatron-core version, or raise RuntimeError when it is outside :data:`SUPPORTED`."""
    version = version or mcore_version()
    if version not in SUPPORTED and os.environ.get("MTEPO_ALLOW_UNTESTED_MCORE") != "1":
        raise RuntimeError(f"megatron-core {version} is not supported (tested: {SUPPORTED}); "
                           "install one in that range, or set MTEPO_ALLOW_UNTESTED_MCORE=1 to try it")
    return version


# ------------------------------------------------------------------ dist_checkpointing layout
#: the file megatron-core <= 0.18 writes the common (non-tensor) state of a torch_dist checkpoint to
LEGACY_COMMON_FILE = "common.pt"


def common_state_in_dcp(version: Version | None = None) -> bool:
    """Whether ``dist_checkpointing.save`` stores the common state inside the torch_dist files (a
    ``ShardedObject`` keyed ``common_state``, megatron-core >= 0.19) rather than in ``common.pt``.
    Either loads on 0.19 (it reads a legacy ``common.pt`` when present)."""
    return (version or mcore_version()) >= Version("0.19.0")


def dist_ckpt_common_files(directory, version: Version | None = None) -> tuple:
    """The common-state files a torch_dist checkpoint in ``directory`` must have here: ``common.pt``
    before 0.19, or when the checkpoint has one (written by an older megatron-core); none
    otherwise (the common state is then part of the files PyTorch's ``.metadata`` indexes)."""
    from pathlib import Path

    if not common_state_in_dcp(version) or (Path(directory) / LEGACY_COMMON_FILE).exists():
        return (LEGACY_COMMON_FILE,)
    return ()


def save_strategy_base() -> type:
    """The class a custom torch_dist save strategy derives from. Up to 0.18:
    ``dist_checkpointing.strategies.base.SaveShardedStrategy``. 0.19 removed that module, and its
    ``dist_checkpointing.save`` silently replaces any strategy that is not a
    ``TorchDistSaveShardedStrategy`` by a default one: so from 0.19, that class itself."""
    if mcore_version() >= Version("0.19.0"):
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        return TorchDistSaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy

    return SaveShardedStrategy


def adopt_current_lr_in_saved_groups(saved_optimizer_state, current_optimizer) -> int:
    """Before loading an optimizer state whose learning rates this run replaces anyway
    (``train.allow_config_change``): give every saved parameter group the current groups'
    ``max_lr`` / ``min_lr``. From 0.19 megatron-core pairs saved and current groups by their
    settings (``optimizer.param_group_identifier_keys``: ``max_lr``, ``min_lr``, weight-decay
    multipliers, ...), up to 0.18 by position; with a changed learning rate 0.19 finds no pair and
    refuses the load. The actor gives every group the same ``max_lr`` / ``min_lr``
    (``MegatronActor.apply_optim_settings``), so the saved groups then pair as before. Changes
    ``saved_optimizer_state`` in place; returns how many saved groups it changed (0 when the
    current groups disagree among themselves, which this does not handle)."""
    current = {(g.get("max_lr"), g.get("min_lr"))
               for opt in getattr(current_optimizer, "chained_optimizers", [current_optimizer])
               for g in opt.optimizer.param_groups}
    if len(current) != 1:
        return 0
    (max_lr, min_lr), = current
    changed = 0
    todo = [saved_optimizer_state]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            groups = node.get("param_groups")
            if isinstance(groups, list):
                for g in groups:
                    if isinstance(g, dict) and "max_lr" in g:
                        g["max_lr"], g["min_lr"] = max_lr, min_lr
                        changed += 1
            todo.extend(v for k, v in node.items() if k != "param_groups")
        elif isinstance(node, (list, tuple)):
            todo.extend(node)
    return changed


# ------------------------------------------------------------------ TransformerConfig
def whole_layer_cuda_graph_kwargs(config_cls: type) -> dict:
    """``TransformerConfig`` keyword arguments that say what megatron's default says -- CUDA graphs,
    where enabled, capture the whole layer -- the way it no longer warns about: its default
    ``"full"`` is deprecated in favour of an empty list ("full scope is deprecated" on every actor
    build). The field was ``cuda_graph_scope`` and is ``cuda_graph_modules`` in 0.19 (where
    ``cuda_graph_scope`` itself is deprecated); which one ``config_cls`` has decides."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    return {"cuda_graph_modules": []} if "cuda_graph_modules" in fields else {"cuda_graph_scope": []}


# ------------------------------------------------------------------ asynchronous checkpoint saves
def async_save_kwargs(save_fn=None) -> dict:
    """``dist_checkpointing.save``'s arguments for an asynchronous save: ``async_sharded_save``, and
    on megatron-core >= 0.19 (which defaults to NVIDIA's resiliency extension, an extra package)
    ``async_strategy="mcore"``, megatron-core's own writer, which 0.16.1 always uses."""
    import inspect

    if save_fn is None:
        from megatron.core.dist_checkpointing import save as save_fn
    kwargs = {"async_sharded_save": True}
    if "async_strategy" in inspect.signature(save_fn).parameters:
        kwargs["async_strategy"] = "mcore"
    return kwargs


# ------------------------------------------------------------------ model builders
@functools.lru_cache(maxsize=None)
def hybrid_model_available() -> bool:
    """Whether this megatron-core has ``HybridModel`` (``megatron.core.models.hybrid``: 0.18 on;
    0.16.1 and 0.17 have only ``MambaModel``, which knows no Gated DeltaNet layer). The actor's
    ``model_builder: auto`` takes it wherever it is (megatron_tepo/megatron/gpt.py)."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core.models.hybrid.hybrid_model") is not None
    except ModuleNotFoundError:
        return False
