"""The one batch type of a step: what the rollout produced and the actor consumes.

The trainer builds it from the engine's groups (:meth:`RolloutBatch.from_groups`), the actor
scores and trains on it, and every per-token value of the step travels in it -- the engine's
own log-probs included. Pure torch: it imports nothing from megatron or the engines.

Layout of :class:`RolloutBatch` (``B`` sequences, ``L`` padded tokens, ``R`` response slots)::

    input_ids          [B, L] long   prompt tokens, then response tokens, then padding
    prompt_lens        [B]    long   prompt length p_b >= 1 of each row
    response_mask      [B, R]        1 where response slot j of row b is a real (trained) token
    advantages         [B, R] float  per-token advantages                     (train_step only)
    old_log_probs      [B, R] float  log-probs of the old (proximal) policy   (train_step only)
    old_entropy        [B, R] float  entropy of the old policy                (optional)
    ref_log_probs      [B, R] float  log-probs of the reference policy        (optional, KL losses)
    rollout_log_probs  [B, R] float  the engine's log-probs of its sampled tokens (optional:
                                     drift check, rollout correction, ``old_log_prob: rollout``)
    policy_versions    [B, R] long   (optional, partial rollout) the version of the weights that
                                     generated each response token (step ``v`` starts from version
                                     ``v``); 0 in padding
    temperature        float         the sampling temperature: the actor scores under
                                     ``softmax(logits / temperature)``, as the engine sampled
    routed_experts     [B, L, M, k]  (optional, MoE routing replay) for each position of
                       int           ``input_ids`` (prompt included) and each of the model's ``M``
                                     MoE layers, the ``k`` experts the rollout engine routed it to;
                                     -1 where no routing is known (padding, a sequence's last
                                     token, which the engine never ran). The smallest signed
                                     integer dtype that holds the expert ids (the routing contract's
                                     dtype: :class:`megatron_tepo.routing.RoutingShape`)

Response slot ``j`` of row ``b`` is the token ``input_ids[b, p_b + j]``; its log-prob is read from
the model's logits at position ``p_b + j - 1``. Slots past the end of ``input_ids`` or with
``response_mask == 0`` are padding: the actor returns 0 there. Every per-token field is aligned
with ``response_mask``; every per-position field (:data:`PER_POSITION_FIELDS`) with ``input_ids``.
A batch given to the actor is DP-local: each data-parallel rank passes
its own rows, and all TP/PP ranks of one model replica pass the same rows
(:meth:`split_for_data_parallel`, :meth:`select`).

A multi-turn episode's response holds the environment's answers between the model's turns: they
are in ``input_ids`` (the model reads them) with ``response_mask`` 0 (nothing is trained, counted or
normalised over them).

Left out: masks inside the prompt, images.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_tepo.algorithms.advantages import broadcast_to_tokens

PER_TOKEN_FIELDS = ("response_mask", "advantages", "old_log_probs", "old_entropy", "ref_log_probs",
                    "rollout_log_probs", "policy_versions")
#: fields with one entry per position of ``input_ids`` (``[B, L, ...]``); -1 is their "unknown"
PER_POSITION_FIELDS = ("routed_experts",)


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor
    prompt_lens: torch.Tensor
    response_mask: torch.Tensor
    advantages: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    old_entropy: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    policy_versions: Optional[torch.Tensor] = None
    temperature: float = 1.0
    routed_experts: Optional[torch.Tensor] = None

    def __post_init__(self):
        self.validate()

    @classmethod
    def from_groups(cls, prompts: Sequence[Sequence[int]], groups, pad_id: int,
                    advantages: Optional[torch.Tensor] = None, temperature: float = 1.0) -> "RolloutBatch":
        """One row per sample (prompt + response, right-padded), group after group.

        ``groups[g]`` holds the samples of ``prompts[g]``, each with ``token_ids`` and the engine's
        ``log_probs`` (:class:`~megatron_tepo.rollout.engine.Sample`), which become
        ``rollout_log_probs``; ``advantages`` (``[rows]``, one per sample) are broadcast to the
        response tokens. Samples that carry ``versions`` (partial rollout) give
        ``policy_versions``: all of them or none. Samples that carry ``routed_experts`` (``[positions, M, k]`` from
        position 0 of the prompt on) give ``routed_experts``: all of them or none."""
        rows = [(p, s) for p, g in zip(prompts, groups) for s in g]
        if not rows:
            raise ValueError("a batch needs at least one sample")
        resp_len = max(1, max(len(s.token_ids) for _, s in rows))
        width = max(len(p) for p, _ in rows) + resp_len
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), resp_len))
        rollout = torch.zeros((len(rows), resp_len))
        with_versions = [getattr(s, "versions", None) is not None for _, s in rows]
        if any(with_versions) and not all(with_versions):
            raise ValueError(f"policy_versions: sample {with_versions.index(False)} of {len(rows)} carries no "
                             f"versions while others do")
        versions = torch.zeros((len(rows), resp_len), dtype=torch.long) if all(with_versions) else None
        for i, (p, s) in enumerate(rows):
            seq = list(p) + list(s.token_ids)
            ids[i, :len(seq)] = torch.tensor(seq)
            own = getattr(s, "loss_mask", None)  # a multi-turn episode: the environment's tokens are not trained
            mask[i, :len(s.token_ids)] = 1 if own is None else torch.tensor(own, dtype=mask.dtype)
            rollout[i, :len(s.log_probs)] = torch.tensor(s.log_probs, dtype=torch.float32)
            if versions is not None:
                versions[i, :len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
        if advantages is not None:
            advantages = broadcast_to_tokens(advantages, mask)
        return cls(input_ids=ids, prompt_lens=torch.tensor([len(p) for p, _ in rows]), response_mask=mask,
                   advantages=advantages, rollout_log_probs=rollout, policy_versions=versions,
                   temperature=float(temperature),
                   routed_experts=_routing_of(rows, width))

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    def validate(self) -> None:
        """Shape/dtype checks with messages naming the field."""
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got {tuple(self.input_ids.shape)}")
        b = self.input_ids.shape[0]
        if self.prompt_lens.shape != (b,):
            raise ValueError(f"prompt_lens must be [{b}], got {tuple(self.prompt_lens.shape)}")
        if b and int(self.prompt_lens.min()) < 1:
            raise ValueError("every prompt needs at least one token (prompt_lens >= 1)")
        if b and int(self.prompt_lens.max()) > self.input_ids.shape[1]:
            raise ValueError("a prompt_lens entry exceeds input_ids' length")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r}")
        if self.response_mask.dim() != 2 or self.response_mask.shape[0] != b:
            raise ValueError(f"response_mask must be [{b}, R], got {tuple(self.response_mask.shape)}")
        for name in PER_TOKEN_FIELDS[1:]:
            value = getattr(self, name)
            if value is not None and value.shape != self.response_mask.shape:
                raise ValueError(f"{name} must match response_mask's shape "
                                 f"{tuple(self.response_mask.shape)}, got {tuple(value.shape)}")
        re = self.routed_experts
        if re is not None:
            if re.dim() != 4 or tuple(re.shape[:2]) != tuple(self.input_ids.shape):
                raise ValueError(f"routed_experts must be [B, L, moe_layers, topk] with [B, L] = "
                                 f"{tuple(self.input_ids.shape)}, got {tuple(re.shape)}")
            if re.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
                raise ValueError(f"routed_experts must be a signed integer tensor, got {re.dtype}")

    def response_lengths(self) -> torch.Tensor:
        """[B] index of the last real response slot + 1 (0 for an empty response), capped by L."""
        r = self.response_len
        mask = self.response_mask != 0
        last = torch.where(mask, torch.arange(1, r + 1).expand_as(mask), torch.zeros_like(mask, dtype=torch.long))
        length = last.max(dim=1).values if r else torch.zeros(self.batch_size, dtype=torch.long)
        return torch.minimum(length, self.input_ids.shape[1] - self.prompt_lens)

    def seq_lens(self) -> torch.Tensor:
        """[B] tokens the model must see per row: prompt + response up to its last real token."""
        return self.prompt_lens + self.response_lengths()

    def select(self, indices: Sequence[int], max_len: Optional[int] = None) -> "RolloutBatch":
        """Rows ``indices`` (in that order), ``input_ids`` trimmed to ``max_len`` columns."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        fields = {"temperature": self.temperature}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "temperature":
                fields[f.name] = None if value is None else value.index_select(0, idx)
        if max_len is not None:
            fields["input_ids"] = fields["input_ids"][:, :max_len]
            for name in PER_POSITION_FIELDS:
                if fields[name] is not None:
                    fields[name] = fields[name][:, :max_len]
        return RolloutBatch(**fields)

    def padded(self, rows: int, length: int) -> "RolloutBatch":
        """This batch grown to ``rows`` x ``length`` with fully-masked dummy rows / pad columns."""
        extra_rows, extra_cols = rows - self.batch_size, length - self.input_ids.shape[1]
        if extra_rows < 0 or extra_cols < 0:
            raise ValueError(f"cannot pad {self.batch_size}x{self.input_ids.shape[1]} to {rows}x{length}")
        ids = torch.nn.functional.pad(self.input_ids, (0, extra_cols, 0, extra_rows))
        fields = {"input_ids": ids, "temperature": self.temperature,
                  "prompt_lens": torch.cat([self.prompt_lens, self.prompt_lens.new_ones(extra_rows)])}
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            fields[name] = None if value is None else torch.nn.functional.pad(value, (0, 0, 0, extra_rows))
        for name in PER_POSITION_FIELDS:
            value = getattr(self, name)
            if value is not None:
                grown = value.new_full((rows, length) + tuple(value.shape[2:]), -1)
                grown[:self.batch_size, :value.shape[1]] = value
                value = grown
            fields[name] = value
        return RolloutBatch(**fields)

    def split_for_data_parallel(self, dp_rank: int, dp_size: int) -> "RolloutBatch":
        """The rows of data-parallel rank ``dp_rank``: every ``dp_size``-th row from row ``dp_rank``
        (``i % dp_size == dp_rank``; sizes differ by <= 1). Strided, so that a mini-batch of
        ``dp_size * m`` consecutive rows is, on every rank, the same ``m`` consecutive rows of its
        share: the trainer cuts each rank's share into mini-batches, and every rank's k-th one then
        holds rows of the k-th global mini-batch."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        return self.select(range(dp_rank, self.batch_size, dp_size))


def _routing_of(rows, width: int) -> Optional[torch.Tensor]:
    """``routed_experts`` ``[rows, width, M, k]`` from the samples' own (-1 where none), or None
    when no sample carries routing."""
    given = [getattr(s, "routed_experts", None) for _, s in rows]
    if all(g is None for g in given):
        return None
    missing = [i for i, g in enumerate(given) if g is None]
    if missing:
        raise ValueError(f"routed_experts: sample {missing[0]} of {len(rows)} carries none while others do "
                         f"(an engine returns routing for every sample or for none)")
    shapes = {tuple(g.shape[1:]) for g in given}
    if len(shapes) != 1 or any(g.dim() != 3 for g in given):
        raise ValueError(f"routed_experts: every sample's must be [positions, moe_layers, topk] with one "
                         f"(moe_layers, topk), got {sorted(shapes)}")
    dtype = given[0].dtype
    out = torch.full((len(rows), width) + shapes.pop(), -1, dtype=dtype)
    for i, ((p, s), g) in enumerate(zip(rows, given)):
        n = len(p) + len(s.token_ids)
        if g.shape[0] > n:
            raise ValueError(f"routed_experts: sample {i} has routing for {g.shape[0]} positions but only "
                             f"{n} tokens (prompt + response)")
        out[i, :g.shape[0]] = g.to(dtype)
    return out
