"""A core attention on ``torch.nn.functional.scaled_dot_product_attention`` for megatron's local spec.

:class:`SDPACoreAttention` has the constructor and ``forward`` signature of megatron-core's
``DotProductAttention`` (plus ``packed_attention``) and takes its place in the local layer spec's
core-attention slot (:func:`megatron_tepo.megatron.spec.layer_spec`): the layer code does not change. It is
causal, handles grouped-query attention (``enable_gqa``), and never materialises the
``[b * heads, s, s]`` scores: torch picks a flash or memory-efficient kernel on GPU and its own
fused CPU kernel on CPU.

Inputs are megatron's: ``[s, b, heads, d]`` query / key / value (key and value with the local KV
heads), output ``[s, b, heads * d]``. Packed sequences (``packed_seq_params`` with
``qkv_format == "thd"``): inputs ``[t, heads, d]``, the sequences laid end to end with boundaries
``cu_seqlens_q``; attention never crosses two sequences. Three ways, chosen by the constructor's
``packed_attention`` (the resolved ``actor.packed_attention``, given by the layer spec):

* ``varlen`` -- one ``torch.nn.attention.varlen.varlen_attn`` call (flash attention's varlen
  kernel: CUDA, bf16/fp16) per layer, causal via ``window_size=(-1, 0)``, GQA native (the KV heads
  are passed as they are, never repeated: ``enable_gqa`` where torch has the flag, as 2.13 has;
  2.11 has none and hands fewer KV heads straight to the flash kernel, which shares them itself);
* ``flex`` -- one FlexAttention call per layer with a causal document mask (``create_block_mask``
  on the sequence ids; built once per micro-batch and kept on the ``packed_seq_params`` object,
  which every layer shares); compiled on CUDA, eager elsewhere (eager materialises the scores);
* ``loop`` -- one causal SDPA call per sequence.

``cu_seqlens_q`` may live on the CPU (the actor puts it there, which keeps the loop's per-layer
split free of device synchronisation); the single-call paths copy it to the device once per
micro-batch (cached on ``packed_seq_params``).

Context parallelism without Transformer Engine (``parallel.cp > 1``):
:func:`context_parallel_attention` (packed sequences split by
:func:`~megatron_tepo.token_layout.context_split`): the keys and values all-gathered over
the CP group, each sequence's two local chunks attending to the keys at or before their true
positions (one SDPA call per sequence with that mask: no flash or varlen kernel here, so it is the
CPU's and the bisecting GPU's path; Transformer Engine's ring attention is the GPU's). The layer
finds the split of every rank and the CP group on ``packed_seq_params``
(:meth:`~megatron_tepo.megatron.model.TrainModel.inputs` puts them there).

Left out (refused with an error naming the setting): attention dropout, context parallelism
without packed sequences, attention bias, masks other than causal (the actor's batches are
right-padded or packed, so causal attention never lets a real token see padding).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

__all__ = ["SDPACoreAttention", "packed_attention", "context_parallel_attention", "varlen_attn_fn",
           "flex_attention_fns"]

PACKED_MODES = ("varlen", "flex", "loop")


def _bounds(cu_seqlens) -> List[int]:
    return cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(x) for x in cu_seqlens]


def varlen_attn_fn():
    """``torch.nn.attention.varlen.varlen_attn``, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def flex_attention_fns():
    """``(flex_attention, create_block_mask)``, or None where this torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return flex_attention, create_block_mask


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    return torch.compile(flex_attention_fns()[0], dynamic=True)


@dataclasses.dataclass
class PackedInputs(PackedSeqParams):
    """megatron's ``PackedSeqParams`` (what its layers and Transformer Engine read of a packed
    micro-batch) with what this package's attention reads of it besides: with context parallelism
    every rank's split of the micro-batch and the context-parallel group (``splits``,
    ``split_group``: :class:`~megatron_tepo.token_layout.ContextSplit`), and ``cache``, the values
    computed once per micro-batch and shared by every layer (its host boundaries, masks).
    :meth:`~megatron_tepo.megatron.model.TrainModel.inputs` makes one per micro-batch."""
    splits: Optional[list] = None
    split_group: Optional[object] = None
    cache: Dict[str, object] = dataclasses.field(default_factory=dict)


def _cached(packed_seq_params, key: str, make):
    """A per-micro-batch value, kept in the :class:`PackedInputs` all layers share (computed anew
    for a plain ``PackedSeqParams``)."""
    cache = getattr(packed_seq_params, "cache", None)
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _loop(q, k, v, bounds: List[int], scale: float) -> torch.Tensor:
    """``[t, h, d]`` -> ``[t, h, d]``: one causal SDPA call per sequence."""
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:  # [s_i, h, d] -> [1, h, s_i, d] -> attention -> [s_i, h, d]
            qi, ki, vi = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                       enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1))
    return torch.cat(outs) if len(outs) > 1 else outs[0].contiguous()


def _flex(q, k, v, cu_seqlens, scale: float, packed_seq_params=None) -> torch.Tensor:
    """``[t, h, d]`` -> ``[t, h, d]``: one FlexAttention call with a causal document mask."""
    flex_attention, create_block_mask = flex_attention_fns()
    t, dev = q.shape[0], q.device

    def make_mask():
        cu = torch.as_tensor(cu_seqlens, device=dev)
        doc = torch.searchsorted(cu[1:].contiguous(), torch.arange(t, device=dev), right=True)

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        return create_block_mask(document_causal, B=None, H=None, Q_LEN=t, KV_LEN=t, device=dev)

    mask = make_mask() if packed_seq_params is None else _cached(packed_seq_params, f"flex_mask:{dev}", make_mask)
    fn = _compiled_flex() if dev.type == "cuda" else flex_attention
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, h, t, d]
    out = fn(qb, kb, vb, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _varlen(q, k, v, cu_seqlens, max_seqlen: int, scale: float, packed_seq_params=None) -> torch.Tensor:
    """``[t, h, d]`` -> ``[t, h, d]``: one flash varlen call (CUDA, bf16/fp16)."""
    dev = q.device

    def make_cu():
        return torch.as_tensor(cu_seqlens, device=dev, dtype=torch.int32)

    cu = make_cu() if packed_seq_params is None else _cached(packed_seq_params, f"cu32:{dev}", make_cu)
    fn = varlen_attn_fn()
    params = _parameters(fn)
    # causal: window_size=(-1, 0) from torch 2.11, is_causal=True in 2.10 (varlen_attn's first release)
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if q.shape[1] != k.shape[1] and "enable_gqa" in params:
        kw["enable_gqa"] = True  # (a torch without the flag passes fewer KV heads to flash as they are)
    return fn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), scale=scale, **kw)


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> frozenset:
    import inspect

    return frozenset(inspect.signature(fn).parameters)


def packed_attention(q, k, v, cu_seqlens, scale: float, mode: str = "loop", max_seqlen: Optional[int] = None,
                     packed_seq_params=None) -> torch.Tensor:
    """Causal attention of packed ``[t, heads, d]`` sequences (boundaries ``cu_seqlens``) by
    ``mode`` (varlen / flex / loop); output ``[t, heads, d]``."""
    if mode == "loop":
        return _loop(q, k, v, _bounds(cu_seqlens), scale)
    if mode == "flex":
        return _flex(q, k, v, cu_seqlens, scale, packed_seq_params)
    if mode == "varlen":
        if max_seqlen is None:
            bounds = _bounds(cu_seqlens)
            max_seqlen = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return _varlen(q, k, v, cu_seqlens, max_seqlen, scale, packed_seq_params)
    raise ValueError(f"packed attention mode {mode!r}: expected one of {list(PACKED_MODES)}")


class SDPACoreAttention(MegatronModule):
    """Causal GQA attention through torch SDPA (see the module docstring). Parameter-free."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, packed_attention: str = "loop"):
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError(f"attention_dropout={dropout}: the sdpa core attention has no dropout "
                                      f"(set actor.attention: te or unfused)")
        self.cp_size = getattr(config, "context_parallel_size", 1)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(f"attn_mask_type={attn_mask_type}: the sdpa core attention is causal only")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.packed_mode = packed_attention
        if self.packed_mode not in PACKED_MODES:
            raise ValueError(f"actor.packed_attention: {self.packed_mode!r} (resolved) must be one of {list(PACKED_MODES)}")

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[b, h, s, d]`` causal attention; KV heads shared by groups of query heads."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by the sdpa core attention")
        if self.cp_size > 1:
            splits = getattr(packed_seq_params, "splits", None)
            if splits is None:
                raise NotImplementedError("parallel.cp > 1: the sdpa core attention needs packed sequences split "
                                          "over the context-parallel ranks (actor.pack_sequences: true)")
            out = context_parallel_attention(query, key, value, splits, self.softmax_scale,
                                             packed_seq_params.split_group)
            return out.reshape(out.shape[0], -1)  # [t_r, h*d]
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q
            end = _cached(packed_seq_params, "end", lambda: int(cu[-1]))  # one read per micro-batch
            if end != query.shape[0]:
                raise ValueError(f"cu_seqlens end at {end} but the packed input has {query.shape[0]} tokens")
            out = packed_attention(query, key, value, cu, self.softmax_scale, mode=self.packed_mode,
                                   max_seqlen=packed_seq_params.max_seqlen_q, packed_seq_params=packed_seq_params)
            return out.reshape(out.shape[0], -1)  # [t, h*d] (megatron reshapes it to [t, 1, h*d])
        if packed_seq_params is not None:
            raise NotImplementedError(f"packed_seq_params with qkv_format={packed_seq_params.qkv_format!r}")
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        out = self._sdpa(q, k, v)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, h*d]


