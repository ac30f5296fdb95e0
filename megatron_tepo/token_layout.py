"""The token layout of one micro-batch, in one place: how the rows of a
:class:`~megatron_tepo.batch.RolloutBatch` become the tokens megatron's layers see (packed or
padded), where each response slot is scored, the per-token side inputs laid out in that order, and
each context-parallel rank's share. Pure torch: nothing of megatron-core is imported; the actor
builds these, the train model (:mod:`megatron_tepo.megatron.model`) hands them to megatron.

**A micro-batch** (:class:`MicroBatch`, :func:`build_micro_batch`):

* packed (``actor.pack_sequences``): ``input_ids`` is ``[1, T]``, the rows' tokens (prompt and
  response up to the last real response token) laid end to end with no padding; ``cu_seqlens``
  ``[n + 1]`` (int32, CPU) marks where each sequence starts; ``position_ids`` restart at 0 in
  every sequence. A trailing pad segment is added only when ``T`` must be a multiple of
  ``pad_multiple`` (sequence parallelism splits the tokens over TP ranks) or the micro-batch must
  match another rank's shape; it is a sequence of its own, so no real token attends to it.
* padded: ``input_ids`` is ``[b, S]``, each row right-padded to the longest (``S >= 2``).

Either way the model's outputs (its final hidden states) are read as ``[N, h]`` rows, ``N =
input_ids.numel()``: ``labels[n]`` is the token the output at flat position ``n`` scores (0 where
none is scored), and ``score_index[i, j]`` is the flat position whose output scores response slot
``j`` of row ``i`` (the token before it), ``valid[i, j]`` whether that slot is real.
:meth:`MicroBatch.scored_index` lists the valid slots' positions, so the LM head runs at those
positions only (never at prompt or padding positions) and its results land in ``[b, R]``;
packing changes where a token sits, never what it is scored against.

**Token order and side inputs.** megatron's layers work on ``[s, b, h]`` activations and flatten
them sequence-major wherever they work per token (the MoE router's ``[s * b, experts]`` logits): a
padded micro-batch ``[b, S]`` has row ``r``'s position ``s`` at ``n = s * b + r``; a packed one
(``[1, T]``, THD) has its tokens in the packed order. A :class:`SideInputs` tensor (the per-token
inputs of one forward besides ids and positions: the MoE routing replay's experts,
:mod:`megatron_tepo.megatron.routing_replay`) is ``[N, ...]`` in that order, laid out from the rows'
per-position fields (:data:`~megatron_tepo.batch.PER_POSITION_FIELDS`) by :func:`lay_out_positions`
for the micro-batch's final shape (pad segments and dummy rows included); without them ``side`` is
None and nothing else is built. Sequence parallelism splits the ``s`` dimension over the TP ranks, a
contiguous range of ``n`` for each (:meth:`SideInputs.shard`).

**Context parallelism.** The split follows the CP chunk rule (``megatron_tepo/layout.py``: a
sequence padded to a multiple of ``2 * cp`` tokens, cut into ``2 * cp`` chunks, rank ``r`` holding
chunks ``r`` and ``2 * cp - 1 - r``): :func:`context_split` gives one rank's tokens of every
sequence with their true positions; :meth:`ContextSplit.take` slices any per-token field of the
packed layout with it, so :meth:`MicroBatch.context_shard` cuts the ids, positions, labels (taken in
the whole layout first, so a chunk's last token keeps the next chunk's first as its label), side
inputs and scored slots in one place; :meth:`ContextSplit.put` takes every rank's part back (the
routing a recording pass chose); :meth:`MicroBatch.with_context_tokens` pads first where each
rank's share must be a multiple of the sequence-parallel split or match another rank's.

Left out: pipeline stages need no slicing (every stage sees every token; a per-layer field is read
by the layers the stage holds).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_tepo.batch import PER_TOKEN_FIELDS, RolloutBatch
from megatron_tepo.layout import cp_chunk, cp_padded, cp_position, cp_rank_tokens, cp_segment, cp_share

__all__ = ["MicroBatch", "build_micro_batch", "micro_batches", "empty_rows", "SideInputs", "ContextSplit", "context_split",
           "lay_out_positions", "positions_to_rows", "scored_positions"]


# --------------------------------------------------------------------------------------------
# Side inputs and the context-parallel split
# --------------------------------------------------------------------------------------------
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
    padded, chunk = cp_padded(seq_lens, size), cp_chunk(seq_lens, size)
    starts = torch.cat([padded.new_zeros(1), padded.cumsum(0)[:-1]])
    local = 2 * chunk  # this rank's tokens of each sequence: chunk `rank`, then chunk `2 size - 1 - rank`
    total = int(local.sum())
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), local, output_size=total)
    pos = cp_position(_ranks_within(local), chunk[seq_of], size, rank)  # 0 .. 2 c - 1 in each sequence
    return ContextSplit(size=size, rank=rank, seq_lens=seq_lens, padded_lens=padded, index=starts[seq_of] + pos,
                        positions=pos, cu_seqlens=torch.cat([local.new_zeros(1), local.cumsum(0)]).to(torch.int32))


# --------------------------------------------------------------------------------------------
# The micro-batch
# --------------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    rows: List[int]  # rows of the DP-local batch (scatter results back here); [] for a dummy
    data: RolloutBatch  # those rows' fields (a one-row, fully masked stand-in for a dummy)
    input_ids: torch.Tensor  # [1, T] packed or [b, S] padded
    position_ids: torch.Tensor  # same shape
    labels: torch.Tensor  # [N] long
    score_index: torch.Tensor  # [b, R] long, into the N flat positions
    valid: torch.Tensor  # [b, R] bool
    cu_seqlens: Optional[torch.Tensor] = None  # [n + 1] int32 (packed only), on the host
    max_seqlen: int = 0  # longest sequence (packed only)
    per_token: Optional[Dict[str, Optional[torch.Tensor]]] = None  # data's per-token fields, once staged
    row_index: Optional[torch.Tensor] = None  # rows as a long tensor, once staged
    side: Optional[SideInputs] = None  # per-token side inputs in megatron's token order (or None)
    scored: Optional[tuple] = None  # (positions, slots) of the valid response slots, once staged
    # context parallelism (context_shard): every CP rank's ContextSplit of the whole micro-batch,
    # and the whole micro-batch's padded sequence boundaries and longest padded sequence
    cp_splits: Optional[list] = None
    cp_cu_seqlens: Optional[torch.Tensor] = None
    cp_max_seqlen: int = 0

    def scored_index(self) -> tuple:
        """``(positions, slots)``, each ``[n]`` long, one entry per valid response slot in row-major
        order: the flat position whose output scores it and the slot's index in the flattened
        ``[b, R]``. Built on the host (no device sync), kept on the device once :meth:`staged`."""
        if self.scored is not None:
            return self.scored
        slots = self.valid.reshape(-1).nonzero().squeeze(1)
        return self.score_index.reshape(-1)[slots], slots

    def field(self, name: str) -> Optional[torch.Tensor]:
        """Per-token field ``name`` of these rows (``[b, R]``), on the device once :meth:`staged`."""
        return self.per_token[name] if self.per_token is not None else getattr(self.data, name)

    def staged(self, device: torch.device) -> "MicroBatch":
        """This micro-batch with every tensor the step reads on ``device``: on a GPU from pinned
        host copies, ``non_blocking``, so the copies of all micro-batches are queued before the
        first forward and nothing waits for them on the host. ``cu_seqlens`` stays on the host
        (the sdpa attention splits on it there; the RoPE tables and Transformer Engine copy it
        themselves)."""
        pin = device.type == "cuda"

        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None or t.device == device:
                return t
            return (t.pin_memory() if pin else t).to(device, non_blocking=pin)

        return dataclasses.replace(
            self, input_ids=move(self.input_ids), position_ids=move(self.position_ids), labels=move(self.labels),
            score_index=move(self.score_index), valid=move(self.valid),
            per_token={f: move(getattr(self.data, f)) for f in PER_TOKEN_FIELDS},
            row_index=move(torch.as_tensor(self.rows, dtype=torch.long)),
            side=None if self.side is None else self.side.to(device, non_blocking=pin),
            scored=tuple(move(t) for t in self.scored_index()))

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def shape(self) -> tuple:
        return tuple(self.input_ids.shape)

    def padded_to(self, rows: int, length: int) -> "MicroBatch":
        """Grown to ``input_ids`` of ``rows x length`` (packed: ``rows`` must be 1 and a pad
        segment is appended; padded: dummy rows and pad columns after every real token)."""
        b, s = self.shape
        if rows < b or length < s:
            raise ValueError(f"cannot shrink a {b}x{s} micro-batch to {rows}x{length}")
        if (rows, length) == (b, s):
            return self
        if self.packed:
            if rows != 1:
                raise ValueError("a packed micro-batch has one row")
            return _with_side(_with_pad_segment(self, length - s))
        data = self.data.select(range(self.data.batch_size), max_len=s)  # (rows keep the batch's width)
        data = data.padded(data.batch_size + rows - b, length)
        return _with_side(_padded_rows(self.rows, data, length))

    def context_tokens(self, size: int) -> int:
        """How many tokens each of ``size`` context-parallel ranks holds of this packed micro-batch
        (every sequence padded to a multiple of ``2 * size``)."""
        lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        return int(cp_rank_tokens(cp_padded(lens, size).sum(), size))

    def with_context_tokens(self, size: int, tokens: int = 0, multiple: int = 1) -> "MicroBatch":
        """This packed micro-batch with a pad segment (a sequence of its own) so that each of
        ``size`` context-parallel ranks holds at least ``tokens``, a multiple of ``multiple`` (the
        sequence-parallel split of each rank's tokens), and no more than that needs."""
        have = self.context_tokens(size)
        want = cp_share(have, size, tokens, multiple)
        if want == have:
            return self
        extra = cp_segment(want - have, size)
        return _with_side(_with_pad_segment(self, extra))

    def context_shard(self, size: int, rank: int) -> "MicroBatch":
        """Context-parallel rank ``rank`` of ``size``'s part of this packed micro-batch: every
        sequence (the pad segment too) split by
        :func:`context_split`, and with it, in one place, the
        token ids, their true positions, the labels (taken in the whole layout first, so a chunk's
        last token keeps the next chunk's first as its label), the side inputs and the scored
        positions: this rank scores the valid slots whose scoring position it holds
        (:meth:`scored_index`), every slot on exactly one rank. It keeps every rank's split and the
        whole micro-batch's padded boundaries (``cp_splits``, ``cp_cu_seqlens``, ``cp_max_seqlen``)
        for the attention and RoPE."""
        if not self.packed:
            raise ValueError("context parallelism splits packed micro-batches (actor.pack_sequences: true)")
        seq_lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        splits = [context_split(seq_lens, size, r) for r in range(size)]
        split = splits[rank]
        positions, slots = self.scored_index()
        local = split.locate(positions)
        mine = local >= 0
        side = None if self.side is None else SideInputs(**{
            f.name: (None if getattr(self.side, f.name) is None else split.take(
                getattr(self.side, f.name), fill=False if getattr(self.side, f.name).dtype == torch.bool else -1))
            for f in dataclasses.fields(self.side)})
        padded = split.padded_lens
        return dataclasses.replace(
            self, input_ids=split.take(self.input_ids[0])[None], position_ids=split.positions[None],
            labels=split.take(self.labels), cu_seqlens=split.cu_seqlens,
            max_seqlen=int((split.cu_seqlens[1:] - split.cu_seqlens[:-1]).max()), side=side,
            scored=(local[mine], slots[mine]), per_token=None, row_index=None, cp_splits=splits,
            cp_cu_seqlens=torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(torch.int32),
            cp_max_seqlen=int(padded.max()))

    def context_gather(self, parts: List[torch.Tensor]) -> torch.Tensor:
        """The inverse of :meth:`context_shard` for a per-token field: every CP rank's ``[t_r, ...]``
        (in rank order) back to ``[T, ...]`` in the whole micro-batch's packed layout (its
        sequences' real tokens end to end, the pad segment included)."""
        return self.cp_splits[0].put(parts, self.cp_splits)

    def side_layout(self) -> dict:
        """How this micro-batch lays out per-position fields: the keyword arguments of
        :func:`lay_out_positions` (and of its inverse); for a
        context-parallel shard, those of the whole micro-batch."""
        length = int(self.cp_splits[0].seq_lens.sum()) if self.cp_splits is not None else self.shape[1]
        return dict(packed=self.packed, seq_lens=self.data.seq_lens(), rows=self.shape[0], length=length)


def empty_rows(like: RolloutBatch) -> RolloutBatch:
    """A one-row stand-in (one prompt token, nothing valid, the same optional fields as
    ``like``): it runs through the model and contributes exactly 0 to the loss and gradients."""
    zeros = torch.zeros(1, like.response_len)
    optional = {f: zeros for f in PER_TOKEN_FIELDS[1:] if getattr(like, f) is not None}
    if like.routed_experts is not None:
        optional["routed_experts"] = like.routed_experts.new_full((1, 1) + tuple(like.routed_experts.shape[2:]), -1)
    return RolloutBatch(input_ids=torch.zeros(1, 1, dtype=torch.long), prompt_lens=torch.ones(1, dtype=torch.long),
                        response_mask=zeros, temperature=like.temperature, **optional)


def _slots(data: RolloutBatch):
    """(target position of every response slot within its row [b, R], valid [b, R], seq lens [b])."""
    seq = data.seq_lens()
    target = data.prompt_lens[:, None] + torch.arange(data.response_len)[None]
    valid = (target < seq[:, None]) & (data.response_mask != 0)
    return target, valid, seq


def build_micro_batch(batch: RolloutBatch, rows: Sequence[int], packed: bool,
                      pad_multiple: int = 1) -> MicroBatch:
    """Rows ``rows`` of ``batch`` as one micro-batch (see the module docstring); ``rows=[]``
    gives a dummy that scores nothing."""
    rows = list(rows)
    data = batch.select(rows) if rows else empty_rows(batch)
    if packed:
        return _with_side(_packed(rows, data, pad_multiple))
    length = max(2, int(data.seq_lens().max()))
    length += -length % pad_multiple
    return _with_side(_padded_rows(rows, data, length))


def micro_batches(batch: RolloutBatch, plan: Sequence[Sequence[int]], *, packed: bool, sp: int = 1, cp: int = 1,
                  cp_rank: int = 0, group_max: Optional[Callable[[List[List[int]]], List[List[int]]]] = None,
                  device: Optional[torch.device] = None) -> List[MicroBatch]:
    """This rank's micro-batches of ``batch``, one per entry of ``plan`` (its rows), laid out in one
    call: built (:func:`build_micro_batch`; a multiple of ``sp`` tokens or positions, sequence
    parallelism's split over the TP ranks), with context parallelism (``cp`` > 1) sized for ``cp``
    shares of a multiple of ``sp`` each and cut to rank ``cp_rank``'s
    (:meth:`MicroBatch.context_shard`). ``group_max`` (None: each micro-batch its own shape) makes
    micro-batch ``i`` the same shape on every rank of a group: it is given each micro-batch's local
    ``[rows, length]`` (with CP: ``[one rank's share of tokens]``) and answers the group's maximum of
    each, to which the micro-batch is padded (the caller's collective; a pad segment when packed).
    ``device``: every micro-batch's inputs queued to it (pinned, asynchronous) before any forward."""
    mbs = [build_micro_batch(batch, rows, packed=packed, pad_multiple=1 if cp > 1 else sp) for rows in plan]
    if cp > 1:
        mbs = [mb.with_context_tokens(cp, multiple=sp) for mb in mbs]
        if group_max is not None:
            tokens = group_max([[mb.context_tokens(cp)] for mb in mbs])
            mbs = [mb.with_context_tokens(cp, int(t), sp) for mb, (t,) in zip(mbs, tokens)]
        mbs = [mb.context_shard(cp, cp_rank) for mb in mbs]
    elif group_max is not None:
        shapes = group_max([list(mb.shape) for mb in mbs])
        mbs = [mb.padded_to(int(r), int(s)) for mb, (r, s) in zip(mbs, shapes)]
    return mbs if device is None else [mb.staged(device) for mb in mbs]


def _with_side(mb: MicroBatch) -> MicroBatch:
    """``mb`` with its side inputs laid out for its shape (None without per-position fields)."""
    routed = mb.data.routed_experts
    if routed is None:
        return mb
    layout = mb.side_layout()
    scored = scored_positions(layout["seq_lens"], routed.shape[1])
    return dataclasses.replace(mb, side=SideInputs(
        routed_experts=lay_out_positions(routed, fill=-1, **layout),
        scored=lay_out_positions(scored, fill=False, **layout)))


def _packed(rows: List[int], data: RolloutBatch, pad_multiple: int) -> MicroBatch:
    """The rows laid end to end, with a fixed number of tensor ops whatever the row count."""
    target, valid, seq = _slots(data)
    keep = torch.arange(data.input_ids.shape[1])[None] < seq[:, None]
    ids = data.input_ids[keep]  # row-major: row 0's tokens, then row 1's, ...
    starts = torch.cat([seq.new_zeros(1), seq.cumsum(0)])
    offsets = starts[:-1]
    positions = torch.arange(ids.numel()) - torch.repeat_interleave(offsets, seq, output_size=ids.numel())
    score = torch.where(valid, offsets[:, None] + target - 1, torch.zeros((), dtype=torch.long))
    labels = torch.zeros(ids.numel(), dtype=torch.long)
    labels[score[valid]] = ids[(offsets[:, None] + target)[valid]]
    mb = MicroBatch(rows, data, ids[None], positions[None], labels, score, valid,
                    cu_seqlens=starts.to(torch.int32), max_seqlen=int(seq.max()))
    extra = -ids.numel() % pad_multiple
    return _with_pad_segment(mb, extra) if extra else mb


def _with_pad_segment(mb: MicroBatch, extra: int) -> MicroBatch:
    """``mb`` (packed) with ``extra`` pad tokens appended as a sequence of their own."""
    if extra <= 0:
        return mb
    total = mb.input_ids.shape[1] + extra
    return MicroBatch(
        mb.rows, mb.data,
        torch.nn.functional.pad(mb.input_ids, (0, extra)),
        torch.cat([mb.position_ids, torch.arange(extra)[None]], dim=1),
        torch.nn.functional.pad(mb.labels, (0, extra)),
        mb.score_index, mb.valid,
        cu_seqlens=torch.cat([mb.cu_seqlens, torch.tensor([total], dtype=torch.int32)]),
        max_seqlen=max(mb.max_seqlen, extra))


def _padded_rows(rows: List[int], data: RolloutBatch, length: int) -> MicroBatch:
    target, valid, _ = _slots(data)
    b = data.batch_size
    ids = data.input_ids[:, :length]
    if ids.shape[1] < length:
        ids = torch.nn.functional.pad(ids, (0, length - ids.shape[1]))
    base = (torch.arange(b) * length)[:, None]
    score = torch.where(valid, base + target - 1, torch.zeros((), dtype=torch.long))
    labels = torch.zeros(b * length, dtype=torch.long)
    labels[score[valid]] = ids.reshape(-1)[(base + target)[valid]]
    return MicroBatch(rows, data, ids, torch.arange(length).expand(b, length), labels, score, valid)
