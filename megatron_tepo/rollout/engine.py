"""The rollout engine interface: what the trainer needs from anything that generates responses.

Every engine (the in-process :class:`~megatron_tepo.rollout.embedded.EmbeddedEngine`, the SGLang
fleet :class:`~megatron_tepo.rollout.sglang.fleet.SGLangFleet`) takes prompts as token ids and
returns, per prompt, a *group* of ``n`` samples, each with its response token ids, the engine's
log-probability of every sampled token under the distribution it sampled from (``softmax(logits /
temperature)``, after top-p) and why it stopped. Weights arrive as a stream of ``(HF name,
tensor)`` -- the same stream :func:`megatron_tepo.actor.export.export_hf_state` yields. An engine
that can be interrupted (partial rollout) also takes :class:`Request` s one sample each in the
background (:meth:`RolloutEngine.submit`), hands back the finished ones
(:meth:`RolloutEngine.collect`), and cuts every one still running where it stands
(:meth:`RolloutEngine.interrupt`), so that the weights can change and the cut requests continue as
prompt + partial response. In colocated
mode an engine also releases and takes back its device memory (:meth:`RolloutEngine.release_memory`,
:meth:`RolloutEngine.resume_memory`) while the actor uses the same GPUs.

The contract is closed: everything the trainer reads of an engine is declared on
:class:`RolloutEngine`, with a default where an engine has nothing to say -- whether it is
:attr:`~RolloutEngine.interruptible`, the step's and the fleet's metrics
(:meth:`~RolloutEngine.step_metrics`, :meth:`~RolloutEngine.health_metrics`), its sampling RNG's
state for a checkpoint (:meth:`~RolloutEngine.rng_state`, :meth:`~RolloutEngine.set_rng_state`) and
the weight sync it pushes with (:attr:`~RolloutEngine.weight_sync`). The trainer calls them as they
are (no ``getattr`` / ``hasattr`` on an engine outside ``rollout/``); a wrapper (the episode engine)
forwards each by name.

A loss mask has one convention in every carrier of a sample (:class:`Sample`, :class:`Request`, their
saved states): None when every token is the model's, else one entry per token (a state saved with
the earlier ``[]`` of a :class:`Request` reads as None).

A sample's and a request's saved state (a checkpoint's pending rollout or rollout buffer) is one
round trip, :func:`to_state` / :func:`from_state`: every field of the dataclass, read from its
definition, so a field added to :class:`Sample` or :class:`Request` is saved by every place that
saves them.
"""
from __future__ import annotations

import abc
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Type, TypeVar

import torch

from megatron_tepo.buckets import BucketStream

FINISH_STOP = "stop"      # a stop token was sampled (it is the last response token)
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_ABORT = "abort"    # the engine gave up on the request (never returned by a healthy step)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: Sequence[int] = ()

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class Sample:
    """One response: ``len(token_ids) == len(log_probs)``. ``routed_experts`` (an engine asked
    to return routing, for MoE routing replay): ``[positions, moe_layers, topk]`` integer expert
    ids the engine routed each position of prompt + response to, from the prompt's first token
    on; the last response token is never run through the model, so ``positions`` is
    ``len(prompt) + len(token_ids) - 1``. ``loss_mask`` (a multi-turn episode,
    :mod:`megatron_tepo.rollout.episode`): 1 for each token the model generated (trained), 0 for
    each the environment appended (a tool's answer and the chat template's turn boundaries around
    it; their ``log_probs`` are 0); None: every token is the model's."""
    token_ids: List[int]
    log_probs: List[float]
    finish_reason: str
    meta: dict = field(default_factory=dict)
    routed_experts: Optional[torch.Tensor] = None
    # partial rollout: the weights version of each token (None: all the step's rollout version)
    versions: Optional[List[int]] = None
    loss_mask: Optional[List[int]] = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.log_probs)} log-probs")
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.versions)} versions")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.loss_mask)} loss-mask entries")
        if self.routed_experts is not None and self.routed_experts.dim() != 3:
            raise ValueError(f"routed_experts must be [positions, moe_layers, topk], got "
                             f"{tuple(self.routed_experts.shape)}")


Group = List[Sample]  # the n samples of one prompt

_T = TypeVar("_T")


