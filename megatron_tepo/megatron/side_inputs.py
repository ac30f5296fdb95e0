"""A micro-batch's side inputs: the per-token inputs of one forward besides the token ids and
positions, laid out in the order megatron's layers see the tokens, and handed to megatron for that
forward and its recompute. The one room between the actor's micro-batches
(:mod:`megatron_tepo.actor.micro_batch`, which builds a :class:`SideInputs` per micro-batch with
:func:`lay_out_positions`) and the train model (:meth:`megatron_tepo.megatron.model.TrainModel.run`,
which hands them to the model: today the MoE routing replay, :mod:`.routing_replay`).

Token order. megatron's layers work on ``[s, b, h]`` activations and flatten them sequence-major
wherever they work per token (the MoE router's ``[s * b, experts]`` logits): a padded micro-batch
``[b, S]`` has row ``r``'s position ``s`` at ``n = s * b + r``; a packed one (``[1, T]``, THD) has
its tokens in the packed order. A :class:`SideInputs` tensor is ``[N, ...]`` in that order, ``N =
b * S`` (or ``T``), so a layer indexes it with the same ``n`` as its own tokens. Sequence
parallelism splits the ``s`` dimension over the TP ranks, a contiguous range of ``n`` for each
(:meth:`SideInputs.shard`); context parallelism will be another slice here.

Pure torch: nothing of megatron-core is imported. Left out: pipeline stages need no slicing (every
stage sees every token; a per-layer field is read by the layers the stage holds), context
parallelism's load-balanced split (its slot is :meth:`SideInputs.shard`'s neighbour).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SideInputs", "lay_out_positions", "positions_to_rows", "scored_positions"]


@dataclass
class SideInputs:
    """One micro-batch's per-token side inputs, each ``[N, ...]`` in megatron's token order (module
    docstring). ``routed_experts``: the experts each token is routed to in each MoE layer of the
    model (``[N, moe_layers, topk]``, -1 where none is given); ``scored``: ``[N]`` bool, the
    positions whose output scores a response or prompt token (every real position but the last
    of its sequence): the routing replay must cover these."""

    routed_experts: Optional[torch.Tensor] = None
    scored: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        for value in dataclasses.astuple(self):
            if value is not None:
                return int(value.shape[0])
        return 0

    def to(self, device: torch.device, non_blocking: bool = False) -> "SideInputs":
        def move(t):
            if t is None or t.device == device:
                return t
            return (t.pin_memory() if non_blocking else t).to(device, non_blocking=non_blocking)

        return SideInputs(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def shard(self, rank: int, size: int) -> "SideInputs":
        """The tokens of sequence-parallel rank ``rank`` of ``size`` (a contiguous ``N / size``)."""
        if size == 1:
            return self
        n = self.num_tokens
        if n % size:
            raise ValueError(f"side inputs: {n} tokens do not split over {size} sequence-parallel ranks")
        part = n // size
        return SideInputs(**{f.name: (None if getattr(self, f.name) is None
                                      else getattr(self, f.name)[rank * part:(rank + 1) * part])
                             for f in dataclasses.fields(self)})


def lay_out_positions(field: torch.Tensor, *, packed: bool, seq_lens: torch.Tensor, rows: int, length: int,
                      fill=-1) -> torch.Tensor:
    """A per-position field of a micro-batch's rows (``[b, L, ...]``, position ``p`` of row ``i`` at
    ``[i, p]``) as ``[N, ...]`` in megatron's token order.

    ``packed``: the rows' first ``seq_lens[i]`` positions end to end, then ``fill`` up to
    ``length`` tokens (the micro-batch's pad segment). Padded: rows right-padded (or cut) to
    ``length`` columns, ``fill`` rows up to ``rows``, flattened sequence-major."""
    b, width = field.shape[:2]
    rest = tuple(field.shape[2:])
    if packed:
        keep = torch.arange(width)[None] < seq_lens[:, None]
        flat = field[keep]
        if flat.shape[0] > length:
            raise ValueError(f"side inputs: {flat.shape[0]} packed tokens exceed the micro-batch's {length}")
        out = field.new_full((length,) + rest, fill)
        out[:flat.shape[0]] = flat
        return out
    if b > rows:
        raise ValueError(f"side inputs: {b} rows exceed the micro-batch's {rows}")
    grid = field.new_full((rows, length) + rest, fill)
    cols = min(width, length)
    grid[:b, :cols] = field[:, :cols]
    return grid.transpose(0, 1).reshape((length * rows,) + rest)


def positions_to_rows(flat: torch.Tensor, *, packed: bool, seq_lens: torch.Tensor, rows: int, length: int,
                      width: int, fill=-1) -> torch.Tensor:
    """The inverse of :func:`lay_out_positions`: ``[N, ...]`` in token order back to the
    ``len(seq_lens)`` real rows, ``[b, width, ...]`` (``fill`` past each row's tokens)."""
    b = int(seq_lens.shape[0])
    rest = tuple(flat.shape[1:])
    out = flat.new_full((b, width) + rest, fill)
    if packed:
        keep = torch.arange(width)[None] < seq_lens[:, None]
        out[keep] = flat[:int(keep.sum())]
        return out
    grid = flat.reshape((length, rows) + rest).transpose(0, 1)[:b]
    cols = min(width, length)
    out[:, :cols] = grid[:, :cols]
    keep = torch.arange(width)[None] < seq_lens[:, None]
    out[~keep] = fill
    return out


def scored_positions(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """``[b, width]`` bool: the positions whose output scores the next token (all but the last of
    each sequence)."""
    return torch.arange(width)[None] < (seq_lens[:, None] - 1)
