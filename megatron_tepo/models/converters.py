"""The two streaming converters driven by a family's name table (:class:`~.names.LayerMapping`):
:func:`convert_hf_to_megatron` / :func:`convert_megatron_to_hf` (full tensors, global names; every
tensor used once, unknown and missing names a ValueError naming them), and
:class:`MegatronToHFLayout`, where the HF tensors of a Megatron tensor lie without touching data
(the actor's bucketed export). Left out: sharding for a rank (:mod:`megatron_tepo.megatron.sharding`)
and reading or writing files (:mod:`megatron_tepo.checkpoint`).
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, Tuple

import torch

from .family import GPTFamilyConfig
from .fused import fuse_gate_up, fuse_gated_qkv, fuse_qkv, split_gate_up, split_gated_qkv, split_qkv
from .names import FusedGroup, LayerMapping, global_renames

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def expected_hf_names(cfg: GPTFamilyConfig, mapping: LayerMapping) -> list:
    names = list(global_renames(cfg))
    names += [f"model.layers.{i}.{s}" for i in range(cfg.num_layers) for s in mapping.for_layer(i).hf_suffixes()]
    return names


def _gdn_in_proj_sizes(cfg: GPTFamilyConfig) -> list:
    """Rows of HF's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""
    la = cfg.linear_attention
    return [2 * la.qk_dim + la.v_dim, la.v_dim, la.num_value_heads, la.num_value_heads]


def _fuse(group: FusedGroup, parts, cfg: GPTFamilyConfig) -> torch.Tensor:
    if group.kind == "qkv":
        return fuse_qkv(*parts, cfg.num_query_groups, cfg.head_dim)
    if group.kind == "qgkv":
        return fuse_gated_qkv(*parts, cfg.num_query_groups, cfg.head_dim)
    if group.kind == "gate_up":
        return fuse_gate_up(*parts)
    if group.kind == "gdn_in_proj":
        return torch.cat(parts, dim=0)
    raise ValueError(f"unknown fused kind {group.kind!r}")


def _split(group: FusedGroup, tensor: torch.Tensor, cfg: GPTFamilyConfig):
    if group.kind == "qkv":
        return split_qkv(tensor, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim)
    if group.kind == "qgkv":
        return split_gated_qkv(tensor, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim)
    if group.kind == "gate_up":
        return split_gate_up(tensor)
    if group.kind == "gdn_in_proj":
        return tuple(t.contiguous() for t in torch.split(tensor, _gdn_in_proj_sizes(cfg), dim=0))
    raise ValueError(f"unknown fused kind {group.kind!r}")


def fuse_group(group: FusedGroup, parts, cfg: GPTFamilyConfig) -> torch.Tensor:
    """The Megatron tensor of fused group ``group`` from its HF tensors ``parts`` (in ``group.hf``'s
    order), fused as :func:`convert_hf_to_megatron` fuses them; any trailing dims (a LoRA ``lora_B``'s
    ``[rows, r]`` is fused by its rows like its weight: :mod:`megatron_tepo.megatron.lora_peft`)."""
    return _fuse(group, parts, cfg)


