"""Shared code of the GPT families (Llama, Qwen2, Qwen3, Qwen3-MoE): config record + HF <-> Megatron names.

What is here:
  * :class:`GPTFamilyConfig` -- the architecture facts read from a Hugging Face config, and the
    megatron ``TransformerConfig`` / ``GPTModel`` / layer-spec keyword arguments they translate
    to; its typed ``moe`` field (:class:`MoEConfig`, None for a dense model) holds the routed
    experts' sizes and router settings.
  * :class:`FamilySpec` -- what one family folder gives the registry of :mod:`megatron_tepo.models`
    (its names, its HF config translation, its per-layer name table).
  * Small pure tensor functions: :func:`fuse_qkv` / :func:`split_qkv` (Megatron's per-query-group
    interleaved QKV layout) and :func:`fuse_gate_up` / :func:`split_gate_up` (SwiGLU ``linear_fc1``).
  * :class:`LayerMapping` (a per-layer table of one-to-one renames and fused groups) built by
    :func:`dense_layer_mapping`, and the two streaming converters
    :func:`convert_hf_to_megatron` / :func:`convert_megatron_to_hf` driven by such a table.

Names are *global*: ``decoder.layers.{i}`` is the i-th layer of the whole model, whatever pipeline
stage holds it; tensors are *full* (unsharded). Sharding for a rank lives in :mod:`.sharding`.

Which layer spec is in use changes the names of the two pre-norms: the Transformer Engine spec
folds them into the following linear (``linear_qkv.layer_norm_weight``,
``mlp.linear_fc1.layer_norm_weight``), the local spec keeps ``input_layernorm`` /
``pre_mlp_layernorm`` modules. ``GPTFamilyConfig.spec`` says which.

Deliberately left out: runtime flags (CPU initialisation, fusions, dtype, the MoE token dispatcher
and grouped GEMM) -- the megatron backend sets those (:mod:`megatron_tepo.megatron.gpt`); biases
on ``o_proj``/MLP, sliding-window attention and rope types megatron cannot express are rejected
(NotImplementedError naming the setting) rather than silently approximated.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_tepo.layout import ModelShape
from megatron_tepo.routing import RoutingShape

SPECS = ("local", "te")


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
#: megatron's router score functions (``moe_router_score_function``)
SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """A routed-expert MLP in every decoder layer: the sizes and router settings megatron and the
    mapping need, read from an HF config by the family (``models/qwen3_moe/config.py``).

    ``router_pre_softmax=False`` is megatron's ``topk -> softmax``: softmax over the chosen k
    (HF ``norm_topk_prob=True``); True is softmax over all experts, then top-k without
    renormalising. Left out: shared experts, capacity factors (token dropping), load-balancing and
    z-losses (:meth:`transformer_config_kwargs` turns them off: RL fine-tuning), grouped-GEMM and
    dispatcher choices (runtime: :func:`megatron_tepo.megatron.gpt.transformer_config`).
    """

    num_experts: int
    router_topk: int
    ffn_hidden_size: int  # each expert's intermediate size (HF ``moe_intermediate_size``)
    router_pre_softmax: bool = False
    router_score_function: str = "softmax"

    def __post_init__(self):
        bad = [f"{name}={getattr(self, name)!r}" for name in ("num_experts", "router_topk", "ffn_hidden_size")
               if not isinstance(getattr(self, name), int) or getattr(self, name) < 1]
        if bad:
            raise ValueError(f"MoEConfig: {', '.join(bad)} must be integers >= 1")
        if self.router_topk > self.num_experts:
            raise ValueError(f"MoEConfig: router_topk={self.router_topk} > num_experts={self.num_experts}")
        if self.router_score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"MoEConfig: router_score_function must be one of {SCORE_FUNCTIONS}, "
                             f"got {self.router_score_function!r}")

    def transformer_config_kwargs(self) -> Dict[str, Any]:
        """The MoE fields of ``megatron.core.transformer.TransformerConfig``."""
        return dict(
            num_moe_experts=self.num_experts,
            moe_router_topk=self.router_topk,
            moe_ffn_hidden_size=self.ffn_hidden_size,
            moe_router_pre_softmax=self.router_pre_softmax,
            moe_router_score_function=self.router_score_function,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )


@dataclass(frozen=True)
class GPTFamilyConfig:
    """Architecture of a GPT-style model (dense, or with routed experts: ``moe``), as far as
    Megatron and the mapping need it."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_layernorm: bool = False
    norm_eps: float = 1e-6
    rotary_base: float = 10000.0
    max_position_embeddings: int = 4096
    rope_scaling_factor: Optional[float] = None  # llama3-style scaling (megatron's fixed variant)
    seq_len_interpolation_factor: Optional[float] = None  # "linear" rope scaling
    spec: str = "local"  # "local" (megatron modules) or "te" (Transformer Engine fused norms)
    moe: Optional[MoEConfig] = None  # routed experts in every layer; None: dense

    def dims(self) -> ModelShape:
        """The model's shape, the one type the layout rules (:func:`megatron_tepo.layout.validate_layout`)
        and the fit check's memory arithmetic read."""
        moe = self.moe
        return ModelShape(num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_query_groups,
                          vocab_size=self.vocab_size, intermediate_size=self.ffn_hidden_size,
                          num_hidden_layers=self.num_layers, num_experts=self.num_experts,
                          hidden_size=self.hidden_size, head_dim=self.head_dim,
                          tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.qkv_bias,
                          qk_norm=self.qk_layernorm, num_experts_per_tok=moe.router_topk if moe else 0,
                          moe_intermediate_size=moe.ffn_hidden_size if moe else 0, family=self.family)

    def __post_init__(self):
        if self.spec not in SPECS:
            raise ValueError(f"spec must be one of {SPECS}, got {self.spec!r}")
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"moe must be a MoEConfig or None, got {type(self.moe).__name__}")

    @property
    def num_experts(self) -> int:
        """Routed experts per layer; 0 for a dense model."""
        return self.moe.num_experts if self.moe is not None else 0

    def routing_shape(self) -> Optional[RoutingShape]:
        """The MoE routing contract (:mod:`megatron_tepo.routing`): which decoder layers route, their
        top-k and expert count -- every layer (a family with dense layers in its MoE stack refuses
        them in its config); None for a dense model. The engines and the actor's replay read it."""
        if self.moe is None:
            return None
        return RoutingShape(self.num_layers, tuple(range(self.num_layers)), self.moe.router_topk, self.moe.num_experts)

    def as_dict(self) -> Dict[str, Any]:
        """Plain JSON-able fields (``moe`` a dict or None): what checkpoint sidecars record."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "GPTFamilyConfig":
        """Inverse of :meth:`as_dict`; unknown keys raise ValueError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"family config has unknown field(s) {unknown}")
        moe = d.get("moe")
        return cls(**{**d, "moe": MoEConfig(**moe) if moe is not None else None})

    @property
    def queries_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def with_spec(self, spec: str) -> "GPTFamilyConfig":
        return dataclasses.replace(self, spec=spec)

    def transformer_config_kwargs(self) -> Dict[str, Any]:
        """Architecture kwargs for ``megatron.core.transformer.TransformerConfig`` (with the MoE
        fields of :meth:`MoEConfig.transformer_config_kwargs` when ``moe`` is set)."""
        return dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=self.norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_layernorm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            attention_softmax_in_fp32=True,
            **(self.moe.transformer_config_kwargs() if self.moe is not None else {}),
        )

    def layer_spec_kwargs(self) -> Dict[str, Any]:
        """What megatron's ``get_gpt_layer_*_spec`` functions need of the architecture."""
        return dict(num_experts=self.moe.num_experts if self.moe is not None else None,
                    qk_layernorm=self.qk_layernorm)

    def gpt_model_kwargs(self) -> Dict[str, Any]:
        """Kwargs for ``megatron.core.models.gpt.GPTModel`` (besides config / spec / pre/post)."""
        kw = dict(
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_position_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=int(self.rotary_base) if float(self.rotary_base).is_integer() else self.rotary_base,
            share_embeddings_and_output_weights=self.tie_word_embeddings,
        )
        if self.rope_scaling_factor is not None:
            kw.update(rope_scaling=True, rope_scaling_factor=self.rope_scaling_factor)
        if self.seq_len_interpolation_factor is not None:
            kw.update(seq_len_interpolation_factor=self.seq_len_interpolation_factor)
        return kw


