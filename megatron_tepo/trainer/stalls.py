"""What the run says when it makes no progress: a step's skipped updates in one line, and the stop of
a run without a policy update for ``fault.max_steps_without_update`` steps in a row
(:class:`NoUpdateError`, saying why and what to change).

Left out: deciding anything (the loop counts and stops; the watchdog handles hangs).
"""
from __future__ import annotations

import math
from typing import Dict, List

__all__ = ["NoUpdateError", "no_update_cause", "stalled_message", "skipped_update_message"]


def skipped_update_message(step: int, updates: List[Dict[str, float]], max_steps_without_update: int) -> str:
    """The one line a step with skipped updates prints: how many, why, and what stops a run that keeps
    skipping."""
    skipped = [u for u in updates if u["skipped_update"]]
    losses = sum(1 for u in skipped if not math.isfinite(u.get("loss", math.nan)))
    why = ", ".join(f"{n} with a non-finite {what}" for n, what in ((losses, "loss"),
                                                                  (len(skipped) - losses, "gradient (NaN or inf)")) if n)
    stop = (f"fault.max_steps_without_update={max_steps_without_update} stops a run without updates"
            if max_steps_without_update else "fault.max_steps_without_update: 0, the run goes on")
    return (f"step {step}: {len(skipped)} of {len(updates)} policy update(s) skipped: {why}; no weight changed "
            f"({stop})")


class NoUpdateError(RuntimeError):
    """The run stopped changing the policy: :func:`train` after ``fault.max_steps_without_update``
    steps in a row without an update, ``trainer/main.py`` when a whole run made none
    (``tools/train.py`` exits 3; the Slurm job does not requeue it: it would stall again)."""


def no_update_cause(metrics: dict, n_samples: int) -> str:
    """Why a step made no update, as far as its metrics tell (the reward's counts among them)."""
    if metrics.get("skipped_step"):
        answers = metrics.get("groups_generated", 0) * n_samples
        no_answer = metrics.get("reward_no_answer", 0)
        timeouts = metrics.get("reward_timeouts", 0)
        mean = metrics.get("reward_mean_all", 0.0)
        why = (f"every group had equal rewards in {metrics.get('sampling_rounds', 0):g} sampling round(s) "
               f"(reward mean {mean:.3f})")
        if answers and no_answer >= answers / 2:
            why += (f"; {no_answer} of {answers} responses had no \\boxed{{}} answer: check the prompt template "
                    f"and rollout.max_new_tokens")
        elif timeouts:
            why += f"; {timeouts} answers timed out (reward.timeout_s)"
        elif mean >= 1.0:
            why += "; every response was already right: the prompts are too easy"
        return why
    return "every update was skipped: the loss or the gradient norm was not finite"


def stalled_message(steps: int, last_step: int, metrics: dict, n_samples: int) -> str:
    """The stop of a run with no update in ``steps`` steps in a row (ending at ``last_step``): why, and
    what to change."""
    if metrics.get("skipped_step"):
        change = ("give it prompts whose samples differ in reward (harder or easier data, data.train_files), "
                  "more sampling (rollout.n_samples, rollout.temperature, rollout.max_sampling_rounds), or check "
                  "the reward (reward.kind)")
    else:
        change = "lower optim.lr, check the data for degenerate rows, or resume from an earlier checkpoint"
    return (f"no policy update for {steps} steps in a row (steps {last_step - steps + 1}-{last_step}, "
            f"fault.max_steps_without_update={steps}): {no_update_cause(metrics, n_samples)}; {change} "
            f"(fault.max_steps_without_update: 0 never stops)")