def convert_hf_to_megatron(hf_state_iter: Iterable[Tuple[str, torch.Tensor]], cfg: GPTFamilyConfig,
                           mapping: LayerMapping) -> Iterator[Tuple[str, torch.Tensor]]:
    """Stream HF (name, full tensor) -> Megatron (global name, full tensor).

    Fused pieces are buffered until their group is complete. Every HF tensor must be used exactly
    once: an unknown name, a repeated name, or (at the end) a missing tensor raises ValueError
    naming it. With tied embeddings an ``lm_head.weight`` equal to ``embed_tokens`` (as
    ``state_dict()`` of a tied HF model reports it) is accepted as an alias and dropped.
    """
    top = global_renames(cfg)
    pieces_of: Dict[int, dict] = {}  # id(layer table) -> {hf suffix: (group, index)}
    seen: set = set()
    pending: Dict[Tuple[int, str], list] = {}
    tied_alias = embedding = None
    for name, tensor in hf_state_iter:
        if name in seen:
            raise ValueError(f"HF tensor {name!r} given twice")
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            tied_alias = tensor
            continue
        seen.add(name)
        if name == "model.embed_tokens.weight":
            embedding = tensor
        if name in top:
            yield top[name], tensor
            continue
        m = _HF_LAYER.match(name)
        table = mapping.for_layer(int(m.group(1))) if m is not None and int(m.group(1)) < cfg.num_layers else None
        piece_of = None
        if table is not None:
            piece_of = pieces_of.get(id(table))
            if piece_of is None:
                piece_of = pieces_of[id(table)] = {h: (g, j) for g in table.fused for j, h in enumerate(g.hf)}
        if table is None or (m.group(2) not in table.renames and m.group(2) not in piece_of):
            raise ValueError(f"HF tensor {name!r} has no Megatron counterpart in the {cfg.family} "
                             f"mapping (spec={cfg.spec})")
        layer, suffix = int(m.group(1)), m.group(2)
        prefix = f"decoder.layers.{layer}."
        if suffix in table.renames:
            yield prefix + table.renames[suffix], tensor
            continue
        group, j = piece_of[suffix]
        parts = pending.setdefault((layer, group.megatron), [None] * len(group.hf))
        parts[j] = tensor
        if all(p is not None for p in parts):
            del pending[(layer, group.megatron)]
            yield prefix + group.megatron, _fuse(group, parts, cfg)
    missing = [n for n in expected_hf_names(cfg, mapping) if n not in seen]
    if missing:
        raise ValueError(f"HF state dict lacks {len(missing)} tensor(s) of the {cfg.family} model, "
                         f"e.g. {missing[:8]}")
    if tied_alias is not None and not torch.equal(tied_alias, embedding):
        raise ValueError("tie_word_embeddings=True but HF tensor 'lm_head.weight' differs from "
                         "'model.embed_tokens.weight'")


def convert_megatron_to_hf(megatron_iter: Iterable[Tuple[str, torch.Tensor]], cfg: GPTFamilyConfig,
                           mapping: LayerMapping) -> Iterator[Tuple[str, torch.Tensor]]:
    """Stream Megatron (global name, full tensor) -> HF (name, full tensor); each tensor alone.

    With tied embeddings ``output_layer.weight`` (the last pipeline stage's copy) is skipped.
    Unknown names raise ValueError naming them.
    """
    top = {v: k for k, v in global_renames(cfg).items()}
    tables = _InverseTables(mapping)
    for name, tensor in megatron_iter:
        if name in top:
            yield top[name], tensor
            continue
        if cfg.tie_word_embeddings and name == "output_layer.weight":
            continue
        m = _MG_LAYER.match(name)
        renames, fused = tables.of(int(m.group(1)), cfg) if m is not None else ({}, {})
        if m is None or (m.group(2) not in renames and m.group(2) not in fused):
            raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in the {cfg.family} "
                             f"mapping (spec={cfg.spec})")
        prefix = f"model.layers.{m.group(1)}."
        suffix = m.group(2)
        if suffix in renames:
            yield prefix + renames[suffix], tensor
            continue
        group = fused[suffix]
        for hf_suffix, part in zip(group.hf, _split(group, tensor, cfg)):
            yield prefix + hf_suffix, part


class _InverseTables:
    """Megatron suffix -> HF suffix (renames) and -> group (fused), per layer table (made once each)."""

    def __init__(self, mapping: LayerMapping):
        self.mapping, self._made = mapping, {}

    def of(self, layer: int, cfg: GPTFamilyConfig):
        if layer >= cfg.num_layers:
            return {}, {}
        table = self.mapping.for_layer(layer)
        got = self._made.get(id(table))
        if got is None:
            got = self._made[id(table)] = ({v: k for k, v in table.renames.items()}, {g.megatron: g for g in table.fused})
        return got

    def sections(self, layer: int, suffix: str, cfg: GPTFamilyConfig):
        if layer >= cfg.num_layers:
            return None
        return self.mapping.for_layer(layer).tp_sections.get(suffix)


