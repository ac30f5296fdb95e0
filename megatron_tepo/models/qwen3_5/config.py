"""Qwen3.5 HF config (dense ``qwen3_5`` and ``qwen3_5_moe``) -> :class:`GPTFamilyConfig`.

Qwen3.5 is a hybrid: its decoder layers are Gated DeltaNet layers (``linear_attention``: linear
attention with a short causal convolution, gated output norm) and gated softmax-attention layers
(``full_attention``: an output gate from the second half of ``q_proj``, ``head_dim`` 256 in the
published models, RoPE on the first ``partial_rotary_factor`` (0.25) of each head, Qwen3's QK
norms), three to one (``layer_types``, or ``full_attention_interval``); every RMSNorm but the Gated
DeltaNet's output norm stores ``w - 1`` (``zero_centered_norms``). The MoE model routes every
layer's tokens to ``num_experts_per_tok`` of ``num_experts`` experts (softmax, top-k, renormalised:
megatron's ``topk -> softmax``) beside a shared expert behind a sigmoid gate.

Both the text-only ``Qwen3_5ForCausalLM`` config (``model_type`` ``qwen3_5_text``) and the
published ``Qwen3_5ForConditionalGeneration`` one (``qwen3_5``, the text model under
``text_config``) are read; only the text model is trained. A conditional-generation checkpoint
keeps the text model's tensors under ``model.language_model.`` beside the vision tower and the
multi-token-prediction layers, which are carried unchanged (:func:`checkpoint_naming`); the MoE's
routed experts may be stored stacked (the published ones: ``mlp.experts.gate_up_proj`` /
``down_proj``) or one tensor per expert, both read in the per-expert names (``stacked_experts``). The multimodal RoPE (``mrope_section``)
is plain RoPE on text, where all three position components are equal.

Left out (NotImplementedError naming the setting): ``attention_bias``, activations other than
silu, RoPE types other than the default, dense layers inside the MoE stack.
"""
from __future__ import annotations

from ..family import GPTFamilyConfig, LAYER_TYPES, LinearAttentionConfig, MoEConfig, _get, rope_settings
from ..names import CheckpointNaming

#: the published ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``
#: checkpoints: the text model under ``model.language_model.`` (``lm_head.weight`` at the top), beside
#: the vision tower (``model.visual.*``) and the multi-token-prediction layer(s) (``mtp.*``), carried;
#: the MoE's routed experts stacked (``model.language_model.layers.{i}.mlp.experts.gate_up_proj`` /
#: ``down_proj``, as the published ones) or one tensor per expert (as transformers' ``save_pretrained``)
CONDITIONAL_GENERATION = CheckpointNaming(text_prefix="model.language_model.", carried=("model.visual.", "mtp."),
                                          stacked_experts=True)
#: a text-only checkpoint (``Qwen3_5ForCausalLM`` / the MoE one): the text model's names, the experts
#: stacked or not
TEXT_ONLY = CheckpointNaming(stacked_experts=True)


#: the ``model_type`` of a conditional-generation config (its text model's: ``qwen3_5_text`` / ``qwen3_5_moe_text``)
CONDITIONAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


def text_config(hf_config):
    """The text model's config: ``text_config`` of a conditional-generation config, else the config
    itself (a text-only one). A config that is neither (a conditional-generation ``model_type`` or
    architecture without a ``text_config``, a ``text_config`` without the text model's
    ``num_hidden_layers``, or no ``num_hidden_layers`` at all): ValueError naming the field."""
    text = _get(hf_config, "text_config", None)
    model_type, archs = _get(hf_config, "model_type", None), list(_get(hf_config, "architectures", None) or ())
    if text is not None:
        if _get(text, "num_hidden_layers", None) is None:
            raise ValueError(f"config.json: text_config of model_type {model_type!r} has no num_hidden_layers "
                             "(a Qwen3.5 *ForConditionalGeneration config keeps its text model's fields there)")
        return text
    conditional = model_type in CONDITIONAL_MODEL_TYPES or any(a.endswith("ForConditionalGeneration") for a in archs)
    if conditional or _get(hf_config, "num_hidden_layers", None) is None:
        raise ValueError(f"config.json: model_type {model_type!r}, architectures {archs} is neither a text-only "
                         "Qwen3.5 config (model_type 'qwen3_5_text' / 'qwen3_5_moe_text', num_hidden_layers at the "
                         "top) nor a *ForConditionalGeneration one: its text_config is missing")
    return hf_config


