"""The token mixers a decoder layer may have, one row each: the layer-kind table. A hybrid model
(Qwen3.5) says per layer which it is (HF ``layer_types``); everything that differs by kind reads
the row, so a new kind is a row here plus its megatron sublayer spec (:mod:`megatron_tepo.megatron.hybrid`,
``MIXER_SPECS``, keyed by the row's name) and its HF <-> Megatron name table (the family's
``state_dict_adapter``, its per-layer tables keyed the same way).

A row (:class:`LayerKind`) holds its name, the HF ``layer_types`` entry, the symbol of megatron's
hybrid layer pattern, the CPU stand-in for its CUDA-only kernels (the name of a
:mod:`megatron_tepo.megatron.cpu_patches` patch; "" where megatron-core's own torch path runs), and
its memory prices for the fit check (:mod:`megatron_tepo.launch.memory`): parameters on one GPU,
activations kept per token, a server's recurrent state per request, and how many of a model's
layers are of the kind (read from :class:`~megatron_tepo.layout.ModelShape`).

Pure arithmetic on the shape: nothing of Megatron, torch or the launch; ``launch`` and ``models``
read it as well as ``megatron``. Left out: the MLP side of a layer (dense or MoE: the family
config's ``moe``), and the formulas' conventions (docs/LAUNCH.md, "The fit-check arithmetic").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from megatron_tepo.layout import ModelShape

__all__ = ["LayerKind", "ATTENTION", "GATED_DELTANET", "MIXERS", "BY_LAYER_TYPE", "other_mixers", "attention_layers",
           "attention_params", "attention_activations", "linear_dims", "linear_attention_params",
           "linear_attention_activations", "linear_state_bytes_per_layer"]


@dataclass(frozen=True)
class LayerKind:
    """One kind of token mixer (module docstring)."""

    name: str
    hf_layer_type: str  # its HF ``layer_types`` entry
    symbol: str  # its symbol in megatron's ``hybrid_layer_pattern``
    cpu_stand_in: str  # the cpu_patches patch standing in for its CUDA-only kernels ("": none needed)
    #: one mixer's parameters on one GPU at TP ``t``, its input norm included: ``(shape, t) -> int``
    params: Callable[[ModelShape, int], int]
    #: one mixer's activations kept per token, split by TP: ``(shape, elem, unfused_seq, selective)``
    #: -> (elements in the activations' dtype, extra bytes)
    activations: Callable[[ModelShape, int, int, bool], Tuple[int, int]]
    #: one request's recurrent state in one such layer on one GPU of a TP-``ts`` server (0: it keeps
    #: a KV cache instead): ``(shape, ts) -> bytes``
    state_bytes: Callable[[ModelShape, int], int]
    #: how many of the model's decoder layers are of this kind: ``shape -> int``
    layers: Callable[[ModelShape], int]


def attention_params(m: ModelShape, t: int) -> int:
    """A softmax-attention mixer's parameters on one GPU, its input norm included (``q_proj`` twice as
    wide with the output gate: each head's query and gate)."""
    h, d = m.hidden_size, m.head_dim
    q = (2 if m.attention_output_gate else 1) * m.num_attention_heads * d
    attn = (h * q + 2 * h * m.num_key_value_heads * d + m.num_attention_heads * d * h) // t + h
    if m.attention_bias:
        attn += (m.num_attention_heads + 2 * m.num_key_value_heads) * d // t
    if m.qk_norm:
        attn += 2 * d
    return attn


def attention_activations(m: ModelShape, elem: int, unfused_seq: int, selective: bool) -> Tuple[int, int]:
    """A softmax-attention mixer's activations kept per token, split by TP: (elements in the
    activations' dtype, extra bytes), as docs/LAUNCH.md counts them: ``selective`` recomputes the
    core attention, ``unfused_seq`` (the padded row length; 0: flash-style) prices the scores an
    unfused attention materialises."""
    d = m.head_dim
    sharded = (m.num_attention_heads + 2 * m.num_key_value_heads) * d + (1 if selective else 2) * m.num_attention_heads * d
    if m.attention_output_gate:  # the gate's half of linear_qkv's output and the gated core output
        sharded += 2 * m.num_attention_heads * d
    if m.qk_norm:
        sharded += (m.num_attention_heads + m.num_key_value_heads) * d
    extra_bytes_sharded = 0 if selective else 4 * m.num_attention_heads
    if unfused_seq and not selective:
        extra_bytes_sharded += (4 + (elem if elem < 4 else 0)) * m.num_attention_heads * unfused_seq
    return sharded, extra_bytes_sharded


