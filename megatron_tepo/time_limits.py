"""How long a rollout may take: one request's time limit and one generation call's, derived from
the answers they wait for (``rollout.max_new_tokens`` at a stated floor decode rate,
``rollout.decode_floor_tokens_per_s``) where the user set none.

* A request: :data:`PREFILL_S` (the server's scheduling and the prompt's prefill: the SGLang fleet
  sends no more requests than the servers have slots and holds the rest itself, their clocks not
  yet running) plus ``max_new_tokens`` at the
  floor rate, at least :data:`MIN_REQUEST_S`; a request limit the user set
  (``rollout.request_timeout_s``) shorter than that is refused in one line (:func:`check_request_limit`).
* A generation call (a step's sampling round, all its samples at once): as many *waves* of requests
  as its samples need of the engine's slots (the servers' running-request limits summed), each wave
  a request's limit; with multi-turn episodes (an ``environment``), each wave ``max_turns`` turns,
  each a request's limit and a tool call's wall time (``environment.sandbox.wall_seconds``).

At Qwen3-14B with 32k-token answers (examples/models/qwen3_14b_32k.yaml): 120 + 32768 / 20 = 1758 s
a request; 512 samples on 176 slots are 3 waves, 5274 s a round. Pure arithmetic: the fleet
(:mod:`megatron_tepo.rollout.sglang`), the config's checks and the launch's fit check read it.

Left out: measuring the decode rate (the floor is the user's statement of the slowest a request may
be), and time spent on tool calls in multi-turn episodes (counted by the episode's own limits).
"""
from __future__ import annotations

import math
from typing import Optional

__all__ = ["PREFILL_S", "MIN_REQUEST_S", "needed_request_s", "request_limit_s", "waves", "round_limit_s",
           "check_request_limit"]

#: a request's allowance for the server to schedule it and prefill its prompt
PREFILL_S = 120.0
#: no request limit is derived shorter than this (short answers: a server busy with others' prefills)
MIN_REQUEST_S = 600.0


def needed_request_s(max_new_tokens: int, floor_tokens_per_s: float) -> float:
    """The longest a request may take: :data:`PREFILL_S` + ``max_new_tokens`` at the floor rate."""
    return PREFILL_S + max_new_tokens / floor_tokens_per_s


def request_limit_s(rollout) -> float:
    """One request's time limit: ``rollout.request_timeout_s`` where set, else derived from
    ``rollout.max_new_tokens`` at ``rollout.decode_floor_tokens_per_s`` (at least :data:`MIN_REQUEST_S`)."""
    if rollout.request_timeout_s is not None:
        return float(rollout.request_timeout_s)
    return max(MIN_REQUEST_S, needed_request_s(rollout.max_new_tokens, rollout.decode_floor_tokens_per_s))


def waves(samples: int, slots: Optional[int]) -> int:
    """Rounds of requests ``samples`` need on ``slots`` concurrent requests (None or 0: unknown, one)."""
    return max(1, math.ceil(samples / slots)) if slots else 1


def round_limit_s(rollout, samples: int, slots: Optional[int], turns: int = 1, tool_s: float = 0.0) -> float:
    """One generation call's time limit: :func:`waves` x ``turns`` x (:func:`request_limit_s` + ``tool_s``,
    a tool call's wall time between two turns)."""
    return waves(samples, slots) * turns * (request_limit_s(rollout) + (tool_s if turns > 1 else 0.0))


def check_request_limit(rollout) -> Optional[str]:
    """The one-line reason a set ``rollout.request_timeout_s`` is shorter than the longest answer
    needs (None when it is not, or is derived)."""
    if rollout.request_timeout_s is None:
        return None
    need = needed_request_s(rollout.max_new_tokens, rollout.decode_floor_tokens_per_s)
    if rollout.request_timeout_s >= need:
        return None
    return (f"rollout.request_timeout_s: {rollout.request_timeout_s:g} s is shorter than the longest answer needs: "
            f"{PREFILL_S:g} s for the prompt + rollout.max_new_tokens {rollout.max_new_tokens} at "
            f"rollout.decode_floor_tokens_per_s {rollout.decode_floor_tokens_per_s:g} = {need:.0f} s; raise it, or "
            f"leave it unset (null) to derive it")
