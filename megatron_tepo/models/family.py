"""The family config: the architecture facts of a GPT-style model read from a Hugging Face config,
shared by every family folder (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen3.5).

* :class:`GPTFamilyConfig` -- sizes, norms, RoPE, the layer spec's name (``spec``: ``local`` or
  ``te``, which names the pre-norm tensors); its typed ``moe`` field (:class:`MoEConfig`, None for
  a dense model) holds the routed experts' sizes and router settings, its ``linear_attention``
  (:class:`LinearAttentionConfig`) the Gated DeltaNet layers' sizes, ``layer_types`` which layer
  is which (:data:`LAYER_TYPES`). It gives the fit check its shape (:meth:`GPTFamilyConfig.dims`)
  and the routing contract (:meth:`GPTFamilyConfig.routing_shape`).
* :func:`base_family_config`, :func:`rope_settings`, :func:`check_dense_hf_config` -- the HF
  fields every dense family reads the same way.

Deliberately left out: megatron's own field names (``TransformerConfig``, ``GPTModel``, the layer
spec's arguments: :mod:`megatron_tepo.megatron.family_kwargs` translates), runtime flags (CPU
initialisation, fusions, dtype, the MoE token dispatcher and grouped GEMM: the megatron backend's);
biases on ``o_proj``/MLP, sliding-window attention and rope types megatron cannot express are
rejected (NotImplementedError naming the setting) rather than silently approximated.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from megatron_tepo.layer_kinds import ATTENTION, BY_LAYER_TYPE, LayerKind
from megatron_tepo.layout import ModelShape
from megatron_tepo.routing import RoutingShape

SPECS = ("local", "te")


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
    load-balancing and z-losses (:func:`megatron_tepo.megatron.family_kwargs.moe_kwargs` turns them off: RL fine-tuning),
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


#: HF ``layer_types`` of a hybrid model's decoder layers, one per row of the layer-kind table
#: (:mod:`megatron_tepo.layer_kinds`): softmax attention, Gated DeltaNet
LAYER_TYPES = tuple(BY_LAYER_TYPE)


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

    def layer_kind(self, layer: int) -> LayerKind:
        """HF decoder layer ``layer``'s token mixer: its row of the layer-kind table (attention
        wherever ``layer_types`` is None)."""
        return BY_LAYER_TYPE[self.layer_types[layer]] if self.layer_types is not None else ATTENTION

    def is_linear(self, layer: int) -> bool:
        """Whether HF decoder layer ``layer`` is a Gated DeltaNet layer."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def queries_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def with_spec(self, spec: str) -> "GPTFamilyConfig":
        return dataclasses.replace(self, spec=spec)


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