def linear_dims(m: ModelShape) -> Tuple[int, int, int]:
    """A Gated DeltaNet layer's (query/key width, value width, value heads)."""
    return (m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim,
            m.linear_num_value_heads)


def linear_attention_params(m: ModelShape, t: int) -> int:
    """A Gated DeltaNet mixer's parameters on one GPU (megatron's ``GatedDeltaNet``): ``in_proj``
    (query, key, value, output gate, beta, alpha), the causal convolution over query, key and value,
    ``A_log`` and ``dt_bias`` per value head, the output norm (one value head wide) and ``out_proj``,
    all but the norms split by TP; its input norm."""
    h = m.hidden_size
    qk, v, nv = linear_dims(m)
    return (h * (2 * qk + 2 * v + 2 * nv) + (2 * qk + v) * m.linear_conv_kernel + 2 * nv + v * h) // t \
        + m.linear_value_head_dim + h


def linear_attention_activations(m: ModelShape, elem: int = 2, unfused_seq: int = 0,
                                 selective: bool = False) -> Tuple[int, int]:
    """A Gated DeltaNet mixer's activations kept per token, split by TP: (elements in the
    activations' dtype, extra bytes): ``in_proj``'s output (query, key, value, gate, beta, alpha), the
    convolution's output (query, key, value), the scan's output and the gated norm's; beta and the
    decay in fp32. The scan's chunk states (one ``key x value`` matrix per value head every 64 tokens)
    are recomputed in its backward (flash-linear-attention), not kept. (No scores: the other
    arguments do not change it.)"""
    qk, v, nv = linear_dims(m)
    return (2 * qk + 2 * v + 2 * nv) + (2 * qk + v) + 2 * v, 8 * nv


def linear_state_bytes_per_layer(m: ModelShape, ts: int) -> int:
    """One request's recurrent state in one Gated DeltaNet layer on one GPU of a TP-``ts`` server:
    the convolution's last ``kernel - 1`` inputs (query, key, value) in bf16 and each value head's
    ``key_head_dim x value_head_dim`` matrix in fp32 (Qwen3.5's ``mamba_ssm_dtype``)."""
    qk, v, nv = linear_dims(m)
    conv = 2 * math.ceil((2 * qk + v) / ts) * (m.linear_conv_kernel - 1)
    ssm = 4 * math.ceil(nv / ts) * m.linear_key_head_dim * m.linear_value_head_dim
    return conv + ssm


#: Qwen3.5's Gated DeltaNet (megatron's ``GatedDeltaNet``; HF ``linear_attention``)
GATED_DELTANET = LayerKind(name="gated_deltanet", hf_layer_type="linear_attention", symbol="G",
                           cpu_stand_in="gdn_kernels", params=linear_attention_params,
                           activations=linear_attention_activations, state_bytes=linear_state_bytes_per_layer,
                           layers=lambda m: m.linear_layers)


def other_mixers(m: ModelShape) -> Tuple[Tuple[LayerKind, int], ...]:
    """The kinds but attention that ``m`` has layers of, each with its number of layers (table order)."""
    return tuple((k, k.layers(m)) for k in MIXERS if k is not ATTENTION and k.layers(m))


def attention_layers(m: ModelShape) -> int:
    """The softmax-attention layers: every layer no other kind claims."""
    return m.num_hidden_layers - sum(n for _, n in other_mixers(m))


#: softmax attention (megatron's ``SelfAttention``; HF ``full_attention``), every layer of a non-hybrid model
ATTENTION = LayerKind(name="attention", hf_layer_type="full_attention", symbol="*", cpu_stand_in="",
                      params=attention_params, activations=attention_activations,
                      state_bytes=lambda m, ts: 0, layers=attention_layers)

#: every kind, the default (attention) first
MIXERS: Tuple[LayerKind, ...] = (ATTENTION, GATED_DELTANET)
#: the row of an HF ``layer_types`` entry
BY_LAYER_TYPE: Dict[str, LayerKind] = {k.hf_layer_type: k for k in MIXERS}
