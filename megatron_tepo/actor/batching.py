"""Micro-batches formed by a token budget.

Two plans, both lists of ORIGINAL row indices (so results can be scattered back into the
caller's order), longest rows first:

* :func:`plan_packed_micro_batches` (``actor.pack_sequences``, the default): the sequences are
  laid end to end without padding, so a micro-batch costs the SUM of its rows' lengths. First-fit
  decreasing: each row, longest first, goes into the first micro-batch it still fits in
  (``sum of lengths <= max_tokens_per_micro_batch``), else opens a new one.
* :func:`plan_micro_batches` (padded rows): a row joins the current micro-batch while
  ``padded length x row count`` stays within the budget (the padded length is the micro-batch's
  longest row, i.e. its first one).

In both, a single row longer than the budget gets a micro-batch of its own.

Equal count on every data-parallel rank (:func:`equalize_micro_batch_count`): the counts are
all-reduced (MAX) over the DP group; a rank with fewer micro-batches first splits its most
populous micro-batch in two (splitting never exceeds the budget) and, when every micro-batch
holds a single row, appends EMPTY micro-batches (``[]``), which the actor runs as a one-token
dummy row whose loss is exactly zero. Equal counts keep the ranks' collective sequences aligned
(the DP gradient all-reduce after the last micro-batch, MoE token exchanges).

Left out: balancing by compute cost (attention grows with the square of each sequence) rather
than tokens.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

MicroBatches = List[List[int]]


def _longest_first(seq_lens: Sequence[int], max_tokens_per_micro_batch: int):
    """(lengths, row indices longest first -- stable: ties keep input order), the budget checked."""
    if max_tokens_per_micro_batch < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
    lens = [int(x) for x in seq_lens]
    return lens, sorted(range(len(lens)), key=lambda i: -lens[i])


def plan_micro_batches(seq_lens: Sequence[int], max_tokens_per_micro_batch: int) -> MicroBatches:
    """Greedy token-budget packing; returns lists of original row indices (longest row first)."""
    lens, order = _longest_first(seq_lens, max_tokens_per_micro_batch)
    plan: MicroBatches = []
    current: List[int] = []
    for i in order:
        padded = lens[current[0]] if current else lens[i]
        if current and padded * (len(current) + 1) > max_tokens_per_micro_batch:
            plan.append(current)
            current = []
        current.append(i)
    if current:
        plan.append(current)
    return plan


def plan_packed_micro_batches(seq_lens: Sequence[int], max_tokens_per_micro_batch: int) -> MicroBatches:
    """First-fit decreasing packing of sequences laid end to end; lists of original row indices."""
    lens, order = _longest_first(seq_lens, max_tokens_per_micro_batch)
    plan: MicroBatches = []
    room: List[int] = []  # tokens left in each micro-batch
    for i in order:
        for k, left in enumerate(room):
            if lens[i] <= left:
                plan[k].append(i)
                room[k] -= lens[i]
                break
        else:
            plan.append([i])
            room.append(max_tokens_per_micro_batch - lens[i])
    return plan


def padded_tokens(micro_batch: Sequence[int], seq_lens: Sequence[int]) -> int:
    return max((int(seq_lens[i]) for i in micro_batch), default=0) * len(micro_batch)


def balance_to_count(plan: MicroBatches, count: int) -> MicroBatches:
    """Split the most populous micro-batches (then add empty ones) until there are ``count``."""
    if count < len(plan):
        raise ValueError(f"cannot shrink {len(plan)} micro-batches to {count}")
    plan = [list(mb) for mb in plan]
    while len(plan) < count:
        j = max(range(len(plan)), key=lambda k: len(plan[k]), default=None)
        if j is None or len(plan[j]) < 2:
            plan.append([])
            continue
        mb = plan[j]
        half = (len(mb) + 1) // 2
        plan[j:j + 1] = [mb[:half], mb[half:]]
    return plan


def equalize_micro_batch_count(plan: MicroBatches, dp_group=None) -> MicroBatches:
    """Give every rank of ``dp_group`` the same number of micro-batches (see module docstring)."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return plan
    device = "cuda" if torch.cuda.is_available() else "cpu"
    count = torch.tensor([len(plan)], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    return balance_to_count(plan, int(count.item()))
