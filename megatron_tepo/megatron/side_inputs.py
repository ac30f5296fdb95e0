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
(:meth:`SideInputs.shard`); context parallelism cuts before that (:class:`ContextSplit`).

Context parallelism's load-balanced split of packed sequences is :func:`context_split` (one
rank's tokens of every sequence, with their true positions); :meth:`ContextSplit.take` slices any
per-token field of the packed layout with it, so inputs, labels and side inputs are cut in one
place (:meth:`~megatron_tepo.actor.micro_batch.MicroBatch.context_shard`); :meth:`ContextSplit.put`
takes every rank's part back (the routing a recording pass chose).

Pure torch: nothing of megatron-core is imported. Left out: pipeline stages need no slicing (every
stage sees every token; a per-layer field is read by the layers the stage holds).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SideInputs", "ContextSplit", "context_split", "lay_out_positions", "positions_to_rows",
           "scored_positions"]


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


@dataclass(frozen=True)
class ContextSplit:
    """Context-parallel rank ``rank`` of ``size``'s share of a packed micro-batch: every sequence
    padded to a multiple of ``2 * size`` tokens and cut into ``2 * size`` equal chunks, this rank
    holding chunks ``rank`` and ``2 * size - 1 - rank`` (an early and a late one: under causal
    attention every rank then has about the same work). ``index``: this rank's tokens, in order,
    as positions of the padded packed layout (the sequences' padded lengths end to end);
    ``positions``: each one's position in its own sequence (RoPE); ``cu_seqlens``: where each
    sequence's two chunks start in this rank's tokens; ``padded_lens``: each sequence's padded
    length. A token's label is the next token of the whole sequence, so labels (and which
    positions score a response token) are taken before the split: the last token of a chunk is
    scored against the first of the next chunk, whichever rank holds that."""

    size: int
    rank: int
    seq_lens: torch.Tensor
    padded_lens: torch.Tensor
    index: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor

    def _real_in_padded(self) -> torch.Tensor:
        """``[T]``: where each real token of the packed layout sits in the padded one."""
        starts = torch.cat([self.padded_lens.new_zeros(1), self.padded_lens.cumsum(0)[:-1]])
        return torch.repeat_interleave(starts, self.seq_lens) + _ranks_within(self.seq_lens)

    def take(self, field: torch.Tensor, fill=0) -> torch.Tensor:
        """This rank's part of a per-token field ``[T, ...]`` of the packed layout (the sequences'
        real tokens end to end, then anything: a pad segment is ignored): padded per sequence with
        ``fill``, then cut."""
        total = int(self.seq_lens.sum())
        if field.shape[0] < total:
            raise ValueError(f"context split: the field has {field.shape[0]} tokens, the sequences {total}")
        where = self._real_in_padded()
        padded = field.new_full((int(self.padded_lens.sum()),) + tuple(field.shape[1:]), fill)
        padded[where] = field[:total]
        return padded[self.index]

    def put(self, parts, splits) -> torch.Tensor:
        """The inverse of :meth:`take` over the whole group: every rank's ``[t_r, ...]`` (``parts``,
        in rank order, each rank's split in ``splits``) back to ``[T, ...]``, the sequences' real
        tokens end to end (the padding dropped)."""
        first = parts[0]
        padded = first.new_empty((int(self.padded_lens.sum()),) + tuple(first.shape[1:]))
        for split, part in zip(splits, parts):
            padded[split.index] = part
        where = self._real_in_padded()
        return padded[where]


    def locate(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions of real tokens in the packed layout -> their index among this rank's tokens,
        -1 where another rank holds them."""
        positions = torch.as_tensor(positions, dtype=torch.long)
        seq_ends = self.seq_lens.cumsum(0)
        seq = torch.searchsorted(seq_ends, positions, right=True)
        pad_starts = torch.cat([self.padded_lens.new_zeros(1), self.padded_lens.cumsum(0)[:-1]])
        padded_pos = pad_starts[seq] + positions - (seq_ends[seq] - self.seq_lens[seq])
        local_of = torch.full((int(self.padded_lens.sum()),), -1, dtype=torch.long)
        local_of[self.index] = torch.arange(self.index.numel())
        return local_of[padded_pos]


def _ranks_within(lens: torch.Tensor) -> torch.Tensor:
    """``[0 .. l_0 - 1, 0 .. l_1 - 1, ...]``: each token's position in its sequence."""
    total = int(lens.sum())
    starts = torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]])
    return torch.arange(total) - torch.repeat_interleave(starts, lens, output_size=total)


def context_split(seq_lens: torch.Tensor, size: int, rank: int) -> ContextSplit:
    """The load-balanced split of packed sequences of ``seq_lens`` tokens for context-parallel rank
    ``rank`` of ``size`` (:class:`ContextSplit`). A sequence shorter than ``2 * size`` tokens is
    padded to ``2 * size``: each chunk then holds one token, some of them padding."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"context split: rank {rank} of {size}")
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.long)
    if seq_lens.dim() != 1 or bool((seq_lens < 1).any()):
        raise ValueError(f"context split: sequence lengths must be >= 1, got {seq_lens.tolist()}")
    parts = 2 * size
    padded = (seq_lens + parts - 1) // parts * parts
    chunk = padded // parts
    starts = torch.cat([padded.new_zeros(1), padded.cumsum(0)[:-1]])
    local = 2 * chunk  # this rank's tokens of each sequence: chunk `rank`, then chunk `parts - 1 - rank`
    total = int(local.sum())
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), local, output_size=total)
    within = _ranks_within(local)  # 0 .. 2 c - 1 in each sequence
    c = chunk[seq_of]
    pos = torch.where(within < c, rank * c + within, (parts - 1 - rank) * c + within - c)
    return ContextSplit(size=size, rank=rank, seq_lens=seq_lens, padded_lens=padded, index=starts[seq_of] + pos,
                        positions=pos, cu_seqlens=torch.cat([local.new_zeros(1), local.cumsum(0)]).to(torch.int32))
