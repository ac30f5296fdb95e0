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
  * :class:`CheckpointNaming` -- a checkpoint's stored names against the text model's (a
    multimodal checkpoint keeps its text model under a prefix beside parts that are only carried).
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
    renormalising. ``shared_expert_ffn_hidden_size`` > 0: a shared expert (a SwiGLU MLP every token
    goes through) of that size beside the routed ones, its output scaled by ``sigmoid`` of a
    one-output linear of the input when ``shared_expert_gate`` (Qwen3.5-MoE; megatron's
    ``moe_shared_expert_gate``). Every decoder layer is an MoE layer (a family with dense layers in
    its MoE stack is refused by its config). Left out: capacity factors (token dropping),
    load-balancing and z-losses (:meth:`transformer_config_kwargs` turns them off: RL fine-tuning),
    grouped-GEMM and dispatcher choices (runtime: :func:`megatron_tepo.megatron.gpt.transformer_config`).
    """

    num_experts: int
    router_topk: int
    ffn_hidden_size: int  # each expert's intermediate size (HF ``moe_intermediate_size``)
    router_pre_softmax: bool = False
    router_score_function: str = "softmax"
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False

    def __post_init__(self):
        bad = [f"{name}={getattr(self, name)!r}" for name in ("num_experts", "router_topk", "ffn_hidden_size")
               if not isinstance(getattr(self, name), int) or getattr(self, name) < 1]
        if not isinstance(self.shared_expert_ffn_hidden_size, int) or self.shared_expert_ffn_hidden_size < 0:
            bad.append(f"shared_expert_ffn_hidden_size={self.shared_expert_ffn_hidden_size!r}")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            bad.append("shared_expert_gate=True without a shared expert")
        if bad:
            raise ValueError(f"MoEConfig: {', '.join(bad)} must be integers >= 1")
        if self.router_topk > self.num_experts:
            raise ValueError(f"MoEConfig: router_topk={self.router_topk} > num_experts={self.num_experts}")
        if self.router_score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"MoEConfig: router_score_function must be one of {SCORE_FUNCTIONS}, "
                             f"got {self.router_score_function!r}")

    def transformer_config_kwargs(self) -> Dict[str, Any]:
        """The MoE fields of ``megatron.core.transformer.TransformerConfig``."""
        kw = dict(
            num_moe_experts=self.num_experts,
            moe_router_topk=self.router_topk,
            moe_ffn_hidden_size=self.ffn_hidden_size,
            moe_router_pre_softmax=self.router_pre_softmax,
            moe_router_score_function=self.router_score_function,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
        if self.shared_expert_ffn_hidden_size:
            kw.update(moe_shared_expert_intermediate_size=self.shared_expert_ffn_hidden_size,
                      moe_shared_expert_gate=self.shared_expert_gate)
        return kw


#: HF ``layer_types`` of a hybrid model's decoder layers: Gated DeltaNet, softmax attention
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers' sizes (HF ``linear_*``; megatron's ``linear_*`` fields): key and
    value heads (every key head serves ``num_value_heads / num_key_heads`` value heads), their
    sizes, and the short causal convolution's width."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4

    def __post_init__(self):
        bad = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
               if not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < 1]
        if bad:
            raise ValueError(f"LinearAttentionConfig: {', '.join(bad)} must be integers >= 1")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"LinearAttentionConfig: num_value_heads={self.num_value_heads} is not a multiple of "
                             f"num_key_heads={self.num_key_heads}")

    @property
    def qk_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def v_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    def in_proj_sections(self) -> Tuple[int, ...]:
        """The rows of megatron's fused ``in_proj``: query, key, value, output gate (z), beta, alpha."""
        return (self.qk_dim, self.qk_dim, self.v_dim, self.v_dim, self.num_value_heads, self.num_value_heads)

    def conv_sections(self) -> Tuple[int, ...]:
        """The channels of the convolution: query, key, value."""
        return (self.qk_dim, self.qk_dim, self.v_dim)

    def transformer_config_kwargs(self) -> Dict[str, Any]:
        return dict(linear_conv_kernel_dim=self.conv_kernel, linear_key_head_dim=self.key_head_dim,
                    linear_value_head_dim=self.value_head_dim, linear_num_key_heads=self.num_key_heads,
                    linear_num_value_heads=self.num_value_heads)


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
    # hybrid models (Qwen3.5): each layer's LAYER_TYPES entry (None: softmax attention everywhere)
    layer_types: Optional[Tuple[str, ...]] = None
    linear_attention: Optional[LinearAttentionConfig] = None  # the Gated DeltaNet layers' sizes
    attention_output_gate: bool = False  # sigmoid gate on the attention output (q_proj's second half)
    rotary_percent: float = 1.0  # RoPE on the first rotary_percent of each head (HF partial_rotary_factor)
    zero_centered_norms: bool = False  # RMSNorm weights stored as w - 1 (HF (1 + weight); megatron's 1p)

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
                          moe_intermediate_size=moe.ffn_hidden_size if moe else 0, family=self.family,
                          **self._hybrid_dims())

    def _hybrid_dims(self) -> Dict[str, Any]:
        """:class:`ModelShape`'s Gated DeltaNet, output-gate and shared-expert fields (0 / False without)."""
        la, moe = self.linear_attention, self.moe
        out: Dict[str, Any] = dict(attention_output_gate=self.attention_output_gate,
                                   shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size if moe else 0,
                                   shared_expert_gate=bool(moe and moe.shared_expert_gate))
        if la is not None:
            out.update(linear_num_key_heads=la.num_key_heads, linear_num_value_heads=la.num_value_heads,
                       linear_layers=sum(self.is_linear(i) for i in range(self.num_layers)),
                       linear_key_head_dim=la.key_head_dim, linear_value_head_dim=la.value_head_dim,
                       linear_conv_kernel=la.conv_kernel)
        return out

    def __post_init__(self):
        if self.spec not in SPECS:
            raise ValueError(f"spec must be one of {SPECS}, got {self.spec!r}")
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"moe must be a MoEConfig or None, got {type(self.moe).__name__}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad or len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types: {len(self.layer_types)} entries of {list(LAYER_TYPES)} for "
                                 f"{self.num_layers} layers (unknown: {bad})")
            if "linear_attention" in self.layer_types and self.linear_attention is None:
                raise ValueError("layer_types has linear_attention layers but no linear_attention sizes")
        if self.linear_attention is not None and not isinstance(self.linear_attention, LinearAttentionConfig):
            raise TypeError(f"linear_attention must be a LinearAttentionConfig or None, "
                            f"got {type(self.linear_attention).__name__}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")

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
        moe, linear = d.get("moe"), d.get("linear_attention")
        return cls(**{**d, "moe": MoEConfig(**moe) if moe is not None else None,
                      "linear_attention": LinearAttentionConfig(**linear) if linear is not None else None})

    def is_linear(self, layer: int) -> bool:
        """Whether HF decoder layer ``layer`` is a Gated DeltaNet layer."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

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
            **(dict(layernorm_zero_centered_gamma=True) if self.zero_centered_norms else {}),
            **(dict(attention_output_gate=True) if self.attention_output_gate else {}),
            **(self.linear_attention.transformer_config_kwargs() if self.linear_attention is not None else {}),
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
            rotary_percent=self.rotary_percent,
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


def fuse_gated_qkv(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int,
                   head_dim: int) -> torch.Tensor:
    """HF gated attention (``q_proj`` holds each head's query then its output gate, ``[nh * 2d, ...]``;
    ``k_proj`` / ``v_proj``) -> Megatron ``linear_qkv`` with ``attention_output_gate``: per query
    group, its queries, their gates, its key, its value."""
    rest = q_gate.shape[1:]
    heads = q_gate.reshape(-1, 2, head_dim, *rest)
    q = heads[:, 0].reshape(num_query_groups, -1, *rest)
    gate = heads[:, 1].reshape(num_query_groups, -1, *rest)
    kg = k.reshape(num_query_groups, head_dim, *rest)
    vg = v.reshape(num_query_groups, head_dim, *rest)
    return torch.cat([q, gate, kg, vg], dim=1).reshape(-1, *rest)


def split_gated_qkv(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int,
                    head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gated_qkv`: ``(q_proj, k_proj, v_proj)``."""
    rest = qkv.shape[1:]
    qpg = num_attention_heads // num_query_groups
    grouped = qkv.reshape(num_query_groups, (2 * qpg + 2) * head_dim, *rest)
    q, gate, k, v = torch.split(grouped, [qpg * head_dim, qpg * head_dim, head_dim, head_dim], dim=1)
    q_gate = torch.stack([q.reshape(-1, head_dim, *rest), gate.reshape(-1, head_dim, *rest)], dim=1)
    return (q_gate.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
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
    :meth:`GPTFamilyConfig.layer_spec_kwargs`, :meth:`GPTFamilyConfig.transformer_config_kwargs`)
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
