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

Left out: the reward (the task's, read from the final turn), state kept across episodes.
Standard library only.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

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


class Environment(abc.ABC):
    """A multi-turn task's other side (see the module docstring)."""

    #: the name the run config's ``environment.name`` selects it by
    name: str = "environment"

    @abc.abstractmethod
    def respond(self, turn: str, turn_index: int) -> Reply:
        """The answer to the model's turn ``turn_index`` (0 first) whose text is ``turn`` (its own
        tokens decoded, the stop token that ended it left out). Thread-safe."""

    def close(self) -> None:
        """Free what the environment holds (its sandbox)."""
