"""Llama HF config -> :class:`GPTFamilyConfig`.

Llama: no QKV bias, no QK-norm, optional llama3/linear rope scaling, optionally tied embeddings.
Left out: ``attention_bias`` / ``mlp_bias`` (they also bias o_proj / the MLP, which megatron's
``add_bias_linear`` cannot express together with a bias-free rest) -> NotImplementedError.
"""
from __future__ import annotations

from ..family import GPTFamilyConfig, _get, base_family_config


def from_hf_config(hf_config, spec: str = "local") -> GPTFamilyConfig:
    for flag in ("attention_bias", "mlp_bias"):
        if _get(hf_config, flag, False):
            raise NotImplementedError(f"llama: {flag}=True is not supported")
    return base_family_config(hf_config, "llama", spec)