def checkpoint_naming(hf_config) -> CheckpointNaming:
    """How a Qwen3.5 checkpoint names its tensors: a conditional-generation config (a ``text_config``)
    stores them as :data:`CONDITIONAL_GENERATION` does, a text-only one as the text model
    (:data:`TEXT_ONLY`); either may stack the MoE's experts (neither kind of config:
    :func:`text_config`'s ValueError)."""
    return TEXT_ONLY if text_config(hf_config) is hf_config else CONDITIONAL_GENERATION


def layer_types(text, num_layers: int) -> tuple:
    """Each layer's type: ``layer_types``, else every ``full_attention_interval``-th (4) layer attention."""
    kinds = _get(text, "layer_types", None)
    if not kinds:
        every = int(_get(text, "full_attention_interval", 4) or 4)
        kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    bad = sorted(set(kinds) - set(LAYER_TYPES))
    if bad:
        raise NotImplementedError(f"qwen3_5: layer_types {bad} (supported: {list(LAYER_TYPES)})")
    if len(kinds) != num_layers:
        raise ValueError(f"qwen3_5: layer_types has {len(kinds)} entries for num_hidden_layers={num_layers}")
    return tuple(kinds)


def partial_rotary_factor(text) -> float:
    params = dict(_get(text, "rope_parameters", None) or {})
    return float(params.get("partial_rotary_factor", _get(text, "partial_rotary_factor", 0.25)))


def from_hf_config(hf_config, spec: str = "local", family: str = "qwen3_5",
                   moe: MoEConfig = None) -> GPTFamilyConfig:
    text = text_config(hf_config)
    act = _get(text, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"{family}: hidden_act={act!r} is not supported (only silu / SwiGLU)")
    if _get(text, "attention_bias", False):
        raise NotImplementedError(f"{family}: attention_bias=True is not supported")
    n = int(_get(text, "num_hidden_layers"))
    heads = int(_get(text, "num_attention_heads"))
    hidden = int(_get(text, "hidden_size"))
    tie = _get(text, "tie_word_embeddings", None)
    tie = _get(hf_config, "tie_word_embeddings", False) if tie is None else tie
    linear = LinearAttentionConfig(num_key_heads=int(_get(text, "linear_num_key_heads", 16)),
                                   num_value_heads=int(_get(text, "linear_num_value_heads", 32)),
                                   key_head_dim=int(_get(text, "linear_key_head_dim", 128)),
                                   value_head_dim=int(_get(text, "linear_value_head_dim", 128)),
                                   conv_kernel=int(_get(text, "linear_conv_kernel_dim", 4)))
    ffn = _get(text, "intermediate_size", None) or (moe.ffn_hidden_size if moe is not None else None)
    return GPTFamilyConfig(
        family=family,
        num_layers=n,
        hidden_size=hidden,
        ffn_hidden_size=int(ffn),
        num_attention_heads=heads,
        num_query_groups=int(_get(text, "num_key_value_heads", None) or heads),
        head_dim=int(_get(text, "head_dim", None) or hidden // heads),
        vocab_size=int(_get(text, "vocab_size")),
        tie_word_embeddings=bool(tie),
        qk_layernorm=True,
        norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(_get(text, "max_position_embeddings", 4096)),
        spec=spec,
        moe=moe,
        layer_types=layer_types(text, n),
        linear_attention=linear,
        attention_output_gate=True,
        rotary_percent=partial_rotary_factor(text),
        zero_centered_norms=True,
        **rope_settings(text),
    )


def moe_config_from_hf(hf_config) -> MoEConfig:
    """The routed and shared experts of a Qwen3.5-MoE config."""
    text = text_config(hf_config)
    if _get(text, "mlp_only_layers", None):
        raise NotImplementedError("qwen3_5_moe: mlp_only_layers (dense layers in an MoE stack) is not supported")
    shared = int(_get(text, "shared_expert_intermediate_size", 0) or 0)
    return MoEConfig(num_experts=int(_get(text, "num_experts")), router_topk=int(_get(text, "num_experts_per_tok")),
                     ffn_hidden_size=int(_get(text, "moe_intermediate_size")), router_pre_softmax=False,
                     router_score_function="softmax", shared_expert_ffn_hidden_size=shared,
                     shared_expert_gate=bool(shared))


def moe_from_hf_config(hf_config, spec: str = "local") -> GPTFamilyConfig:
    return from_hf_config(hf_config, spec=spec, family="qwen3_5_moe", moe=moe_config_from_hf(hf_config))
