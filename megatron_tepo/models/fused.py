"""Small pure tensor functions between HF's separate tensors and megatron's fused ones:
:func:`fuse_qkv` / :func:`split_qkv` (megatron's per-query-group interleaved QKV layout),
:func:`fuse_gated_qkv` / :func:`split_gated_qkv` (the same with gated attention's output gate) and
:func:`fuse_gate_up` / :func:`split_gate_up` (SwiGLU ``linear_fc1``). Tensors are full (unsharded);
which name goes with which is :mod:`.names`'. Left out: tensor parallelism's slicing
(:mod:`megatron_tepo.megatron.sharding`)."""
from __future__ import annotations

from typing import Tuple

import torch

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
