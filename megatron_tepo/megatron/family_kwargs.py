"""A family config (:class:`~megatron_tepo.models.GPTFamilyConfig`) in megatron-core's words: the
architecture fields of ``TransformerConfig`` (:func:`transformer_config_kwargs`, with the MoE ones
of :func:`moe_kwargs` and the Gated DeltaNet's of :func:`linear_attention_kwargs`), what
megatron's ``get_gpt_layer_*_spec`` functions need (:func:`layer_spec_kwargs`) and the keyword
arguments of ``GPTModel`` / ``HybridModel`` (:func:`gpt_model_kwargs`). The one place megatron-core's
field names are spelled for a family: :mod:`megatron_tepo.models` reads HF configs and knows names,
never megatron's fields (tests/test_layers.py).

Left out: the runtime settings (precision, recompute, parallel sizes, fusions, the MoE token
dispatcher and grouped GEMM: :func:`megatron_tepo.megatron.gpt.transformer_config`). Load-balancing
and z-losses are off (RL fine-tuning).
"""
from __future__ import annotations

from typing import Any, Dict

import torch.nn.functional as F

from megatron_tepo.models import GPTFamilyConfig, LinearAttentionConfig, MoEConfig

__all__ = ["transformer_config_kwargs", "moe_kwargs", "linear_attention_kwargs", "layer_spec_kwargs",
           "gpt_model_kwargs"]


def moe_kwargs(moe: MoEConfig) -> Dict[str, Any]:
    """The MoE fields of ``megatron.core.transformer.TransformerConfig``."""
    kw = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_pre_softmax=moe.router_pre_softmax,
        moe_router_score_function=moe.router_score_function,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    if moe.shared_expert_ffn_hidden_size:
        kw.update(moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
                  moe_shared_expert_gate=moe.shared_expert_gate)
    return kw


def linear_attention_kwargs(la: LinearAttentionConfig) -> Dict[str, Any]:
    """The Gated DeltaNet fields of ``TransformerConfig``."""
    return dict(linear_conv_kernel_dim=la.conv_kernel, linear_key_head_dim=la.key_head_dim,
                linear_value_head_dim=la.value_head_dim, linear_num_key_heads=la.num_key_heads,
                linear_num_value_heads=la.num_value_heads)


def transformer_config_kwargs(cfg: GPTFamilyConfig) -> Dict[str, Any]:
    """Architecture kwargs for ``megatron.core.transformer.TransformerConfig`` (with the MoE
    fields of :func:`moe_kwargs` when ``moe`` is set)."""
    return dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        **(moe_kwargs(cfg.moe) if cfg.moe is not None else {}),
        **(dict(layernorm_zero_centered_gamma=True) if cfg.zero_centered_norms else {}),
        **(dict(attention_output_gate=True) if cfg.attention_output_gate else {}),
        **(linear_attention_kwargs(cfg.linear_attention) if cfg.linear_attention is not None else {}),
    )


def layer_spec_kwargs(cfg: GPTFamilyConfig) -> Dict[str, Any]:
    """What megatron's ``get_gpt_layer_*_spec`` functions need of the architecture."""
    return dict(num_experts=cfg.moe.num_experts if cfg.moe is not None else None,
                qk_layernorm=cfg.qk_layernorm)


def gpt_model_kwargs(cfg: GPTFamilyConfig) -> Dict[str, Any]:
    """Kwargs for ``megatron.core.models.gpt.GPTModel`` (besides config / spec / pre/post)."""
    kw = dict(
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=cfg.rotary_percent,
        rotary_base=int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
    )
    if cfg.rope_scaling_factor is not None:
        kw.update(rope_scaling=True, rope_scaling_factor=cfg.rope_scaling_factor)
    if cfg.seq_len_interpolation_factor is not None:
        kw.update(seq_len_interpolation_factor=cfg.seq_len_interpolation_factor)
    return kw
