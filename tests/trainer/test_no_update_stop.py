"""A run that makes no policy update for ``fault.max_steps_without_update`` steps in a row stops with
NoUpdateError saying why (equal rewards everywhere / every update non-finite) instead of going
through all its steps; an update in between starts the count again; 0 never stops. A fake engine
and actor (no model): the loop's bookkeeping only."""
import math

import pytest

from megatron_tepo.config import from_dict
from megatron_tepo.rollout.engine import RolloutEngine, Sample
from megatron_tepo.trainer.loop import NoUpdateError, Task, train
from tests.fakes import FakePolicy


class EchoEngine(RolloutEngine):
    """Sample j of prompt [p] is the response [p, j]; weight updates are accepted and dropped."""

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=128, stop_token_ids=()):
        return [[Sample([p[0], j], [-0.5, -0.5], "stop") for j in range(n)] for p in prompts]

    def update_weights(self, named_tensors):
        pass


class NanActor(FakePolicy):
    """Every update's loss is NaN (skipped by the loop) except on the calls in ``finite``; with
    ``nan_grads`` the losses are finite and the gradients of those calls are not (the actor's
    optimizer step skips them, as ``MegatronActor.optimizer_step`` does)."""

    def __init__(self, finite=(), nan_grads=()):
        super().__init__()
        self.calls, self.finite, self.nan_grads = 0, set(finite), set(nan_grads)
        self.discarded = 0

    def forward_backward(self, batch, loss):
        self.calls += 1
        finite = self.calls in self.finite or self.calls in self.nan_grads
        return {"loss": 0.5 if finite else math.nan}

    def discard_gradients(self):
        self.discarded += 1

    def optimizer_step(self):
        if self.calls in self.nan_grads:
            return {"lr": 1e-4, "grad_norm": math.nan, "skipped_update": 1.0}
        return {"lr": 1e-4, "grad_norm": 1.0, "skipped_update": 0.0}


def _cfg(steps, max_without, **rollout):
    return from_dict({"rollout": {"prompts_per_step": 2, "n_samples": 2, "max_sampling_rounds": 1, **rollout},
                      "algorithm": {"old_log_prob": "rollout"},
                      "train": {"steps": steps, "mini_batch_prompts": 2, "epochs_per_step": 1},
                      "fault": {"max_steps_without_update": max_without, "watchdog_generate_s": 0,
                                "watchdog_collective_s": 0, "watchdog_sync_s": 0}})


def _task(reward):
    return Task([[i + 3] for i in range(8)], ["a"] * 8, lambda responses, answers: [reward(r) for r in responses],
                stop_token_ids=[], pad_token_id=0)


def test_equal_rewards_for_n_steps_in_a_row_stop_the_run_saying_why():
    seen = []
    with pytest.raises(NoUpdateError) as err:
        train(_cfg(400, 5), NanActor(), EchoEngine(), _task(lambda r: 0.0), on_step=lambda s, m: seen.append(s))
    assert seen == [1, 2, 3, 4, 5]  # not 400 steps
    msg = str(err.value)
    assert "no policy update for 5 steps in a row (steps 1-5, fault.max_steps_without_update=5)" in msg
    assert "every group had equal rewards in 1 sampling round(s)" in msg
    assert "rollout.n_samples" in msg and "0 never stops" in msg


def test_every_update_non_finite_stops_and_an_update_resets_the_count():
    actor, seen = NanActor(finite={3}), []  # the third step's update is finite
    with pytest.raises(NoUpdateError) as err:
        train(_cfg(400, 3), actor, EchoEngine(), _task(lambda r: float(r[1] == 0)),
              on_step=lambda s, m: seen.append((s, m["updates"])))
    assert seen == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 0.0), (5, 0.0), (6, 0.0)]
    msg = str(err.value)
    assert "(steps 4-6, fault.max_steps_without_update=3)" in msg
    assert "every update was skipped: the loss or the gradient norm was not finite" in msg and "optim.lr" in msg


def test_zero_never_stops():
    history = train(_cfg(8, 0), NanActor(), EchoEngine(), _task(lambda r: 0.0))
    assert [m["updates"] for m in history] == [0.0] * 8


def test_the_count_is_saved_with_each_checkpoint_and_a_resumed_run_goes_on_counting(tmp_path, monkeypatch):
    from megatron_tepo.trainer import run_state as loop  # (the checkpoint plumbing moved out of loop.py)

    saved = {}
    monkeypatch.setattr(loop, "_save", lambda cfg, actor, root, step, state, *a: saved.__setitem__(step, state))
    # run 1: two steps without an update, then its steps are done (a time limit, say)
    train(_cfg(2, 3), NanActor(), EchoEngine(), _task(lambda r: 0.0), checkpoint_root=tmp_path)
    assert [saved[s]["steps_without_update"] for s in (1, 2)] == [1, 2]

    # run 2 resumes from step 2's state: one more such step makes 3 in a row
    resumed = NanActor()
    resumed.load_newest_checkpoint = lambda root, report: (tmp_path / "step_2", saved[2])
    seen = []
    with pytest.raises(NoUpdateError) as err:
        train(_cfg(400, 3), resumed, EchoEngine(), _task(lambda r: 0.0), checkpoint_root=tmp_path,
              on_step=lambda s, m: seen.append(s))
    assert seen == [3]
    assert "no policy update for 3 steps in a row (steps 1-3, fault.max_steps_without_update=3)" in str(err.value)
    assert saved[3]["steps_without_update"] == 3


def test_a_skipped_update_is_said_in_one_line_and_counted():
    """A NaN loss (the loop skips) and a NaN gradient (the actor's step skips) are each said once, in
    one line naming the step, the count and the setting that stops such a run."""
    lines, seen = [], []
    actor = NanActor(finite={2}, nan_grads={3})
    train(_cfg(3, 5), actor, EchoEngine(), _task(lambda r: float(r[1] == 0)), report=lines.append,
          on_step=lambda s, m: seen.append((s, m["updates"], m["skipped_update"])))
    assert seen == [(1, 0.0, 1.0), (2, 1.0, 0.0), (3, 0.0, 1.0)]
    said = [line for line in lines if "skipped" in line]
    assert said == [
        "step 1: 1 of 1 policy update(s) skipped: 1 with a non-finite loss; no weight changed "
        "(fault.max_steps_without_update=5 stops a run without updates)",
        "step 3: 1 of 1 policy update(s) skipped: 1 with a non-finite gradient (NaN or inf); no weight changed "
        "(fault.max_steps_without_update=5 stops a run without updates)"]
    assert actor.discarded == 1  # the loop drops the NaN loss's gradients; the actor its own
