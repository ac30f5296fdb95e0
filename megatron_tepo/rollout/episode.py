"""Multi-turn episodes: a rollout in which the model's turns and an environment's answers alternate
(docs/ROLLOUT.md, "Multi-turn episodes").

:class:`EpisodeEngine` wraps any interruptible engine (the embedded one, the SGLang fleet) and is
itself an engine: ``generate`` returns groups whose samples are whole episodes, and ``submit`` /
``collect`` / ``interrupt`` take and give back whole episodes, so every schedule (synchronous, one
step off, partial rollout) runs episodes without knowing it. An episode:

1. **A turn**, token in, token out: the engine is sent the episode's accumulated ids (the prompt,
   every earlier turn, every answer) and generates until the model's own stop token (the turn's
   last token, as the engine returned it), the turn's cap (``max_turn_tokens``) or the episode's
   token budget (``max_new_tokens`` counts every token after the prompt). Exactly the ids it returns
   are appended, each with its log-prob and loss mask 1.
2. **The environment's answer** (:class:`~megatron_tepo.environments.Environment`): the turn's text
   (its ids decoded, the stop token left out) goes to ``respond`` in a bounded pool of threads
   (``tool_workers``), so the engine generates other episodes' turns while a tool runs. ``done``: the
   episode ends (finish ``stop``); else the message is appended as the ids of the chat template's
   tool turn for that model (after the stop token the template ends a turn with, which the
   environment writes when the turn was cut at its cap) (:class:`TurnFormat`: the boundary after the model's stop token, the
   message, the next turn's generation prompt), with loss mask 0 and log-prob 0: never by
   re-tokenising the conversation. An answer that does not fit the budget, or a turn past
   ``max_turns``, ends the episode (finish ``length``).

**State per episode** (:class:`~megatron_tepo.environments.Environment`'s ``start`` / ``step`` /
``finish``): an episode is opened from its data row (``Request.episode["row"]``, put there by the
caller: :meth:`EpisodeEngine.generate`'s ``rows``, the rollout buffer) when first submitted; its
state, the environment's rewards per turn and for the episode ride in ``Request.episode["env"]``
(the whole record, replaced at each segment), so an interrupt, a resume and a checkpoint carry it.
Every episode ends with a reason (``Request.episode["end"]``: :data:`END_REASONS`), counted in the
metrics.

A sample of an episode carries ``loss_mask`` and, in ``meta["episode"]``, its counts (``turns``,
``tool_calls``, ``tool_errors``, ``tool_timeouts``, ``tool_seconds``, ``env_tokens``) and the
environment's messages (``messages``, for :func:`compare_with_template`); a request's counts ride in
``Request.episode`` across interrupts. :func:`episode_metrics` turns a step's samples into its
metrics, :func:`final_turn` gives the reward the final answer.

An interrupt (a weight update with partial rollout) cuts the turns in flight where they stand and
waits for the tool calls under way (at most their wall-time limit), so that every episode comes back
at a clean point: mid-turn (resumed from its ids under the new weights) or ready for its next turn.
A turn cut mid-way and resumed is one turn: the environment reads both halves as one text, once,
and the turn's cap (``max_turn_tokens``) counts both (:func:`current_turn`).

**MoE routing** (``actor.routing_replay: r3``: the wrapped engine returns each request's
``routed_experts``, from its input's first token on): a turn's request is the whole episode so far
(the prompt, every earlier turn, every answer), so the routing the engine returns for the final turn
-- its prefill of the prefix, the environment's answers and earlier turns included, then its decode --
is the routing of the whole sequence. The episode keeps the latest turn's (the earlier ones are
dropped) and its sample carries it exactly as a one-turn sample does (``[prompt + response - 1,
moe_layers, topk]``), while it covers the whole response: an episode ends after a model turn, and
one given back by an interrupt, mid-way, carries none (partial rollout with r3 is refused in the
config: an interrupted request's routing is not returned). An engine with a prefix cache (SGLang's
radix cache) returns, for the prefix it kept, the routing it recorded when those tokens were computed
(SGLang keeps it per KV slot).

Left out: images, an environment that rewrites earlier turns (the ids only grow).
"""
from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_tepo.environments.base import Environment, Reply
from megatron_tepo.rollout.engine import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, MEMORY_TAGS, Group, Request,
                                          RolloutEngine, Sample, SamplingParams, make_params)
