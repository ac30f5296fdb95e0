"""Model families for the Megatron actor: THE single source of truth for HF <-> Megatron.

One folder per family (``llama/``, ``qwen2/``, ``qwen3/``, ``qwen3_moe/``), each with its HF
config translation (``from_hf_config``) and its per-layer name table (``layer_mapping``); shared
GPT code in :mod:`.common`, spec choice in :mod:`.spec`, generic TP/PP sharding in :mod:`.sharding`.

Public API:
  * :func:`resolve_family` / :func:`family_config_from_hf` -- registry lookup by HF ``model_type``
    or ``architectures`` (unknown -> ValueError naming it and the supported ones).
  * :func:`hf_to_megatron` / :func:`megatron_to_hf` -- streaming converters between HF
    ``(name, full tensor)`` and Megatron ``(global name, full tensor)``.
  * :func:`load_hf_weights_into` -- shard an HF state dict onto this rank's model chunks.
  * :func:`load_hf_checkpoint_into` -- the same from an HF safetensors directory, each rank
    reading only its own slices (its TP shards, pipeline stage and experts).

The live actor's bucketed export to HF tensors (for the rollout weight sync and the end-of-run
export) is the actor's: :mod:`megatron_tepo.actor.export`, built on :class:`.common.MegatronToHFLayout`
and the sharding helpers here. The checkpoint converter reads the TP=PP=EP=1 layout from files and
uses :func:`megatron_to_hf` directly; both name experts by global index.
"""
from __future__ import annotations

from types import ModuleType
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from . import llama, qwen2, qwen3, qwen3_moe
from .common import (GPTFamilyConfig, LayerMapping, MegatronToHFLayout, convert_hf_to_megatron,
                     convert_megatron_to_hf, expected_hf_names)
from .sharding import (EMBEDDING, checkpoint_slices_equal, gather_full_tensors, load_checkpoint_slices_into,
                       load_megatron_state_into)

FAMILIES: Dict[str, ModuleType] = {m.FAMILY: m for m in (llama, qwen2, qwen3, qwen3_moe)}

__all__ = ["FAMILIES", "GPTFamilyConfig", "resolve_family", "family_config_from_hf",
           "layer_mapping", "hf_to_megatron", "megatron_to_hf", "load_hf_weights_into",
           "load_hf_checkpoint_into", "gather_full_tensors"]


def _field(hf_config, name):
    return hf_config.get(name) if isinstance(hf_config, Mapping) else getattr(hf_config, name, None)


def resolve_family(hf_config) -> ModuleType:
    """The family module for an HF config (dict or ``PretrainedConfig``)."""
    model_type = _field(hf_config, "model_type")
    for module in FAMILIES.values():
        if model_type in module.MODEL_TYPES:
            return module
    for arch in _field(hf_config, "architectures") or ():
        for module in FAMILIES.values():
            if arch in module.ARCHITECTURES:
                return module
    supported = sorted(a for m in FAMILIES.values() for a in m.ARCHITECTURES)
    raise ValueError(f"unsupported architecture: model_type={model_type!r}, "
                     f"architectures={_field(hf_config, 'architectures')!r}; supported: {supported} "
                     f"(model_type {sorted(t for m in FAMILIES.values() for t in m.MODEL_TYPES)})")


def family_config_from_hf(hf_config, spec: Optional[str] = None) -> GPTFamilyConfig:
    """Translate an HF config; ``spec`` defaults to TE when importable, else local."""
    if spec is None:
        from .spec import default_spec

        spec = default_spec()
    return resolve_family(hf_config).from_hf_config(hf_config, spec=spec)


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


def load_hf_weights_into(model_chunks: List[torch.nn.Module], hf_state_dict,
                         family_cfg: Optional[GPTFamilyConfig] = None, tp_group=None) -> List[str]:
    """Shard an HF state dict onto this rank's chunks; every HF tensor consumed exactly once and
    every local parameter filled (ValueError naming the tensor otherwise). ``family_cfg`` defaults
    to the ``family_cfg`` attribute the actor puts on its model chunks."""
    if family_cfg is None:
        from .sharding import unwrap_model

        family_cfg = getattr(unwrap_model(model_chunks[0]), "family_cfg", None)
        if family_cfg is None:
            raise ValueError("load_hf_weights_into needs family_cfg (the chunks carry none)")
    return load_megatron_state_into(model_chunks, hf_to_megatron(hf_state_dict, family_cfg),
                                    family_cfg.tie_word_embeddings, tp_group=tp_group)


def load_hf_checkpoint_into(model_chunks: List[torch.nn.Module], ckpt, family_cfg: GPTFamilyConfig,
                            tp_group=None) -> List[str]:
    """Fill this rank's chunks from an HF safetensors checkpoint (a directory or a
    :class:`~megatron_tepo.checkpoint.hf_io.LazyHFCheckpoint`), reading only this rank's slices
    (:func:`.sharding.load_checkpoint_slices_into`); bit for bit what :func:`load_hf_weights_into`
    gives from the loaded state dict. The checkpoint's names are checked first, on every rank
    alike: a missing tensor of the model or a tensor the mapping does not know is a ValueError
    naming it (and the checkpoint / file). A tied ``lm_head.weight`` stored beside the embedding
    must equal it (each rank compares its own embedding rows)."""
    from megatron_tepo.checkpoint.hf_io import LazyHFCheckpoint

    own = not isinstance(ckpt, LazyHFCheckpoint)
    if own:
        ckpt = LazyHFCheckpoint(ckpt)
    try:
        mapping = layer_mapping(family_cfg)
        expected = expected_hf_names(family_cfg, mapping)
        known = set(expected)
        tied = family_cfg.tie_word_embeddings
        for name in ckpt.names():
            if name not in known and not (tied and name == "lm_head.weight"):
                raise ValueError(f"HF tensor {name!r} in {ckpt.file_of(name)} has no Megatron counterpart "
                                 f"in the {family_cfg.family} mapping (spec={family_cfg.spec})")
        missing = [n for n in expected if n not in ckpt]
        if missing:
            raise ValueError(f"HF checkpoint {ckpt.path} lacks {len(missing)} tensor(s) of the "
                             f"{family_cfg.family} model, e.g. {missing[:8]}")
        filled = load_checkpoint_slices_into(model_chunks, ckpt, MegatronToHFLayout(family_cfg, mapping),
                                             tied, tp_group=tp_group)
        if tied and "lm_head.weight" in ckpt and not checkpoint_slices_equal(
                model_chunks, ckpt, EMBEDDING, "lm_head.weight", tp_group=tp_group):
            raise ValueError(f"tie_word_embeddings=True but HF tensor 'lm_head.weight' in "
                             f"{ckpt.file_of('lm_head.weight')} differs from 'model.embed_tokens.weight'")
        return filled
    finally:
        if own:
            ckpt.close()
