"""One micro-batch as the model sees it: packed (THD) or padded rows, and where each response
slot is scored. Pure torch; the actor turns it into megatron's inputs.

:func:`build_micro_batch` takes rows of a :class:`~megatron_tepo.batch.RolloutBatch`:

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

Per-position fields of the rows (``routed_experts``: :data:`~megatron_tepo.batch.PER_POSITION_FIELDS`)
become the micro-batch's :class:`~megatron_tepo.megatron.side_inputs.SideInputs` (``side``), laid
out in megatron's token order for this micro-batch's final shape (pad segments and dummy rows
included) by :func:`~megatron_tepo.megatron.side_inputs.lay_out_positions`; without them ``side``
is None and nothing else is built.

Context parallelism: :meth:`MicroBatch.context_shard` cuts a packed micro-batch for one CP rank
(:func:`~megatron_tepo.megatron.side_inputs.context_split`): everything per token in one place,
the labels and scored positions taken in the whole layout first; :meth:`MicroBatch.with_context_tokens`
pads it first where each rank's share must be a multiple of the sequence-parallel split or match
another rank's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from megatron_tepo.batch import PER_TOKEN_FIELDS, RolloutBatch
from megatron_tepo.megatron.side_inputs import SideInputs, context_split, lay_out_positions, scored_positions

__all__ = ["MicroBatch", "build_micro_batch", "empty_rows"]


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
        return int(((lens + 2 * size - 1) // (2 * size) * (2 * size)).sum()) // size

    def with_context_tokens(self, size: int, tokens: int = 0, multiple: int = 1) -> "MicroBatch":
        """This packed micro-batch with a pad segment (a sequence of its own) so that each of
        ``size`` context-parallel ranks holds at least ``tokens``, a multiple of ``multiple`` (the
        sequence-parallel split of each rank's tokens), and no more than that needs."""
        have = self.context_tokens(size)
        want = max(have, tokens)
        while want % multiple or (want - have) % 2:
            want += 1
        if want == have:
            return self
        extra = (want - have) // 2 * 2 * size  # a segment of 2 * size * k tokens: k per chunk, 2k per rank
        return _with_side(_with_pad_segment(self, extra))

    def context_shard(self, size: int, rank: int) -> "MicroBatch":
        """Context-parallel rank ``rank`` of ``size``'s part of this packed micro-batch: every
        sequence (the pad segment too) split by
        :func:`~megatron_tepo.megatron.side_inputs.context_split`, and with it, in one place, the
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
        :func:`~megatron_tepo.megatron.side_inputs.lay_out_positions` (and of its inverse); for a
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
