"""What one step of the actor launches and syncs, counted on any device
(:mod:`megatron_tepo.launch_costs`): the numbers ``benchmarks/actor_step.py --counts`` prints and
the launch-overhead tests assert on.

:func:`count_step` runs a log-prob pass, a forward-backward and an optimizer step of ``actor`` on
``batch`` and returns, per phase, the aten ops dispatched and the host syncs (with their sites).
The sdpa core attention is left out of the counts (forward and backward): on CPU it is one SDPA
call per packed sequence by necessity, while on a GPU it is one varlen or flex call; everything
else of the step is counted. :func:`count_compiles` runs both passes over batches of several
packed lengths and reports dynamo's compiled graphs after each.

Left out: timing (``benchmarks/actor_step.py`` times the same step), pipeline-parallel layouts.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, List

import torch

from megatron_tepo.launch_costs import LaunchCounter, compiles, uncounted

__all__ = ["count_step", "count_compiles", "core_attention_uncounted"]


@contextlib.contextmanager
def core_attention_uncounted():
    """While inside, the sdpa core attention's forward and backward are not counted."""
    from megatron_tepo.megatron import attention

    originals = attention.packed_attention, attention.SDPACoreAttention._sdpa
    attention.packed_attention = uncounted(originals[0])
    sdpa = uncounted(lambda q, k, v, scale: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]))
    attention.SDPACoreAttention._sdpa = lambda self, q, k, v: sdpa(q, k, v, self.softmax_scale)
    try:
        yield
    finally:
        attention.packed_attention, attention.SDPACoreAttention._sdpa = originals


def count_step(actor, batch, loss) -> Dict[str, dict]:
    """``{"log_probs" | "forward_backward" | "optimizer_step": {"ops", "syncs", "sync_sites"}}`` of
    one step of ``actor`` on ``batch`` (its ``old_log_probs`` are filled in from the log-prob pass)."""
    out = {}
    with core_attention_uncounted():
        with LaunchCounter() as c:
            lp, ent = actor.compute_log_probs(batch)
        out["log_probs"] = c.summary()
        batch.old_log_probs, batch.old_entropy = lp, ent
        with LaunchCounter() as c:
            actor.forward_backward(batch, loss)
        out["forward_backward"] = c.summary()
        with LaunchCounter() as c:
            actor.optimizer_step()
        out["optimizer_step"] = c.summary()
    return out


def count_compiles(actor, batches: Iterable, loss) -> List[int]:
    """Dynamo's compiled graphs in this process after the log-prob pass and the train step of each
    batch in turn (``[after batch 1's log-probs, after its train step, after batch 2's ...]``)."""
    counts = []
    for batch in batches:
        batch.old_log_probs, batch.old_entropy = actor.compute_log_probs(batch)
        counts.append(compiles())
        actor.train_step(batch, loss)
        counts.append(compiles())
    return counts
