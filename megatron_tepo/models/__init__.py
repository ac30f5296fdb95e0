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
  * :func:`export_hf_state` -- this rank's stage as HF ``(name, full tensor)`` (params or grads;
    an :class:`HFExport`, also readable as flat buckets gathered to one rank), for the actor's
    checks and the rollout weight sync. The checkpoint converter reads the TP=PP=EP=1 layout
    from files and uses :func:`megatron_to_hf` directly; both name experts by global index.
"""
from __future__ import annotations

from types import ModuleType
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from . import llama, qwen2, qwen3, qwen3_moe
from .common import (GPTFamilyConfig, LayerMapping, MegatronToHFLayout, convert_hf_to_megatron,
                     convert_megatron_to_hf)
from .sharding import ExportBuffers, FlatBucket, gather_full_tensors, iter_flat_buckets, load_megatron_state_into

FAMILIES: Dict[str, ModuleType] = {m.FAMILY: m for m in (llama, qwen2, qwen3, qwen3_moe)}

__all__ = ["FAMILIES", "GPTFamilyConfig", "resolve_family", "family_config_from_hf",
           "layer_mapping", "hf_to_megatron", "megatron_to_hf", "load_hf_weights_into",
           "export_hf_state", "HFExport", "FlatBucket", "ExportBuffers", "gather_full_tensors"]


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


EXPORT_BUCKET_BYTES = 64 << 20


class HFExport:
    """A lazy export of this rank's pipeline stage as HF tensors (nothing moves before iterating).

    * ``for name, tensor in export`` -- every rank gets ``(HF name, full tensor)`` for its stage,
      all-gathered in buckets of ``bucket_bytes`` (one collective per bucket, see
      :func:`.sharding.iter_flat_buckets`); the tensors are views into their bucket's buffer.
    * :meth:`flat_buckets` -- the same stream as :class:`.sharding.FlatBucket` s, optionally
      gathered to one rank only and into reused buffers: what the rollout weight sync consumes.

    ``dtype``: cast floating tensors to it BEFORE the collectives (bit for bit what casting the
    full tensors would give: unsharding and splitting only move elements); None keeps the
    parameters' dtype. Expert parameters (MoE with expert parallelism) are collected from every
    EP rank under their global expert index when ``all_experts`` (default: for params; for grads
    each rank reports its own experts' gradients, as the per-rank equivalence checks read them).
    Collective: every rank of the stage's TP (and EP) groups must consume it to the end.
    """

    def __init__(self, model_chunks: List[torch.nn.Module], family_cfg: GPTFamilyConfig,
                 what: str = "param", tp_group=None, dtype: Optional[torch.dtype] = None,
                 bucket_bytes: int = EXPORT_BUCKET_BYTES, all_experts: Optional[bool] = None):
        if what not in ("param", "grad"):
            raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
        self.model_chunks, self.family_cfg, self.what, self.tp_group = model_chunks, family_cfg, what, tp_group
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.all_experts = (what == "param") if all_experts is None else all_experts

    def flat_buckets(self, bucket_bytes: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                     dst: Optional[int] = None, reuse: bool = False,
                     buffers: Optional[ExportBuffers] = None) -> Iterator[FlatBucket]:
        """Buckets of at most ``bucket_bytes`` (default: the export's); ``dtype`` overrides the
        export's; ``dst`` / ``reuse`` / ``buffers`` as in :func:`.sharding.iter_flat_buckets`."""
        return iter_flat_buckets(self.model_chunks, MegatronToHFLayout(self.family_cfg, layer_mapping(self.family_cfg)),
                                 bucket_bytes or self.bucket_bytes, dtype=dtype or self.dtype, what=self.what,
                                 dst=dst, tp_group=self.tp_group, all_experts=self.all_experts, reuse=reuse,
                                 buffers=buffers)

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for bucket in self.flat_buckets():
            yield from bucket.named_tensors()


def export_hf_state(model_chunks: List[torch.nn.Module], family_cfg: GPTFamilyConfig,
                    what: str = "param", tp_group=None, dtype: Optional[torch.dtype] = None,
                    bucket_bytes: int = EXPORT_BUCKET_BYTES, all_experts: Optional[bool] = None) -> HFExport:
    """This rank's pipeline stage as HF ``(name, full tensor)`` (an iterable :class:`HFExport`);
    collective over the TP (and EP) groups. Bit for bit
    ``megatron_to_hf(gather_full_tensors(...))`` (cast to ``dtype``), plus every EP rank's experts."""
    return HFExport(model_chunks, family_cfg, what=what, tp_group=tp_group, dtype=dtype,
                    bucket_bytes=bucket_bytes, all_experts=all_experts)
