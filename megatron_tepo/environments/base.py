"""The environment of a multi-turn episode: what a user implements, in one file, to let the model act
in the world between its turns (:class:`Environment`), and what it answers to one turn
(:class:`Reply`).

An episode goes: the model generates a turn (it ends on the model's own stop token, or at a limit);
the environment reads the turn's text and answers :class:`Reply` -- ``done`` (the turn was the final
answer, or the environment ends the episode), or a message the model reads next (a tool's output),
with what the call cost (tool calls, errors, time-outs, seconds: the step's metrics). The episode
runner (:mod:`megatron_tepo.rollout.episode`) does the rest: it appends the message as the chat
template's tool turn for that model (token ids, never a re-tokenised conversation), masks those
tokens out of the loss, runs the calls in a bounded pool while other episodes generate, and stops an
episode at its limits (turns, tokens).

A minimal environment::

    from megatron_tepo.environments import Environment, Reply

    class Echo(Environment):
        name = "echo"

        def respond(self, turn: str, turn_index: int) -> Reply:
            if turn_index >= 1 or "ECHO:" not in turn:
                return Reply(done=True)
            return Reply(done=False, message=turn.split("ECHO:", 1)[1], tool_calls=1)

``respond`` is called from the runner's tool threads, many at once: it must be thread-safe. It runs
the tool itself (a sandbox, an HTTP service ...) and returns when the answer is there.

**Episodes with state.** An environment that keeps state per episode (a game, an interpreter's
variables, the tests a row carries) implements three more methods; :meth:`Environment.step`'s default
calls ``respond``, so a ``respond``-only environment works as it always did:

- ``start(row, messages) -> state``: a new episode, opened from its data row (every field of the
  row: :attr:`megatron_tepo.data.prompts.PromptRecord.row`, ``{}`` when the task has none) and the
  prompt's chat messages. ``state`` is a dict of plain values (str, int, float, bool, None, lists
  and dicts of them): **it is what survives a checkpoint** -- it rides in the request's episode
  record (``Request.episode["env"]``) across interrupts, a resume after ``kill -9`` and the
  rollout buffer's snapshot. Anything live (a process, a socket) is the environment's own, kept by
  a key the state holds, and must be rebuilt from the state when it is missing (after a resume).
- ``step(state, turn, turn_index) -> Reply``: the answer to a turn; it may change ``state`` in
  place. Called from the runner's tool threads, many episodes at once, one call at a time per
  episode.
- ``finish(state) -> Optional[float]``: the episode ended (any reason); free what it holds. A
  number returned is the episode's reward (else the last ``Reply.episode_reward``, else the task's
  reward on the final turn). Not called for an episode abandoned by the run (a dropped group, a run
  killed): :meth:`close` frees what is left.

A reward per turn (``Reply.reward``) is logged (``env_turn_reward_mean``), not trained on by
itself: the episode's reward is the one that trains.

Left out: state kept across episodes (the environment's own business, never checkpointed).
Standard library only.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

__all__ = ["Environment", "Reply"]


@dataclass(frozen=True)
class Reply:
    """What an environment answers to one model turn: ``done`` (the episode ends with this turn), or
    ``message`` (the environment's answer, which the model reads next), and what the turn's tool
    calls cost."""
    done: bool
    message: str = ""
    tool_calls: int = 0
    tool_errors: int = 0  # calls that failed (an exception, a limit, a malformed call)
    tool_timeouts: int = 0  # calls stopped by a time limit
    tool_seconds: float = 0.0
    reward: Optional[float] = None  # this turn's reward (logged per turn)
    episode_reward: Optional[float] = None  # the episode's reward (it replaces the task's)
    sandbox_failures: int = 0  # calls the sandbox itself failed (not the model's doing)
    capped_calls: int = 0  # calls past environment.max_calls_per_turn, not run (the model is told)


class Environment(abc.ABC):
    """A multi-turn task's other side (see the module docstring)."""

    #: the name the run config's ``environment.name`` selects it by
    name: str = "environment"

    def respond(self, turn: str, turn_index: int) -> Reply:
        """The answer to the model's turn ``turn_index`` (0 first) whose text is ``turn`` (its own
        tokens decoded, the stop token that ended it left out). Thread-safe. (An environment
        implements this, or :meth:`step` with state.)"""
        raise NotImplementedError(f"environment {self.name}: implement respond(turn, turn_index) or "
                                  f"step(state, turn, turn_index)")

    def start(self, row: Dict[str, Any], messages: List[Dict[str, str]]) -> Dict[str, Any]:
        """A new episode's state (plain values: what survives a checkpoint) from its data row and
        the prompt's messages; none by default."""
        return {}

    def step(self, state: Dict[str, Any], turn: str, turn_index: int) -> Reply:
        """The answer to a turn of the episode whose state is ``state`` (changed in place);
        by default :meth:`respond` (a stateless environment)."""
        return self.respond(turn, turn_index)

    def finish(self, state: Dict[str, Any]) -> Optional[float]:
        """The episode ended: free what it holds; a number is its reward. Nothing by default."""
        return None

    @classmethod
    def tool_schemas(cls, fmt: str) -> List[Dict[str, Any]]:
        """The JSON schemas of the tools the model may call, as chat templates take them (``tools=``),
        for calls in ``fmt``: the prompts show them when ``data.tools`` is not set. None by default."""
        return []

    def close(self) -> None:
        """Free what the environment holds (its sandbox)."""