def to_state(obj) -> Dict:
    """A :class:`Sample`'s or :class:`Request`'s saved state: every field of its dataclass, by
    name, deep-copied (tensors stay tensors: ``torch.save`` / ``torch.load(weights_only=True)``
    keep them). The one way samples are checkpointed (the pending one-step-off rollout, the
    partial-rollout buffer): a new field is saved without a change here."""
    return {f.name: copy.deepcopy(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def from_state(cls: Type[_T], state: Dict, where: str = "the saved state") -> _T:
    """:func:`to_state` read back into ``cls``. A missing or unknown field is a ValueError naming
    it and ``where`` (written by another version of this code: resume from another checkpoint)."""
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing, unknown = sorted(required - set(state)), sorted(set(state) - names)
    if missing or unknown:
        raise ValueError(f"{where}: a saved {cls.__name__} " +
                         (f"lacks {missing}" if missing else f"has fields this version does not know: {unknown}"))
    return cls(**state)

#: what an engine can release and take back (colocated mode), under SGLang's tags: its weights
#: (their content is lost until the next weight update), its KV cache, its CUDA graphs
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass
class Request:
    """One sample being generated, resumable (partial rollout, :meth:`RolloutEngine.submit`): its
    prompt, its budget of response tokens, and the response so far -- each token with the
    engine's log-prob and the version of the weights that produced it. An interrupted request
    is submitted again as it is: the engine continues from ``prompt + token_ids`` for the
    tokens left. ``key`` is the caller's (which group and sample it is)."""
    prompt: List[int]
    max_new_tokens: int
    key: object = None
    token_ids: List[int] = field(default_factory=list)
    log_probs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    interrupted: int = 0  # times a weight update cut it
    # a multi-turn episode: 1 / 0 per token (the model's / the environment's; None: every token the
    # model's, as in a Sample) and its counts so far (turns, tool calls, ...: rollout/episode.py),
    # which survive an interrupt
    loss_mask: Optional[List[int]] = None
    episode: Dict = field(default_factory=dict)

    def __post_init__(self):
        if self.loss_mask is not None and len(self.loss_mask) != len(self.token_ids):
            if self.loss_mask:
                raise ValueError(f"{len(self.token_ids)} tokens but {len(self.loss_mask)} loss-mask entries")
            self.loss_mask = None  # (a state saved before None was the one way to say "all the model's": [])

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    def extend(self, segment: "Sample", version: int) -> None:
        """Append what the engine generated under weights ``version`` since the last submit (an
        episode's segment: its turns and the environment's answers, with their loss mask and counts)."""
        if segment.loss_mask is not None or self.loss_mask is not None:
            self.loss_mask = (self.loss_mask if self.loss_mask is not None else [1] * len(self.token_ids)) + \
                (list(segment.loss_mask) if segment.loss_mask is not None else [1] * len(segment.token_ids))
        self.token_ids += segment.token_ids
        self.log_probs += segment.log_probs
        self.versions += [version] * len(segment.token_ids)
        for k, v in segment.meta.get("episode", {}).items():
            self.episode[k] = self.episode.get(k, 0) + v if isinstance(v, (int, float)) else v

    def restart(self) -> None:
        """Drop the response so far (it is older than the staleness bound allows); an episode's data
        row stays (its environment opens it again)."""
        row = {"row": self.episode["row"]} if "row" in self.episode else {}
        self.token_ids, self.log_probs, self.versions, self.loss_mask, self.episode = [], [], [], None, row

    def to_sample(self, finish_reason: str) -> "Sample":
        """The response so far as a :class:`Sample` (with its versions, and an episode's loss mask
        and counts)."""
        return Sample(list(self.token_ids), list(self.log_probs), finish_reason, versions=list(self.versions),
                      loss_mask=list(self.loss_mask) if self.loss_mask is not None else None,
                      meta={"episode": dict(self.episode)} if self.episode else {})


class RolloutEngine(abc.ABC):
    """Generates groups of responses and accepts new weights in Hugging Face layout."""

    @abc.abstractmethod
    def generate(self, prompts: List[List[int]], n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 128,
                 stop_token_ids: Sequence[int] = ()) -> List[Group]:
        """One group of ``n`` samples per prompt, in prompt order."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load full tensors with HF names (every parameter of the model, or a subset); the new
        weights are in effect when it returns (cached prefixes of the old ones are dropped: the
        update flushes, the caller does not). ``named_tensors`` may be the actor's export, which
        is collective: read it with :func:`gathered_tensors`, or hand it to a weight sync."""

    # ---------------------------------------------------------------- interruptible generation
    #: whether :meth:`submit`, :meth:`collect` and :meth:`interrupt` work (partial rollout)
    interruptible: bool = False

    #: whether :meth:`generate` takes ``rows=`` (each prompt's data row) and :meth:`submit` reads a
    #: request's ``episode["row"]``: an engine whose episodes open from their rows (multi-turn)
    takes_rows: bool = False

    #: what :meth:`update_weights` pushes the weights with, where the engine has one (the SGLang
    #: fleet's :class:`~megatron_tepo.rollout.sglang.weight_sync.WeightSync`, a follower rank's);
    #: None: the engine loads the tensors itself
    weight_sync = None

    def submit(self, requests: Sequence[Request], params: SamplingParams) -> None:
        """Start generating each request's continuation (from ``prompt + token_ids``, for its
        ``remaining`` tokens) in the background, one sample each (``params.n`` is ignored);
        returns at once. Each comes back once, from :meth:`collect` or :meth:`interrupt`."""
        raise NotImplementedError(f"{type(self).__name__} cannot be interrupted (rollout.partial_rollout)")

    def collect(self, timeout: float = 0.0) -> List[Tuple[Request, "Sample"]]:
        """The submitted requests that finished since the last call, each with the segment
        generated since its submit (``finish_reason`` stop or length); waits up to ``timeout``
        seconds for at least one. The request itself is not changed."""
        raise NotImplementedError(f"{type(self).__name__} cannot be interrupted (rollout.partial_rollout)")

    def interrupt(self) -> List[Tuple[Request, "Sample"]]:
        """Stop every submitted request and return each one not yet collected with its segment:
        finished ones as :meth:`collect` would, the others cut where they stand
        (``finish_reason`` abort, every generated token with its log-prob). When it returns
        nothing runs: the weights may be written."""
        raise NotImplementedError(f"{type(self).__name__} cannot be interrupted (rollout.partial_rollout)")

    def score(self, sequences: List[List[int]], prompt_lens: List[int],
              temperature: float = 1.0) -> List[List[float]]:
        """Log-probs of the given response tokens (``seq[prompt_len:]``) under ``logits / T``.

        Used by the drift check; optional for an engine."""
        raise NotImplementedError(f"{type(self).__name__} cannot score fixed tokens")

    def flush_cache(self) -> None:
        """Drop cached KV / prefixes (after a weight update they are stale)."""

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Colocated mode: free the device memory of ``tags`` (of :data:`MEMORY_TAGS`), returning
        once it is free for another process. Released weights lose their content: after
        :meth:`resume_memory` of ``weights`` the engine generates nothing until a weight update
        has ended. Releasing what is released already changes nothing."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory (rollout.colocated)")

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Colocated mode: take back the memory of ``tags`` released by :meth:`release_memory`
        (taking back what is held changes nothing)."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory (rollout.colocated)")

    def step_metrics(self, prompts: List[List[int]], groups: List[Group]) -> Dict[str, float]:
        """What the engine says of a step's kept groups beyond the sampling's own counts (a multi-turn
        engine: turns, tool calls, tokens by source, the template comparator). None here."""
        return {}

    def health_metrics(self) -> Dict[str, float]:
        """What the engine survived since the last call (servers that died, restarted, were
        re-synced ...), for the step metrics; each event in exactly one call. None here."""
        return {}

    def rng_state(self) -> Optional[torch.Tensor]:
        """The state of the RNG the engine samples with, for a checkpoint (a resumed run then samples
        exactly as the run would have); None: the engine has none it can save (a server samples with
        its own)."""
        return None

    def set_rng_state(self, state: torch.Tensor) -> None:
        """:meth:`rng_state` of a checkpoint, read back (nothing here: an engine without one)."""

    def close(self) -> None:
        """Free the engine's resources; the engine is unusable afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def gathered_tensors(named_tensors: Iterable[Tuple[str, torch.Tensor]], dst: int = 0
                     ) -> Iterable[Tuple[str, torch.Tensor]]:
    """A weight update's ``(HF name, full tensor)`` stream as one consumer on global rank ``dst``
    reads it. A :class:`~megatron_tepo.buckets.BucketStream` (the actor's export) is read as
    buckets gathered to ``dst``, so every pipeline stage's tensors reach it; on the other ranks it
    yields nothing but must still be iterated to the end (collective). Any other iterable as it is."""
    if isinstance(named_tensors, BucketStream):
        return (nt for bucket in named_tensors.flat_buckets(dst=dst) for nt in bucket.named_tensors())
    return named_tensors


def make_params(n, temperature, top_p, max_new_tokens, stop_token_ids) -> SamplingParams:
    return SamplingParams(n=n, temperature=temperature, top_p=top_p,
                          max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)


def validate_prompts(prompts: List[List[int]], vocab_size: Optional[int] = None) -> None:
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a list of token-id lists")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
