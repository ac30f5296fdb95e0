"""A core attention on ``torch.nn.functional.scaled_dot_product_attention`` for megatron's local spec.

:class:`SDPACoreAttention` has the constructor and ``forward`` signature of megatron-core's
``DotProductAttention`` and takes its place at
``spec.submodules.self_attention.submodules.core_attention`` (see
:func:`megatron_tepo.megatron.gpt.build_gpt_chunk`): the layer code does not change. It is
causal, handles grouped-query attention (``enable_gqa``), and never materialises the
``[b * heads, s, s]`` scores: torch picks a flash or memory-efficient kernel on GPU and its own
fused CPU kernel on CPU.

Inputs are megatron's: ``[s, b, heads, d]`` query / key / value (key and value with the local KV
heads), output ``[s, b, heads * d]``. Packed sequences (``packed_seq_params`` with
``qkv_format == "thd"``): inputs ``[t, heads, d]``, the sequences laid end to end with boundaries
``cu_seqlens_q``; each sequence is attended to on its own (one causal SDPA call per sequence), so
attention never crosses two sequences. ``cu_seqlens_q`` may live on the CPU (the actor puts it
there), which keeps the per-layer split free of device synchronisation.

Left out (refused with an error naming the setting): attention dropout, context parallelism,
attention bias, masks other than causal (the actor's batches are right-padded or packed, so
causal attention never lets a real token see padding).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

__all__ = ["SDPACoreAttention"]


def _bounds(cu_seqlens) -> List[int]:
    return cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(x) for x in cu_seqlens]


class SDPACoreAttention(MegatronModule):
    """Causal GQA attention through torch SDPA (see the module docstring). Parameter-free."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError(f"attention_dropout={dropout}: the sdpa core attention has no dropout "
                                      f"(set actor.attention: te or unfused)")
        if getattr(config, "context_parallel_size", 1) > 1:
            raise NotImplementedError("context parallelism is not supported by the sdpa core attention")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(f"attn_mask_type={attn_mask_type}: the sdpa core attention is causal only")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[b, h, s, d]`` causal attention; KV heads shared by groups of query heads."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by the sdpa core attention")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            bounds = _bounds(packed_seq_params.cu_seqlens_q)
            outs = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b > a:  # [s_i, h, d] -> [1, h, s_i, d] -> attention -> [s_i, h, d]
                    q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                    outs.append(self._sdpa(q, k, v)[0].transpose(0, 1))
            if bounds[-1] != query.shape[0]:
                raise ValueError(f"cu_seqlens end at {bounds[-1]} but the packed input has {query.shape[0]} tokens")
            out = torch.cat(outs) if len(outs) > 1 else outs[0].contiguous()
            return out.reshape(out.shape[0], -1)  # [t, h*d] (megatron reshapes it to [t, 1, h*d])
        if packed_seq_params is not None:
            raise NotImplementedError(f"packed_seq_params with qkv_format={packed_seq_params.qkv_format!r}")
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        out = self._sdpa(q, k, v)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, h*d]