RowRanges = Tuple[Tuple[int, int], ...]


def _runs(rows: torch.Tensor) -> RowRanges:
    """Consecutive runs ``[(a, b), ...]`` of an index vector."""
    rows = rows.reshape(-1).tolist()
    out, start = [], rows[0]
    for prev, cur in zip(rows, rows[1:]):
        if cur != prev + 1:
            out.append((start, prev + 1))
            start = cur
    out.append((start, rows[-1] + 1))
    return tuple(out)


_RANGES_CACHE: Dict[Tuple, Tuple[RowRanges, ...]] = {}


def fused_row_ranges(group: FusedGroup, rows: int, cfg: GPTFamilyConfig) -> Tuple[RowRanges, ...]:
    """For each HF tensor of a fused group, the rows of the full Megatron tensor it is made of, as
    dim-0 ranges in order. Derived by running :func:`_split` -- the very function
    :func:`convert_megatron_to_hf` uses -- on a row-index column, so the two cannot disagree."""
    key = (group.kind, rows, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, cfg.linear_attention)
    if key not in _RANGES_CACHE:
        parts = _split(group, torch.arange(rows).reshape(rows, 1), cfg)
        _RANGES_CACHE[key] = tuple(_runs(p) for p in parts)
    return _RANGES_CACHE[key]


class MegatronToHFLayout:
    """Where the HF tensors of one Megatron tensor are, without touching data.

    ``layout(name, full_shape)`` -> list of ``(hf name, row ranges)``, where ``row ranges`` is None
    for a one-to-one rename (the HF tensor is the whole tensor, same shape) or the dim-0 ranges of
    the full tensor that the HF tensor concatenates (fused QKV / gate-up); ``[]`` for a tensor the
    HF model does not have (the tied ``output_layer.weight``). Same names and errors as
    :func:`convert_megatron_to_hf`, and the tensors it implies are bit for bit the ones that
    function yields (tests/megatron/test_export_layout.py).
    """

    def __init__(self, cfg: GPTFamilyConfig, mapping: LayerMapping):
        self.cfg = cfg
        self.top = {v: k for k, v in global_renames(cfg).items()}
        self.tables = _InverseTables(mapping)

    def gated(self, name: str):
        """How tensor parallelism splits dim 0 of Megatron tensor ``name``, where the table says:
        True for a SwiGLU ``linear_fc1`` (a ``gate_up`` group: ``[gate; up]``, which tensor
        parallelism splits with stride 2), the sections of a ``tp_sections`` entry (a Gated
        DeltaNet's ``in_proj`` / ``conv1d``), False otherwise
        (:func:`megatron_tepo.megatron.sharding.tp_partition`)."""
        m = _MG_LAYER.match(name)
        if m is None:
            return False
        layer, suffix = int(m.group(1)), m.group(2)
        sections = self.tables.sections(layer, suffix, self.cfg)
        if sections is not None:
            return tuple(sections)
        group = self.tables.of(layer, self.cfg)[1].get(suffix)
        return group is not None and group.kind == "gate_up"

    def __call__(self, name: str, shape) -> list:
        cfg = self.cfg
        if name in self.top:
            return [(self.top[name], None)]
        if cfg.tie_word_embeddings and name == "output_layer.weight":
            return []
        m = _MG_LAYER.match(name)
        renames, fused = self.tables.of(int(m.group(1)), cfg) if m is not None else ({}, {})
        if m is None or (m.group(2) not in renames and m.group(2) not in fused):
            raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in the {cfg.family} "
                             f"mapping (spec={cfg.spec})")
        prefix, suffix = f"model.layers.{m.group(1)}.", m.group(2)
        if suffix in renames:
            return [(prefix + renames[suffix], None)]
        group = fused[suffix]
        ranges = fused_row_ranges(group, int(shape[0]), cfg)
        return [(prefix + h, r) for h, r in zip(group.hf, ranges)]