class _GatherTokens(torch.autograd.Function):
    """All-gather ``[t, ...]`` over ``group`` along the tokens (every rank the same ``t``); the
    backward sums the gathered gradient over the group and keeps this rank's slice (every rank's
    queries read every rank's keys and values)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.t = group, dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.t:(ctx.rank + 1) * ctx.t], None


def context_parallel_attention(q, k, v, splits, scale: float, group) -> torch.Tensor:
    """Causal attention of this context-parallel rank's tokens ``[t_r, heads, d]`` of packed
    sequences, laid out by ``splits[rank]`` (``splits``: every rank's
    :class:`~megatron_tepo.token_layout.ContextSplit`, the same sequences): the keys and
    values of every rank are all-gathered (their gradients come back summed), each sequence's keys
    put back in their true order, and each local query attends to the keys at or before its true
    position (one SDPA call per sequence with that mask). Output ``[t_r, heads, d]``."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    mine = splits[rank]
    k_all, v_all = _GatherTokens.apply(k, group), _GatherTokens.apply(v, group)
    index = torch.cat([s.index for s in splits]).to(q.device)  # gathered row -> padded layout position
    order = torch.empty_like(index)
    order[index] = torch.arange(index.numel(), device=q.device)  # padded layout position -> gathered row
    k_full, v_full = k_all[order], v_all[order]
    starts = torch.cat([mine.padded_lens.new_zeros(1), mine.padded_lens.cumsum(0)]).tolist()
    cu = mine.cu_seqlens.tolist()
    outs = []
    for i in range(len(mine.padded_lens)):
        qi = q[cu[i]:cu[i + 1]]
        if qi.shape[0] == 0:
            continue
        ki, vi = k_full[starts[i]:starts[i + 1]], v_full[starts[i]:starts[i + 1]]
        qpos = mine.positions[cu[i]:cu[i + 1]].to(q.device)
        mask = qpos[:, None] >= torch.arange(ki.shape[0], device=q.device)[None, :]  # [t_q, t_k]
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (qi, ki, vi))  # [1, h, t, d]
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)
