"""Model families for the Megatron actor: THE single source of truth for HF <-> Megatron.

One folder per family (``llama/``, ``qwen2/``, ``qwen3/``, ``qwen3_moe/``, ``qwen3_5/`` with both
Qwen3.5 families, dense and MoE), each exporting its :class:`~.names.FamilySpec` as ``SPEC``
(``qwen3_5/`` also ``MOE_SPEC``): the HF ``model_type`` / ``architectures`` it answers to,
its HF config translation (``from_hf_config`` -> :class:`GPTFamilyConfig`, MoE sizes and router
settings typed in its ``moe`` field, :class:`MoEConfig`) and its per-layer name table
(``layer_mapping``); shared GPT code by job: the family config (:mod:`.family`), the fused-tensor
ops (:mod:`.fused`), the name tables (:mod:`.names`) and the converters (:mod:`.converters`). What megatron's layer spec and
``TransformerConfig`` need of a family comes from its config
(in megatron's words: :mod:`megatron_tepo.megatron.family_kwargs`). Which rank holds which slice (TP/PP/EP placement), the layer spec and
the loading of HF weights into model chunks are the megatron backend's: :mod:`megatron_tepo.megatron`.

Public API:
  * :data:`FAMILIES` (name -> :class:`FamilySpec`), :func:`resolve_family` /
    :func:`family_config_from_hf` -- registry lookup by HF ``model_type`` or ``architectures``
    (unknown -> ValueError naming it and the supported ones).
  * :func:`hf_to_megatron` / :func:`megatron_to_hf` -- streaming converters between HF
    ``(name, full tensor)`` and Megatron ``(global name, full tensor)``, in the text model's names
    (a causal LM's).
  * :func:`checkpoint_naming` -- how a checkpoint's stored names relate to those: the one
    translation of a multimodal checkpoint's (Qwen3.5's ``model.language_model.*``), and which of
    its tensors are only carried (its vision tower, its MTP layers).

The live actor's bucketed export to HF tensors (for the rollout weight sync and the end-of-run
export) is the actor's: :mod:`megatron_tepo.actor.export`, built on :class:`.converters.MegatronToHFLayout`
and :mod:`megatron_tepo.megatron.sharding`. The checkpoint converter reads the TP=PP=EP=1 layout from files and
uses :func:`megatron_to_hf` directly; both name experts by global index.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, Iterator, Mapping, Optional, Tuple, Union

import torch

from megatron_tepo.routing import RoutingShape

from . import llama, qwen2, qwen3, qwen3_5, qwen3_moe
from .family import GPTFamilyConfig, LinearAttentionConfig, MoEConfig
from .names import CheckpointNaming, FamilySpec, LayerMapping
from .converters import convert_hf_to_megatron, convert_megatron_to_hf

FAMILIES: Dict[str, FamilySpec] = {s.name: s for s in (llama.SPEC, qwen2.SPEC, qwen3.SPEC, qwen3_moe.SPEC,
                                                       qwen3_5.SPEC, qwen3_5.MOE_SPEC)}

__all__ = ["FAMILIES", "FamilySpec", "GPTFamilyConfig", "MoEConfig", "LinearAttentionConfig", "resolve_family",
           "family_config_from_hf", "layer_mapping", "hf_to_megatron", "megatron_to_hf", "routing_shape_of",
           "CheckpointNaming", "checkpoint_naming"]


def _field(hf_config, name):
    return hf_config.get(name) if isinstance(hf_config, Mapping) else getattr(hf_config, name, None)


def resolve_family(hf_config) -> FamilySpec:
    """The family of an HF config (dict or ``PretrainedConfig``)."""
    model_type = _field(hf_config, "model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    for arch in _field(hf_config, "architectures") or ():
        for family in FAMILIES.values():
            if arch in family.architectures:
                return family
    supported = sorted(a for f in FAMILIES.values() for a in f.architectures)
    raise ValueError(f"unsupported architecture: model_type={model_type!r}, "
                     f"architectures={_field(hf_config, 'architectures')!r}; supported: {supported} "
                     f"(model_type {sorted(t for f in FAMILIES.values() for t in f.model_types)})")


def family_config_from_hf(hf_config, spec: str) -> GPTFamilyConfig:
    """Translate an HF config for the layer spec ``spec`` ("te" or "local", which names the norm
    tensors; the actor derives it from its resolved ``actor.attention``:
    :func:`megatron_tepo.megatron.resolve.family_spec`)."""
    return resolve_family(hf_config).from_hf_config(hf_config, spec=spec)


def checkpoint_naming(hf_config) -> CheckpointNaming:
    """How the checkpoints of ``hf_config``'s model name their tensors against the text model's names
    the mapping uses (:class:`~.names.CheckpointNaming`; e.g. a published Qwen3.5
    ``*ForConditionalGeneration``: the text model under ``model.language_model.``, the vision tower
    and MTP layers carried)."""
    return resolve_family(hf_config).checkpoint_naming(hf_config)


def routing_shape_of(model_dir: str) -> Optional[RoutingShape]:
    """The MoE routing contract of the HF checkpoint in ``model_dir`` as its family's config says
    (:meth:`GPTFamilyConfig.routing_shape`; None for a dense model): what the trainer hands the
    rollout engine (``EngineSettings.routing``) for ``actor.routing_replay: r3``. An unreadable
    ``config.json``: ValueError naming it."""
    path = Path(model_dir) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the model's config ({type(exc).__name__}: {exc})") from None
    return family_config_from_hf(hf_config, spec="local").routing_shape()


def layer_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    return FAMILIES[cfg.family].layer_mapping(cfg)


def _items(state) -> Iterable[Tuple[str, torch.Tensor]]:
    return state.items() if isinstance(state, Mapping) else state


def hf_to_megatron(hf_state_iter: Union[Mapping, Iterable[Tuple[str, torch.Tensor]]],
                   family_cfg: GPTFamilyConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """HF ``(name, full tensor)`` -> Megatron ``(global name, full tensor)``; each HF tensor used once."""
    return convert_hf_to_megatron(_items(hf_state_iter), family_cfg, layer_mapping(family_cfg))


def megatron_to_hf(megatron_iter: Union[Mapping, Iterable[Tuple[str, torch.Tensor]]],
                   family_cfg: GPTFamilyConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """Megatron ``(global name, full tensor)`` -> HF ``(name, full tensor)``, tensor by tensor."""
    return convert_megatron_to_hf(_items(megatron_iter), family_cfg, layer_mapping(family_cfg))
