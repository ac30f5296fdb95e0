"""The name tables of the HF <-> Megatron mapping: what one family folder gives the registry
(:class:`FamilySpec`) and the per-layer table (:class:`LayerMapping`: one-to-one renames and
:class:`FusedGroup` s), built for the dense layers by :func:`attention_mapping` /
:func:`dense_layer_mapping`; the non-layer tensors (:func:`global_renames`); a checkpoint's stored
names against the text model's (:class:`CheckpointNaming`: a multimodal checkpoint keeps its text
model under a prefix beside parts that are only carried).

Names are *global*: ``decoder.layers.{i}`` is the i-th layer of the whole model, whatever pipeline
stage holds it. Which layer spec is in use changes the names of the two pre-norms
(:func:`norm_names`): the Transformer Engine spec folds them into the following linear
(``linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``), the local spec keeps
``input_layernorm`` / ``pre_mlp_layernorm`` modules; ``GPTFamilyConfig.spec`` says which. Left
out: moving tensors (:mod:`.converters`).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from .family import GPTFamilyConfig

#: how the HF tensors of a :class:`FusedGroup` make its Megatron tensor: ``qkv`` (per query group:
#: its queries, key, value), ``qgkv`` (the same with each query head's output gate after the group's
#: queries; HF's ``q_proj`` holds each head's query then its gate: gated attention), ``gate_up``
#: (``[gate; up]``), ``gdn_in_proj`` (a Gated DeltaNet's ``in_proj_qkv``, ``in_proj_z``,
#: ``in_proj_b``, ``in_proj_a`` one after the other: megatron's ``in_proj``)
FUSED_KINDS = ("qkv", "qgkv", "gate_up", "gdn_in_proj")


@dataclass(frozen=True)
class FusedGroup:
    """Several HF tensors of one layer that form one Megatron tensor (``kind``: :data:`FUSED_KINDS`)."""

    megatron: str
    hf: Tuple[str, ...]
    kind: str


@dataclass(frozen=True)
class LayerMapping:
    """Per-layer suffixes (after ``model.layers.{i}.`` / ``decoder.layers.{i}.``).

    ``tp_sections``: Megatron suffix -> the sizes of the sections of dim 0 that tensor parallelism
    splits one by one (a Gated DeltaNet's ``in_proj`` and ``conv1d``: every TP rank holds its share
    of each of query, key, value, ...); ``by_layer``: a model whose layers differ (Qwen3.5's Gated
    DeltaNet and attention layers) gives one table per layer (:meth:`for_layer`), the table's own
    ``renames`` / ``fused`` then unused."""

    renames: Dict[str, str]  # hf suffix -> megatron suffix (one-to-one)
    fused: Tuple[FusedGroup, ...]
    tp_sections: Dict[str, Tuple[int, ...]] = dataclasses.field(default_factory=dict)
    by_layer: Optional[Tuple["LayerMapping", ...]] = None

    def for_layer(self, layer: int) -> "LayerMapping":
        """The table of decoder layer ``layer``."""
        return self.by_layer[layer] if self.by_layer is not None else self

    def hf_suffixes(self) -> list:
        return list(self.renames) + [h for g in self.fused for h in g.hf]


@dataclass(frozen=True)
class CheckpointNaming:
    """How a checkpoint names its tensors, against the text model's own names that the mapping uses
    (a causal LM's: ``model.embed_tokens.weight``, ``model.layers.{i}.*``, ``model.norm.weight``,
    ``lm_head.weight``). ``text_prefix``: where the checkpoint keeps what the text model keeps under
    ``model.`` (a multimodal checkpoint's ``model.language_model.``; None: under ``model.`` itself);
    ``carried``: the name prefixes of its other parts (a vision tower, multi-token-prediction layers),
    which the actor does not train and an export writes back unchanged. The one place a stored name
    is translated (:meth:`text_name`, :meth:`stored_name`). ``stacked_experts``: the checkpoint may
    keep a layer's routed experts stacked (:func:`unstack_experts`; the published Qwen3.5-MoE ones),
    which a reader serves, and a writer of the same layout takes, one tensor per expert
    (:meth:`expert_pieces`)."""

    text_prefix: Optional[str] = None
    carried: Tuple[str, ...] = ()
    stacked_experts: bool = False

    def expert_pieces(self, text: str, shape) -> Optional[list]:
        """:func:`unstack_experts` of the text model's tensor ``text`` where this naming reads stacked
        experts; None for any other tensor."""
        return unstack_experts(text, shape) if self.stacked_experts else None

    def expert_slot(self, text: str) -> Optional[Tuple[str, int, int, int]]:
        """:func:`stacked_expert_slot` of the text model's per-expert tensor ``text`` where this naming
        reads stacked experts (a writer then checks whether the source stored them so); else None."""
        return stacked_expert_slot(text) if self.stacked_experts else None

    def is_carried(self, stored: str) -> bool:
        return stored.startswith(self.carried) if self.carried else False

    def text_name(self, stored: str) -> Optional[str]:
        """The text model's name of a stored tensor; None for a carried one. Any other name is
        given back as it is (the mapping then names it as unknown)."""
        if self.text_prefix is not None and stored.startswith(self.text_prefix):
            return "model." + stored[len(self.text_prefix):]
        return None if self.is_carried(stored) else stored

    def stored_name(self, text: str) -> str:
        """Inverse of :meth:`text_name` for the text model's tensors."""
        if self.text_prefix is not None and text.startswith("model."):
            return self.text_prefix + text[len("model."):]
        return text


#: a checkpoint of the text model alone (a ``*ForCausalLM``): its names are the mapping's
PLAIN_NAMING = CheckpointNaming()


#: a layer's routed experts stacked over the experts (the published Qwen3.5 / 3.6 MoE checkpoints,
#: and transformers >= 5 in memory): ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's
#: ``gate_proj`` rows, then its ``up_proj`` rows) and ``mlp.experts.down_proj`` ``[E, H, I]``, no
#: ``.weight``, each expert's matrix ``[out, in]`` as ``nn.Linear`` holds it (transformers 5.24's
#: ``Qwen3_5MoeExperts`` and its ``qwen2_moe`` conversion: ``MergeModulelist(dim=0)``,
#: ``Concatenate(dim=1)``); stacked name -> the per-expert tensors (the mapping's) each expert's matrix
#: holds, in row order
STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_STACKED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def unstack_experts(name: str, shape) -> Optional[list]:
    """The per-expert tensors inside stacked expert tensor ``name`` (:data:`STACKED_EXPERTS`) of
    ``shape`` ``[E, rows, columns]``: ``[(per-expert name, expert, (first row, end row) of that
    expert's matrix)]``, expert by expert, each expert's pieces in row order -- each piece is
    contiguous in the stacked tensor. None for any other name; a shape that cannot hold them (not
    3-D, rows not divisible by the pieces): ValueError naming the tensor."""
    m = _STACKED.match(name)
    if m is None:
        return None
    parts = STACKED_EXPERTS[m.group(2)]
    shape = tuple(int(d) for d in shape)
    if len(shape) != 3 or shape[1] % len(parts):
        raise ValueError(f"stacked expert tensor {name!r} has shape {shape}, expected [experts, "
                         f"{' + '.join(['rows'] * len(parts))}, columns] ({', '.join(parts)} of each expert)")
    rows = shape[1] // len(parts)
    return [(f"{m.group(1)}{e}.{p}.weight", e, (j * rows, (j + 1) * rows))
            for e in range(shape[0]) for j, p in enumerate(parts)]


def stacked_expert_slot(name: str) -> Optional[Tuple[str, int, int, int]]:
    """Inverse of :func:`unstack_experts` by name: per-expert ``...mlp.experts.{e}.{proj}.weight`` ->
    ``(stacked name, e, its piece's index, pieces per expert)``; None for any other name."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    for stacked, parts in STACKED_EXPERTS.items():
        if m.group(3) in parts:
            return f"{m.group(1)}{stacked}", int(m.group(2)), parts.index(m.group(3)), len(parts)
    return None


def plain_naming(hf_config) -> CheckpointNaming:
    return PLAIN_NAMING


@dataclass(frozen=True)
class FamilySpec:
    """One family as the registry (:mod:`megatron_tepo.models`) sees it, torchtitan's ``ModelSpec``
    kept small: the HF names it answers to, its HF config -> :class:`GPTFamilyConfig` translation
    (which also carries what the layer spec and ``TransformerConfig`` need:
    in megatron's words: :mod:`megatron_tepo.megatron.family_kwargs`)
    its per-layer HF <-> Megatron name table, and how its checkpoints name their tensors
    (``checkpoint_naming``: :class:`CheckpointNaming`). Building models is the megatron backend's."""

    name: str  # GPTFamilyConfig.family
    model_types: Tuple[str, ...]  # HF ``model_type`` values
    architectures: Tuple[str, ...]  # HF ``architectures`` entries
    from_hf_config: Callable[..., GPTFamilyConfig]  # (hf_config, spec="local") -> config
    layer_mapping: Callable[[GPTFamilyConfig], "LayerMapping"]
    # (hf_config) -> how its checkpoints name their tensors (a multimodal one: its text model under a prefix)
    checkpoint_naming: Callable[..., CheckpointNaming] = plain_naming


def norm_names(spec: str) -> Tuple[str, str]:
    """Megatron suffixes of HF's input_layernorm / post_attention_layernorm for a layer spec."""
    if spec == "te":
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def attention_mapping(cfg: GPTFamilyConfig) -> Tuple[Dict[str, str], Tuple[FusedGroup, ...]]:
    """Attention part of a layer: norm, o_proj, optional QK-norm, fused QKV weight/bias."""
    in_norm, _ = norm_names(cfg.spec)
    renames = {
        "input_layernorm.weight": in_norm,
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    }
    if cfg.qk_layernorm:
        renames["self_attn.q_norm.weight"] = "self_attention.q_layernorm.weight"
        renames["self_attn.k_norm.weight"] = "self_attention.k_layernorm.weight"
    fused = [FusedGroup("self_attention.linear_qkv.weight",
                        tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv")]
    if cfg.qkv_bias:
        fused.append(FusedGroup("self_attention.linear_qkv.bias",
                                tuple(f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"))
    return renames, tuple(fused)


def dense_layer_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    """Attention + dense SwiGLU MLP (Llama / Qwen2 / Qwen3)."""
    renames, fused = attention_mapping(cfg)
    _, post_norm = norm_names(cfg.spec)
    renames = {**renames,
               "post_attention_layernorm.weight": post_norm,
               "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
    fused = fused + (FusedGroup("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                                "gate_up"),)
    return LayerMapping(renames, fused)


def global_renames(cfg: GPTFamilyConfig) -> Dict[str, str]:
    """Non-layer tensors: embedding, final norm and (untied) output layer."""
    names = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
             "model.norm.weight": "decoder.final_layernorm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output_layer.weight"
    return names