from megatron_tepo.rollout.template_check import compare_with_template

__all__ = ["EpisodeEngine", "EpisodeLimits", "TurnFormat", "episode_metrics", "final_turn", "current_turn",
           "compare_with_template", "COUNTS", "with_environment", "END_REASONS", "environment_reward", "prompt_messages"]

#: an episode's counts (``Sample.meta["episode"]``, ``Request.episode``)
COUNTS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_seconds", "env_tokens", "tool_sandbox_failures",
          "tool_calls_capped")

#: why an episode ended (``Sample.meta["episode"]["end"]``): a turn the environment took as the final
#: answer; a turn cut at ``max_turn_tokens`` that called nothing; a call on the last of ``max_turns``;
#: the token budget spent; the environment's error; the sandbox's failure (not the model's doing)
END_REASONS = ("answered", "turn_cap", "max_turns", "budget", "error", "sandbox_failure")


@dataclass(frozen=True)
class EpisodeLimits:
    """An episode's limits: model turns, a turn's tokens (None: the episode's budget), and the tool
    calls that run at once."""
    max_turns: int = 4
    max_turn_tokens: Optional[int] = None
    tool_workers: int = 8
    on_sandbox_failure: str = "drop_group"  # or "fail": the step fails, naming the sandbox's failure


class TurnFormat:
    """The ids of the environment's answer in a model's chat template: what the template writes after
    an assistant turn's stop token, the tool message, and the next assistant turn's generation prompt
    (Qwen3, ChatML: ``\\n<|im_start|>user\\n<tool_response>\\n{message}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n``). Read from the tokenizer's own template by rendering a conversation with
    a probe message once; the message is tokenized alone (its text never turns into special tokens),
    the boundaries around it as the template writes them. ``stop_token_id``: the token that ends the
    model's turns (the template's end of an assistant message)."""

    _PROBE = "\u2063MTEPO-TOOL-MESSAGE\u2063"
    _TURN = "\u2063MTEPO-ASSISTANT-TURN\u2063"

    def __init__(self, tokenizer, stop_token_id: int, role: str = "tool", template_kwargs: Optional[Dict] = None):
        self.tokenizer, self.stop_token_id, self.role = tokenizer, int(stop_token_id), role
        self.template_kwargs = dict(template_kwargs or {})  # (the prompts' own: data.tools, data.chat_template_kwargs)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"environment: the tokenizer has no chat template to put the tool's answer in "
                             f"(tokenizer_config.json's chat_template)")
        stop_text = tokenizer.decode([self.stop_token_id])
        conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self._TURN},
                {"role": role, "content": self._PROBE}]
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
        after = text.split(self._TURN, 1)[1]
        end = after.find(stop_text)
        if end < 0 or self._PROBE not in after:
            raise ValueError(f"environment: the chat template does not end an assistant turn with the stop token "
                             f"{stop_text!r} followed by a {role!r} message: the tool's answer has no place in it")
        self.before, self.after = after[end + len(stop_text):].split(self._PROBE, 1)
        self._before_ids = self._encode(self.before)
        self._after_ids = self._encode(self.after)

    def _encode(self, text: str, plain: bool = False) -> List[int]:
        kw = {"split_special_tokens": True} if plain else {}
        try:
            return list(self.tokenizer(text, add_special_tokens=False, **kw)["input_ids"])
        except TypeError:  # (a tokenizer without split_special_tokens)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def answer_ids(self, message: str) -> List[int]:
        """The ids appended for the environment's ``message`` (after the model's stop token)."""
        return self._before_ids + self._encode(message, plain=True) + self._after_ids

    def turn_text(self, ids: Sequence[int]) -> str:
        """A model turn's text as the environment reads it: its ids decoded, the stop token that
        ended it left out."""
        ids = list(ids)
        if ids and ids[-1] == self.stop_token_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class _Episode:
    """One episode in the engine's hands: the caller's request and what was generated since it was
    submitted (tokens, log-probs, loss mask), its counts, where it stands."""
    req: Request
    tokens: List[int] = field(default_factory=list)
    log_probs: List[float] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    counts: Dict = field(default_factory=dict)
    turn_start: int = 0  # where the current turn's tokens start in ``tokens``
    tool: Optional[Future] = None
    # a request submitted again mid-turn (cut by an interrupt): the ids of its current turn generated
    # before, which the turn's text and its cap count with the rest (empty once that turn ended)
    carried: List[int] = field(default_factory=list)
    # the environment's record of the episode: its state (what survives a checkpoint), rewards per turn
    # and for the episode; None until opened (Environment.start)
    env: Optional[Dict] = None
    capped: bool = False  # the last turn was cut at max_turn_tokens
    # r3: the routing the engine returned for the latest turn's request (the whole sequence up to it)
    routing: Optional[torch.Tensor] = None

    def __post_init__(self):
        self.carried = current_turn(self.req.token_ids, self.req.loss_mask)
        if isinstance(self.req.episode.get("env"), dict):
            self.env = copy.deepcopy(self.req.episode["env"])

    def turn_ids(self) -> List[int]:
        """The current turn's ids: the part generated before a resubmit and the rest."""
        return self.carried + self.tokens[self.turn_start:]

    @property
    def budget(self) -> int:
        return self.req.remaining - len(self.tokens)

    def turns(self) -> int:
        return int(self.req.episode.get("turns", 0)) + int(self.counts.get("turns", 0))

    def add(self, ids, lps, model: bool) -> None:
        self.tokens += list(ids)
        self.log_probs += list(lps) if model else [0.0] * len(ids)
        self.mask += [1 if model else 0] * len(ids)

    def count(self, **kw) -> None:
        for k, v in kw.items():
            self.counts[k] = self.counts.get(k, 0) + v

    def sample(self, reason: str, end: Optional[str] = None) -> Sample:
        record = dict(self.counts)
        if self.env is not None:
            record["env"] = copy.deepcopy(self.env)
        if end is not None:
            record["end"] = end
        return Sample(list(self.tokens), list(self.log_probs), reason, loss_mask=list(self.mask),
                      meta={"episode": record}, routed_experts=self.whole_routing())

    def whole_routing(self) -> Optional[torch.Tensor]:
        """The latest turn's routing when it covers every position of the sequence but the last
        (prompt, response so far: the episode ended with that turn), as a one-turn sample carries it;
        else None (an episode cut mid-way, or an environment's answer after its latest turn)."""
        if self.routing is None:
            return None
        positions = len(self.req.prompt) + len(self.req.token_ids) + len(self.tokens) - 1
        return self.routing if self.routing.shape[0] == positions else None