def _get(hf_config, name, default=None):
    return getattr(hf_config, name, default) if not isinstance(hf_config, dict) else hf_config.get(name, default)


def rope_settings(hf_config) -> Dict[str, Any]:
    """Translate HF rope fields (transformers 5 ``rope_parameters`` or 4.x ``rope_theta`` +
    ``rope_scaling``) to ``rotary_base`` / ``rope_scaling_factor`` / ``seq_len_interpolation_factor``.

    Megatron implements llama3 scaling only with low/high frequency factors 1/4 and an original
    context of 8192; anything else raises NotImplementedError naming the values.
    """
    params = dict(_get(hf_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", _get(hf_config, "rope_theta", 10000.0))
    scaling = _get(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params}
    out: Dict[str, Any] = {"rotary_base": float(theta)}
    if rope_type == "default":
        return out
    if rope_type == "linear":
        out["seq_len_interpolation_factor"] = float(merged["factor"])
        return out
    if rope_type == "llama3":
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        got = {k: merged.get(k) for k in fixed}
        if any(got[k] is None or float(got[k]) != float(v) for k, v in fixed.items()):
            raise NotImplementedError(
                f"llama3 rope scaling with {got} is not supported: megatron-core's RotaryEmbedding "
                f"hard-codes {fixed}")
        out["rope_scaling_factor"] = float(merged["factor"])
        return out
    raise NotImplementedError(f"rope_type={rope_type!r} is not supported (supported: default, linear, llama3)")


def check_dense_hf_config(hf_config, family: str) -> None:
    """Reject HF settings the dense Megatron GPT cannot express, naming them."""
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"{family}: hidden_act={act!r} is not supported (only silu / SwiGLU)")
    if _get(hf_config, "use_sliding_window", False):
        raise NotImplementedError(f"{family}: use_sliding_window=True is not supported")
    layer_types = _get(hf_config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise NotImplementedError(f"{family}: layer_types {sorted(set(layer_types))} (only full_attention)")


def base_family_config(hf_config, family: str, spec: str, **features) -> GPTFamilyConfig:
    """The fields every dense family reads the same way; ``features`` adds the family's own."""
    check_dense_hf_config(hf_config, family)
    heads = _get(hf_config, "num_attention_heads")
    hidden = _get(hf_config, "hidden_size")
    head_dim = _get(hf_config, "head_dim", None) or hidden // heads
    return GPTFamilyConfig(
        family=family,
        num_layers=_get(hf_config, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=_get(hf_config, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=_get(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=_get(hf_config, "vocab_size"),
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        max_position_embeddings=_get(hf_config, "max_position_embeddings", 4096),
        spec=spec,
        **rope_settings(hf_config),
        **features,
    )


# ---------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int,
             head_dim: int) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron ``linear_qkv``.

    Megatron's layout is ``[ng, (q_per_group + 2) * head_dim, ...]`` flattened on dim 0: for each
    query group, its query heads, then its key head, then its value head.
    """
    rest = q.shape[1:]
    qg = q.reshape(num_query_groups, -1, *rest)
    kg = k.reshape(num_query_groups, head_dim, *rest)
    vg = v.reshape(num_query_groups, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int,
              head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    rest = qkv.shape[1:]
    qpg = num_attention_heads // num_query_groups
    grouped = qkv.reshape(num_query_groups, (qpg + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [qpg * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate_proj/up_proj -> Megatron ``linear_fc1`` = ``[gate; up]`` (TP shards it with stride 2)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up`."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


# ---------------------------------------------------------------------------------------------
# Name tables
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedGroup:
    """Several HF tensors of one layer that form one Megatron tensor (``kind``: qkv | gate_up)."""

    megatron: str
    hf: Tuple[str, ...]
    kind: str


@dataclass(frozen=True)
class LayerMapping:
    """Per-layer suffixes (after ``model.layers.{i}.`` / ``decoder.layers.{i}.``)."""

    renames: Dict[str, str]  # hf suffix -> megatron suffix (one-to-one)
    fused: Tuple[FusedGroup, ...]


@dataclass(frozen=True)
class FamilySpec:
    """One family as the registry (:mod:`megatron_tepo.models`) sees it, torchtitan's ``ModelSpec``
    kept small: the HF names it answers to, its HF config -> :class:`GPTFamilyConfig` translation
    (which also carries what the layer spec and ``TransformerConfig`` need:
    :meth:`GPTFamilyConfig.layer_spec_kwargs`, :meth:`GPTFamilyConfig.transformer_config_kwargs`)
    and its per-layer HF <-> Megatron name table. Building models is the megatron backend's."""

    name: str  # GPTFamilyConfig.family
    model_types: Tuple[str, ...]  # HF ``model_type`` values
    architectures: Tuple[str, ...]  # HF ``architectures`` entries
    from_hf_config: Callable[..., GPTFamilyConfig]  # (hf_config, spec="local") -> config
    layer_mapping: Callable[[GPTFamilyConfig], "LayerMapping"]


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


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def expected_hf_names(cfg: GPTFamilyConfig, mapping: LayerMapping) -> list:
    names = list(global_renames(cfg))
    suffixes = list(mapping.renames) + [h for g in mapping.fused for h in g.hf]
    names += [f"model.layers.{i}.{s}" for i in range(cfg.num_layers) for s in suffixes]
    return names


def _fuse(group: FusedGroup, parts, cfg: GPTFamilyConfig) -> torch.Tensor:
    if group.kind == "qkv":
        return fuse_qkv(*parts, cfg.num_query_groups, cfg.head_dim)
    if group.kind == "gate_up":
        return fuse_gate_up(*parts)
    raise ValueError(f"unknown fused kind {group.kind!r}")


def _split(group: FusedGroup, tensor: torch.Tensor, cfg: GPTFamilyConfig):
    if group.kind == "qkv":
        return split_qkv(tensor, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim)
    if group.kind == "gate_up":
        return split_gate_up(tensor)
    raise ValueError(f"unknown fused kind {group.kind!r}")


def convert_hf_to_megatron(hf_state_iter: Iterable[Tuple[str, torch.Tensor]], cfg: GPTFamilyConfig,
                           mapping: LayerMapping) -> Iterator[Tuple[str, torch.Tensor]]:
    """Stream HF (name, full tensor) -> Megatron (global name, full tensor).

    Fused pieces are buffered until their group is complete. Every HF tensor must be used exactly
    once: an unknown name, a repeated name, or (at the end) a missing tensor raises ValueError
    naming it. With tied embeddings an ``lm_head.weight`` equal to ``embed_tokens`` (as
    ``state_dict()`` of a tied HF model reports it) is accepted as an alias and dropped.
    """
    top = global_renames(cfg)
    piece_of = {h: (g, j) for g in mapping.fused for j, h in enumerate(g.hf)}
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
        if m is None or int(m.group(1)) >= cfg.num_layers or (
                m.group(2) not in mapping.renames and m.group(2) not in piece_of):
            raise ValueError(f"HF tensor {name!r} has no Megatron counterpart in the {cfg.family} "
                             f"mapping (spec={cfg.spec})")
        layer, suffix = int(m.group(1)), m.group(2)
        prefix = f"decoder.layers.{layer}."
        if suffix in mapping.renames:
            yield prefix + mapping.renames[suffix], tensor
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
    renames = {v: k for k, v in mapping.renames.items()}
    fused = {g.megatron: g for g in mapping.fused}
    for name, tensor in megatron_iter:
        if name in top:
            yield top[name], tensor
            continue
        if cfg.tie_word_embeddings and name == "output_layer.weight":
            continue
        m = _MG_LAYER.match(name)
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


# ---------------------------------------------------------------------------------------------
# Layout of the HF tensors inside a Megatron tensor (for the bucketed export)
# ---------------------------------------------------------------------------------------------
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
    key = (group.kind, rows, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim)
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
        self.renames = {v: k for k, v in mapping.renames.items()}
        self.fused = {g.megatron: g for g in mapping.fused}

    def gated(self, name: str) -> bool:
        """Whether Megatron tensor ``name`` is a SwiGLU ``linear_fc1`` (a ``gate_up`` group of the
        mapping: ``[gate; up]``, which tensor parallelism splits with stride 2)."""
        m = _MG_LAYER.match(name)
        group = self.fused.get(m.group(2)) if m is not None else None
        return group is not None and group.kind == "gate_up"

    def __call__(self, name: str, shape) -> list:
        cfg = self.cfg
        if name in self.top:
            return [(self.top[name], None)]
        if cfg.tie_word_embeddings and name == "output_layer.weight":
            return []
        m = _MG_LAYER.match(name)
        if m is None or (m.group(2) not in self.renames and m.group(2) not in self.fused):
            raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in the {cfg.family} "
                             f"mapping (spec={cfg.spec})")
        prefix, suffix = f"model.layers.{m.group(1)}.", m.group(2)
        if suffix in self.renames:
            return [(prefix + self.renames[suffix], None)]
        group = self.fused[suffix]
        ranges = fused_row_ranges(group, int(shape[0]), cfg)
        return [(prefix + h, r) for h, r in zip(group.hf, ranges)]
