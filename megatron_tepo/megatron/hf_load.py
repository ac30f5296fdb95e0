"""Fill this rank's Megatron model chunks with HF weights: the family's name mapping
(:mod:`megatron_tepo.models`) composed with the generic placement of :mod:`.sharding`.

* :func:`load_hf_weights_into` -- from an HF state dict in memory (every rank holds it whole).
* :func:`load_hf_checkpoint_into` -- from an open HF safetensors reader, each rank reading only
  its own slices (its TP shards, pipeline stage and experts); bit for bit the same result.

Left out: writing HF weights (the actor's :mod:`megatron_tepo.actor.export` and the converter's
:mod:`megatron_tepo.checkpoint.megatron_to_hf` do that).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megatron_tepo.models import GPTFamilyConfig, hf_to_megatron, layer_mapping
from megatron_tepo.models.converters import MegatronToHFLayout, expected_hf_names

from .sharding import EMBEDDING, checkpoint_slices_equal, load_checkpoint_slices_into, load_megatron_state_into

__all__ = ["load_hf_weights_into", "load_hf_checkpoint_into"]


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
    layout = MegatronToHFLayout(family_cfg, layer_mapping(family_cfg))
    return load_megatron_state_into(model_chunks, hf_to_megatron(hf_state_dict, family_cfg),
                                    family_cfg.tie_word_embeddings, tp_group=tp_group, gated=layout.gated)


def load_hf_checkpoint_into(model_chunks: List[torch.nn.Module], ckpt, family_cfg: GPTFamilyConfig,
                            tp_group=None, select=None) -> List[str]:
    """Fill this rank's chunks from an open HF safetensors checkpoint reader (a
    :class:`~megatron_tepo.checkpoint.hf_io.LazyHFCheckpoint`; the caller opens and closes it),
    reading only this rank's slices (:func:`.sharding.load_checkpoint_slices_into`); bit for bit
    what :func:`load_hf_weights_into` gives from the loaded state dict. The checkpoint's names are
    checked first, on every rank alike: a missing tensor of the model or a tensor the mapping does
    not know is a ValueError naming it (and the checkpoint / file). A tied ``lm_head.weight`` stored
    beside the embedding must equal it (each rank compares its own embedding rows). ``select(param)``:
    only the parameters it accepts (:func:`.sharding.load_checkpoint_slices_into`)."""
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
                                         tied, tp_group=tp_group, select=select)
    if tied and "lm_head.weight" in ckpt and not checkpoint_slices_equal(
            model_chunks, ckpt, EMBEDDING, "lm_head.weight", tp_group=tp_group):
        raise ValueError(f"tie_word_embeddings=True but HF tensor 'lm_head.weight' in "
                         f"{ckpt.file_of('lm_head.weight')} differs from 'model.embed_tokens.weight'")
    return filled