class EpisodeEngine(RolloutEngine):
    """``engine`` running episodes with ``env`` (see the module docstring); ``fmt`` puts the
    environment's answers into the model's chat template. The wrapped engine must be interruptible
    (``submit`` / ``collect`` / ``interrupt``): each turn is one request. What the trainer reads of
    an engine beyond the episodes (its weight update and weight sync, memory, scoring, metrics, the
    sampling RNG's state) is forwarded to the wrapped engine method by method, as
    :class:`~megatron_tepo.rollout.engine.RolloutEngine` declares it."""

    interruptible = True

    def __init__(self, engine, env: Environment, fmt: TurnFormat, limits: EpisodeLimits = EpisodeLimits()):
        if not getattr(engine, "interruptible", False):
            raise ValueError(f"environment: the engine {type(engine).__name__} cannot run a turn at a time "
                             f"(submit / collect); multi-turn episodes need it")
        self.engine, self.env, self.fmt, self.limits = engine, env, fmt, limits
        self._pool = ThreadPoolExecutor(max_workers=limits.tool_workers, thread_name_prefix="mtepo-tool")
        self._lock = threading.Lock()
        self._episodes: Dict[int, _Episode] = {}  # id(episode) -> episode, while the engine or a tool has it
        self._ready: List[Tuple[Request, Sample]] = []
        self._params: Optional[SamplingParams] = None

    # ------------------------------------------------------------------ what the wrapped engine does
    # (each part of the engine contract forwarded by name: there is no catch-all)
    @property
    def weight_sync(self):  # what its weight update pushes with (a fleet's)
        return self.engine.weight_sync

    def rng_state(self) -> Optional[torch.Tensor]:
        return self.engine.rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.engine.set_rng_state(state)

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named_tensors)

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self.engine.release_memory(tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self.engine.resume_memory(tags)

    def score(self, sequences, prompt_lens, temperature: float = 1.0):
        return self.engine.score(sequences, prompt_lens, temperature)

    def health_metrics(self) -> Dict[str, float]:
        return self.engine.health_metrics()

    def step_metrics(self, prompts: List[List[int]], groups: List[Group]) -> Dict[str, float]:
        """A step's episodes (:func:`episode_metrics`) and how their ids compare with the chat template's
        rendering (:func:`compare_with_template`): ``template_<kind>_rate`` for each kind, the error
        rate the mismatch that is not the template's by design."""
        samples = [s for g in groups for s in g]
        out = episode_metrics(samples)
        if not samples:
            return out
        kinds = [compare_with_template(self.fmt.tokenizer, p, s, self.fmt.stop_token_id, self.fmt.template_kwargs)
                 for p, g in zip(prompts, groups) for s in g]
        for kind in ("equal", "retokenized", "thinking", "error"):
            out[f"template_{kind}_rate"] = kinds.count(kind) / len(kinds)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.env.close()
        self.engine.close()

    # ------------------------------------------------------------------ episodes
    #: ``generate`` takes the data rows its episodes open from (``rows``); the trainer passes them
    takes_rows = True

    def generate(self, prompts: List[List[int]], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 128, stop_token_ids: Sequence[int] = (),
                 rows: Optional[Sequence[Dict]] = None) -> List[Group]:
        """``n`` episodes per prompt, run to their ends; one group per prompt, in prompt order.
        ``rows``: each prompt's data row (the environment opens its episodes from it)."""
        sp = make_params(n, temperature, top_p, max_new_tokens, stop_token_ids)
        reqs = [Request(list(p), sp.max_new_tokens, key=(i, k), episode={"row": rows[i]} if rows is not None else {})
                for i, p in enumerate(prompts) for k in range(sp.n)]
        self.submit(reqs, SamplingParams(1, sp.temperature, sp.top_p, sp.max_new_tokens, sp.stop_token_ids))
        done: Dict[tuple, Sample] = {}
        while len(done) < len(reqs):
            for r, s in self.collect(timeout=0.5):
                if s.meta.get("error"):
                    self.interrupt()
                    raise RuntimeError(f"episode {r.key}: {s.meta['error']}")
                done[r.key] = s
        return [[done[(i, k)] for k in range(sp.n)] for i in range(len(prompts))]

    def submit(self, requests: Sequence[Request], params: SamplingParams) -> None:
        """Each request's episode goes on from ``prompt + token_ids`` (a resumed one at its next turn,
        or mid-turn) with its budget of ``remaining`` tokens; each comes back once, whole, from
        :meth:`collect` or :meth:`interrupt`."""
        self._params = params
        eps = [_Episode(r) for r in requests]
        with self._lock:
            for ep in eps:
                self._episodes[id(ep)] = ep
        self._turns([ep for ep in eps if self._open(ep)])

    def _open(self, ep: _Episode) -> bool:
        """A new episode opened by the environment from its row (``Environment.start``); False when
        that failed (the episode comes back with the error)."""
        if ep.env is not None:
            return True
        row = ep.req.episode.get("row") or {}
        try:
            state = self.env.start(dict(row), prompt_messages(row))
        except Exception as exc:  # noqa: BLE001 -- named in the episode's error
            self._fail(ep, exc)
            return False
        ep.env = {"state": state if state is not None else {}}
        return True

    def _fail(self, ep: _Episode, exc: BaseException) -> None:
        with self._lock:
            self._episodes.pop(id(ep), None)
            self._ready.append((ep.req, Sample([], [], FINISH_ABORT, meta={
                "error": f"environment {self.env.name}: {type(exc).__name__}: {exc}", "episode": {"end": "error"}})))

    def collect(self, timeout: float = 0.0) -> List[Tuple[Request, Sample]]:
        """The episodes that ended since the last call, each with everything generated since its
        submit; waits up to ``timeout`` seconds for one (taking the engine's finished turns and the
        tools' answers meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            self._turns_ended(self.engine.collect(timeout=min(0.05, max(left, 0.0))))
            self._answers(submit=True)
            with self._lock:
                if self._ready or time.monotonic() >= deadline:
                    out, self._ready = self._ready, []
                    return out

    def interrupt(self) -> List[Tuple[Request, Sample]]:
        """Every episode not yet collected comes back: ended ones as :meth:`collect` gives them, the
        others at a clean point (``FINISH_ABORT``): a turn cut where it stood, or a tool's answer
        appended (the tool calls under way are waited for). When it returns nothing runs."""
        self._turns_ended(self.engine.interrupt(), cut=True)
        for ep in list(self._episodes.values()):
            if ep.tool is not None:
                ep.tool.result()  # (bounded by the tool's own wall-time limit)
        self._answers(submit=False)
        with self._lock:
            out = self._ready + [(ep.req, ep.sample(FINISH_ABORT)) for ep in self._episodes.values()]
            self._ready, self._episodes = [], {}
        return out

    # ------------------------------------------------------------------ one episode's steps
    def _turns(self, eps: List[_Episode]) -> None:
        """Each episode's next turn to the engine (or its end, when no budget is left)."""
        todo = []
        for ep in eps:
            ep.turn_start = len(ep.tokens)
            left = None if self.limits.max_turn_tokens is None else self.limits.max_turn_tokens - len(ep.carried)
            if ep.budget >= 1 and left is not None and left < 1:
                self._turn_ended(ep, FINISH_LENGTH)  # a turn cut exactly at its cap: it ended there
                continue
            cap = ep.budget if left is None else min(ep.budget, left)
            if cap < 1:
                self._end(ep, FINISH_LENGTH, "budget")
                continue
            todo.append(Request(ep.req.prompt + ep.req.token_ids + ep.tokens, cap, key=id(ep)))
        if todo:
            self.engine.submit(todo, self._params)

    def _turns_ended(self, finished: List[Tuple[Request, Sample]], cut: bool = False) -> None:
        """The engine's finished (or, ``cut``, interrupted) turns: their ids appended; an ended turn
        goes to the environment."""
        stop = set(self._params.stop_token_ids) if self._params is not None else set()
        for turn, seg in finished:
            ep = self._episodes.get(turn.key)
            if ep is None:
                continue
            if seg.meta.get("error"):
                with self._lock:
                    del self._episodes[turn.key]
                    self._ready.append((ep.req, Sample([], [], FINISH_ABORT, meta=dict(seg.meta))))
                continue
            ep.add(seg.token_ids, seg.log_probs, model=True)
            if seg.routed_experts is not None:  # r3: the whole sequence's, up to this turn (module docstring)
                ep.routing = seg.routed_experts
            reason = seg.finish_reason
            if reason == FINISH_ABORT and seg.token_ids and seg.token_ids[-1] in stop:
                reason = FINISH_STOP  # (cut as it ended)
            if reason == FINISH_ABORT:
                continue  # cut mid-turn: resumed from its ids
            self._turn_ended(ep, reason)

    def _turn_ended(self, ep: _Episode, reason: str) -> None:
        """A model turn ended (stop, or its cap / the budget: ``length``): the whole turn -- both
        halves of one cut by an interrupt -- goes to the environment, or the episode ends."""
        turn = ep.turn_ids()
        capped = reason == FINISH_LENGTH and len(turn) >= (self.limits.max_turn_tokens or 0)
        if reason == FINISH_LENGTH and not (capped and ep.budget > 0):
            self._end(ep, FINISH_LENGTH, "budget")  # the episode's budget is spent
            return
        ep.count(turns=1)
        ep.carried, ep.capped = [], capped
        ep.tool = self._pool.submit(self.env.step, ep.env["state"], self.fmt.turn_text(turn), ep.turns() - 1)

    def _answers(self, submit: bool) -> None:
        """The environment's answers that are in: appended (or the episode ended); with ``submit``, the
        next turns go to the engine."""
        nexts = []
        for ep in list(self._episodes.values()):
            if ep.tool is None or not ep.tool.done():
                continue
            future, ep.tool = ep.tool, None
            try:
                reply: Reply = future.result()
            except Exception as exc:  # noqa: BLE001 -- a failing environment fails its episode, named
                self._finish(ep)
                self._fail(ep, exc)
                continue
            ep.count(tool_calls=reply.tool_calls, tool_errors=reply.tool_errors, tool_timeouts=reply.tool_timeouts,
                     tool_seconds=reply.tool_seconds, tool_sandbox_failures=reply.sandbox_failures,
                     tool_calls_capped=reply.capped_calls)
            if reply.reward is not None:
                ep.env.setdefault("turn_rewards", []).append(float(reply.reward))
            if reply.episode_reward is not None:
                ep.env["reward"] = float(reply.episode_reward)
            if reply.sandbox_failures:  # never the model's doing: not trained on, or the step fails
                if self.limits.on_sandbox_failure == "fail":
                    self._finish(ep)
                    self._fail(ep, RuntimeError(f"the sandbox failed ({reply.sandbox_failures} call(s)) and "
                                                f"environment.on_sandbox_failure is 'fail': {reply.message[:200]}"))
                else:
                    self._end(ep, FINISH_STOP, "sandbox_failure")
                continue
            if reply.done:
                self._end(ep, FINISH_STOP, "turn_cap" if ep.capped else "answered")
                continue
            ids = self.fmt.answer_ids(reply.message)
            if ep.tokens[-1:] != [self.fmt.stop_token_id]:  # a turn cut at its cap: closed for the model
                ids = [self.fmt.stop_token_id] + ids
            if len(ids) >= ep.budget or ep.turns() >= self.limits.max_turns:
                # no room for the answer and a turn after it, or no turn left
                self._end(ep, FINISH_LENGTH, "max_turns" if ep.turns() >= self.limits.max_turns else "budget")
                continue
            ep.add(ids, [], model=False)
            ep.count(env_tokens=len(ids))
            ep.counts.setdefault("messages", []).append(reply.message)
            nexts.append(ep)
        if submit:
            self._turns(nexts)

    def _end(self, ep: _Episode, reason: str, why: str) -> None:
        """The episode ended (``why``: :data:`END_REASONS`): the environment frees it and may give
        its reward."""
        try:
            self._finish(ep, raise_=True)
        except Exception as exc:  # noqa: BLE001 -- named in the episode's error
            self._fail(ep, exc)
            return
        with self._lock:
            self._episodes.pop(id(ep), None)
            self._ready.append((ep.req, ep.sample(reason, why)))

    def _finish(self, ep: _Episode, raise_: bool = False) -> None:
        """``Environment.finish`` of an opened episode; a number it returns is the episode's reward."""
        if ep.env is None:
            return
        try:
            reward = self.env.finish(ep.env["state"])
        except Exception:
            if raise_:
                raise
            return
        if reward is not None:
            ep.env["reward"] = float(reward)


# ---------------------------------------------------------------------- what a step reads of episodes
def current_turn(token_ids: Sequence[int], loss_mask: Optional[Sequence[int]]) -> List[int]:
    """The ids of a response's unfinished model turn: those after the environment's last answer
    when the response ends with the model's ids (an episode cut mid-turn); empty when it is empty
    or ends with an answer (ready for its next turn). ``loss_mask`` None: every id is the model's."""
    if not token_ids or (loss_mask and not loss_mask[-1]):
        return []
    last_env = max((i for i, m in enumerate(loss_mask or ()) if not m), default=-1)
    return list(token_ids[last_env + 1:])


def final_turn(sample) -> List[int]:
    """The model's final turn: the response's ids after the environment's last answer (a sample of one
    turn: all of them). The reward reads the final answer from it."""
    mask = getattr(sample, "loss_mask", None)
    if not mask or all(mask):
        return list(sample.token_ids)
    last_env = max(i for i, m in enumerate(mask) if not m)
    return list(sample.token_ids[last_env + 1:])


def episode_metrics(samples: Iterable) -> Dict[str, float]:
    """A step's episodes: turns and tool calls per episode, tool errors, time-outs and seconds (summed),
    and the response tokens by source (the model's, the environment's). Empty for one-turn samples."""
    eps = [s.meta["episode"] for s in samples if isinstance(getattr(s, "meta", None), dict) and "episode" in s.meta]
    if not eps:
        return {}
    model = sum(sum(s.loss_mask) for s in samples if getattr(s, "loss_mask", None) is not None)
    n = len(eps)
    ends = {f"episode_end_{why}": sum(e.get("end") == why for e in eps) / n for why in END_REASONS}
    turn_rewards = [r for e in eps for r in (e.get("env") or {}).get("turn_rewards", [])]
    env = {"env_turn_reward_mean": sum(turn_rewards) / len(turn_rewards)} if turn_rewards else {}
    return {**ends, **env,
            "tool_sandbox_failures": float(sum(e.get("tool_sandbox_failures", 0) for e in eps)),
            "tool_calls_capped": float(sum(e.get("tool_calls_capped", 0) for e in eps)),"episode_turns_mean": sum(e.get("turns", 0) for e in eps) / n,
            "episode_tool_calls_mean": sum(e.get("tool_calls", 0) for e in eps) / n,
            "tool_calls": float(sum(e.get("tool_calls", 0) for e in eps)),
            "tool_errors": float(sum(e.get("tool_errors", 0) for e in eps)),
            "tool_timeouts": float(sum(e.get("tool_timeouts", 0) for e in eps)),
            "tool_seconds": float(sum(e.get("tool_seconds", 0.0) for e in eps)),
            "tokens_model": float(model), "tokens_env": float(sum(e.get("env_tokens", 0) for e in eps))}


def environment_reward(sample) -> Optional[float]:
    """The episode's reward the environment gave (``Reply.episode_reward`` or ``finish``'s), or None:
    the task's reward on the final turn then."""
    meta = getattr(sample, "meta", None)
    env = meta.get("episode", {}).get("env") if isinstance(meta, dict) else None
    reward = env.get("reward") if isinstance(env, dict) else None
    return None if reward is None else float(reward)


def prompt_messages(row: Dict) -> List[Dict[str, str]]:
    """A data row's prompt as chat messages (a string: one user message); [] without one."""
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt] if isinstance(prompt, list) else []


