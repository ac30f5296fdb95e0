"""A game whose state is the row's, as a user's template: guess the number the row holds
(:class:`GuessNumber`). No tool code runs: the environment answers each guess ``higher`` / ``lower``
and gives the episode's reward itself (1 for the number found, 0 else; the turn's reward, logged, is
1 on the right guess). Standard library only.

A row: ``{"prompt": "Guess my number between 1 and 100. Answer with a number.", "secret": 37}``
(``secret``; or the row's ``answer``). A turn's guess is its last integer; a turn without one ends
the episode (no reward).

``feedback=False`` is the same game with the environment's answer carrying no information: every
wrong guess is answered ``neutral`` (the control of the benchmark in docs/BENCHMARKS.md, "Tasks with
an environment (#58)": what the model gains from the environment's feedback).

Left out: any tool; a reward for getting close (the reward is found or not).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from megatron_tepo.environments.base import Environment, Reply

__all__ = ["GuessNumber"]

_INT = re.compile(r"-?\d+")


class GuessNumber(Environment):
    """``field``: the row's field holding the secret (``secret``; the row's ``answer`` without it);
    ``higher`` / ``lower``: what the environment answers a guess below / above it; ``feedback=False``:
    every wrong guess is answered ``neutral`` instead (no information: the game without feedback)."""

    name = "guess_number"

    def __init__(self, field: str = "secret", higher: str = "higher", lower: str = "lower",
                 feedback: bool = True, neutral: str = "wrong"):
        if not isinstance(feedback, bool):
            raise ValueError(f"guess_number: environment.args.feedback must be true or false, not {feedback!r}")
        self.field, self.higher, self.lower = field, higher, lower
        self.feedback, self.neutral = feedback, neutral

    def start(self, row: Dict[str, Any], messages: List[Dict[str, str]]) -> Dict[str, Any]:
        secret = row.get(self.field, row.get("answer"))
        try:
            secret = int(str(secret).strip())
        except ValueError:
            raise ValueError(f"guess_number: the row's {self.field!r} (or 'answer') is not an integer: {secret!r}") from None
        return {"secret": secret, "guesses": []}

    def step(self, state: Dict[str, Any], turn: str, turn_index: int) -> Reply:
        found = _INT.findall(turn)
        if not found:
            return Reply(done=True, episode_reward=0.0)
        guess = int(found[-1])
        state["guesses"].append(guess)
        if guess == state["secret"]:
            return Reply(done=True, reward=1.0, episode_reward=1.0)
        if not self.feedback:
            return Reply(done=False, message=self.neutral, reward=0.0)
        return Reply(done=False, message=self.higher if guess < state["secret"] else self.lower, reward=0.0)

    def finish(self, state: Dict[str, Any]) -> Optional[float]:
        found = bool(state.get("guesses")) and state["guesses"][-1] == state.get("secret")
        return 1.0 if found else 0.0
