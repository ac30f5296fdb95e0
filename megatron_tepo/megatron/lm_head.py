"""The LM head moved out of megatron's model: the last pipeline stage returns its final hidden
states, and the actor scores only the positions it needs (``actor.lm_head``).

megatron's ``GPTModel`` ends in an output layer (a ``ColumnParallelLinear``: the sequence-parallel
all-gather or the tensor-parallel copy of its input, then ``[tokens, h] x [h, V/tp]``) that makes
logits for every position of the micro-batch, prompt and padding included. :func:`hidden_output`
replaces that layer's forward on one model with its input region only: the model then returns the
final hidden states ``[b, s, h]`` exactly as the output layer would have multiplied them (gathered
over the sequence-parallel ranks, or under the copy whose backward all-reduces their gradient over
the tensor-parallel ranks), and :func:`scored_log_probs` runs the head at the scored positions:

* ``fused`` -- :func:`~megatron_tepo.ops.lm_head.lm_head_log_probs_and_entropy`: log-probs, entropy
  and their gradients from the hidden states and the weight shard, in vocabulary blocks, never the
  ``[n, V/tp]`` logits;
* ``materialized`` -- the logits of the scored positions, then the vocab op
  (:func:`~megatron_tepo.ops.vocab_parallel.vocab_parallel_log_probs_and_entropy`): the path of the
  output layer restricted to those positions, kept for bisecting.

The output layer's parameters stay where they are (checkpoints, the weight export, the tied
embedding's synchronisation across pipeline stages are unchanged); only its forward is replaced.

Context parallelism: each rank runs the head at the scored positions it holds, and
:func:`sum_over_context` brings every rank's slots together in the batch's order.

:func:`note_hidden_gradient_gemm` says once, at the actor's build, when the fused head's hidden-state
gradient cannot be summed in place in fp32 by this torch on CUDA (torch before 2.10: it then runs
those GEMMs in fp32, several times slower; :func:`~megatron_tepo.ops.lm_head.mixed_gemm_accumulates`).

Left out: megatron's multi-token prediction (its layers call the output layer themselves; none of
the supported families has them), MuP's logit scaling (not used), and the output layer's
``gradient_accumulation_fusion`` (the head returns the weight's gradient; megatron DDP adds it to
``main_grad`` as for any parameter).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

__all__ = ["LM_HEADS", "hidden_output", "scored_log_probs", "sum_over_context", "note_hidden_gradient_gemm"]

LM_HEADS = ("fused", "materialized")
_NOTED: List[str] = []  # what this process said of the fused head's GEMMs (once)


def note_hidden_gradient_gemm(device, bf16: bool, lm_head: str, say: bool = True) -> Optional[str]:
    """The one line saying that the fused head (``lm_head``) of a ``bf16`` actor on ``device`` sums
    its hidden-state gradient through fp32 GEMMs, since this torch's CUDA ``addmm`` cannot add a
    bf16 product into an fp32 tensor in place; None where it can (or nothing of it applies).
    Printed the first time in this process where ``say`` (the build's first rank of the last
    pipeline stage)."""
    from megatron_tepo.ops.lm_head import mixed_gemm_accumulates

    if lm_head != "fused" or not bf16 or torch.device(device).type != "cuda" or mixed_gemm_accumulates(device):
        return None
    line = (f"[megatron_tepo] actor.lm_head: fused: torch {torch.__version__} cannot add a bf16 GEMM's product "
            "into an fp32 tensor in place on CUDA (addmm with an fp32 out_dtype into it: torch >= 2.10): the "
            "head's hidden-state gradient runs its GEMMs in fp32, several times slower")
    if say and not _NOTED:
        print(line, flush=True)
        _NOTED.append(line)
    return line


def hidden_output(gpt) -> torch.nn.Parameter:
    """Make ``gpt`` (a last-stage ``GPTModel``) return its final hidden states instead of logits
    (module docstring); returns the output weight the head multiplies by (the embedding's when
    they are tied)."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    layer = gpt.output_layer
    if getattr(gpt.config, "mtp_num_layers", None):
        raise ValueError("actor.lm_head: multi-token prediction layers call the output layer themselves; not supported")
    group = getattr(layer, "tp_group", None)

    def forward(input_, weight=None, runtime_gather_output=None):
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
        else:
            hidden = copy_to_tensor_model_parallel_region(input_, group=group)
        return _ContiguousGrad.apply(hidden), None

    layer.forward = forward
    return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else layer.weight


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. The model transposes its output to
    ``[b, s, h]``, so the gradient reaching the region op is a strided ``[s, b, h]`` view when
    ``b > 1``; megatron-core 0.16.1's ``_reduce`` all-reduces a contiguous copy of such a gradient
    and returns the original, unsummed (its output layer never met one: the linear's backward
    reduces its own gradient). Found by the packed-against-padded check at TP=2 on that stack."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def scored_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scored: Tuple[torch.Tensor, ...],
                     shape: Tuple[int, int], tp_group=None, temperature: float = 1.0,
                     lm_head: str = "fused", block_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy ``[b, R]`` (``shape``) of the scored slots, 0 elsewhere.

    ``hidden``: the model's output ``[.., h]`` (one row per flat position); ``labels``: ``[N]``, the
    token each position scores; ``scored``: ``(positions, slots)`` of the valid slots
    (:meth:`~megatron_tepo.token_layout.MicroBatch.scored_index`)."""
    from megatron_tepo.ops.lm_head import lm_head_log_probs_and_entropy
    from megatron_tepo.ops.vocab_parallel import vocab_parallel_log_probs_and_entropy

    if lm_head not in LM_HEADS:
        raise ValueError(f"actor.lm_head: expected one of {', '.join(LM_HEADS)}, got {lm_head!r}")
    positions, slots = scored
    flat = hidden.reshape(-1, hidden.shape[-1])
    h = flat.index_select(0, positions)
    target = labels.index_select(0, positions)
    if lm_head == "fused":
        lp, ent = lm_head_log_probs_and_entropy(h, weight, target, tp_group=tp_group, temperature=temperature,
                                                block_size=block_size)
    else:
        lp, ent = vocab_parallel_log_probs_and_entropy(torch.nn.functional.linear(h, weight), target,
                                                       tp_group=tp_group, temperature=temperature)
    size = shape[0] * shape[1]
    out_lp = lp.new_zeros(size).index_put((slots,), lp)
    out_ent = ent.new_zeros(size).index_put((slots,), ent)
    return out_lp.view(shape), out_ent.view(shape)


class _SumOverContext(torch.autograd.Function):
    """All-reduce (sum) over the context-parallel group; the backward hands the gradient on as it
    is: every rank computes the same loss from the summed values, and each rank's own slots are
    the only ones its graph reaches."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_context(values: torch.Tensor, group) -> torch.Tensor:
    """The per-slot results of every context-parallel rank in one ``[..]`` tensor (each slot is
    scored on exactly one rank, 0 on the others: the sum is exact). Differentiable: the loss is
    then computed whole on every rank, and megatron's DDP sums each rank's share of the gradients
    over the data- x context-parallel ranks."""
    return _SumOverContext.apply(values, group)