def with_environment(engine, env_cfg, sandbox, tokenizer, stop_token_id: int, template_kwargs: Optional[Dict] = None):
    """``engine`` running the episodes of the run config's ``environment`` section (``env_cfg``; its
    sandbox's typed settings ``sandbox``) in ``tokenizer``'s chat template (rendered with
    ``template_kwargs``, the prompts' own: ``data.tools``, ``data.chat_template_kwargs``); ``engine`` itself when the
    environment is ``none`` (one turn: the rollout as it always was). Said once in the log."""
    if env_cfg.name == "none":
        return engine
    from megatron_tepo.environments.choice import make_environment

    env = make_environment(env_cfg.name, sandbox, env_cfg.format, args=dict(env_cfg.args),
                           max_calls_per_turn=env_cfg.max_calls_per_turn)
    limits = EpisodeLimits(env_cfg.max_turns, env_cfg.max_turn_tokens, env_cfg.tool_workers, env_cfg.on_sandbox_failure)
    print(f"[megatron_tepo] multi-turn episodes: environment {env_cfg.name} ({env_cfg.format} tool calls, sandbox "
          f"{sandbox.kind}), at most {limits.max_turns} turns, {limits.tool_workers} tool calls at once", flush=True)
    return EpisodeEngine(engine, env, TurnFormat(tokenizer, stop_token_id, template_kwargs=template_kwargs), limits)
