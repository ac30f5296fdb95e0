"""The schedules are rollout sources (``trainer/sources.py``): the step's verbs call one interface
and do not branch on the schedule; what a source carries between steps goes through one sample
round trip, which keeps every field of a :class:`Sample` and a :class:`Request` (the fourth GPU
reading's row 8: the pending one-step-off rollout lost ``routed_experts``, ``versions`` and
``meta``, so a resumed r3 run failed its first step)."""
import dataclasses
import inspect
import json
import shutil

import pytest
import torch

from megatron_tepo.config import from_dict
from megatron_tepo.rollout.engine import Request, Sample, from_state, to_state
from megatron_tepo.trainer import step as step_module
from megatron_tepo.trainer.loop import Task, train
from megatron_tepo.trainer.partial import read_buffer, write_buffer
from megatron_tepo.trainer.rollouts import Generated
from megatron_tepo.trainer.sources import OneStepOff, Partial, Synchronous, source_of
from tests.fakes import FakePolicy

# one value per field, none of them the field's default: a new field of Sample or Request must be
# given one here, and is then checked to survive a checkpoint
SAMPLE = {"token_ids": [7, 8, 9], "log_probs": [-0.25, -0.5, -1.0], "finish_reason": "length",
          "meta": {"matched_stop": 2, "error": None}, "routed_experts": torch.arange(24, dtype=torch.int8).view(4, 3, 2),
          "versions": [3, 3, 4], "loss_mask": [1, 0, 1]}
REQUEST = {"prompt": [1, 2], "max_new_tokens": 9, "key": [5, 1], "token_ids": [7, 8], "log_probs": [-0.25, -0.5],
           "versions": [3, 4], "interrupted": 2, "loss_mask": [1, 0], "episode": {"turns": 2, "tool_calls": 1}}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("cls,values", [(Sample, SAMPLE), (Request, REQUEST)], ids=["Sample", "Request"])
def test_the_fixture_gives_every_field_a_value_other_than_its_default(cls, values):
    assert set(values) == {f.name for f in dataclasses.fields(cls)}, \
        f"{cls.__name__} has fields the round-trip test does not set: give each a non-default value here"
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else object())
        assert not _equal(values[f.name], default), f.name


def test_every_field_of_a_sample_survives_the_pending_rollout(tmp_path):
    """One step off: the next step's rollout, written with a checkpoint and read back, holds every
    field of every sample (on the old writer, routed_experts, versions and meta were dropped)."""
    g = Generated([[1, 2]], [[Sample(**SAMPLE)]], torch.tensor([1.0]), {"groups_generated": 1}, 3)
    source = OneStepOff()
    source.write_state(g, tmp_path / source.state_file)
    back = source.read_state(tmp_path / source.state_file)
    got = back.groups[0][0]
    for name, value in SAMPLE.items():
        assert _equal(getattr(got, name), value), name
    assert back.prompts == g.prompts and torch.equal(back.rewards, g.rewards) and back.weights_version == 3


def test_every_field_of_a_request_survives_the_rollout_buffer(tmp_path):
    """Partial rollout: a buffer snapshot's requests through the same round trip."""
    snap = {"groups": [{"requests": [to_state(Request(**REQUEST))]}]}
    write_buffer(snap, tmp_path / "b.pt")
    got = from_state(Request, read_buffer(tmp_path / "b.pt")["groups"][0]["requests"][0])
    for name, value in REQUEST.items():
        assert _equal(getattr(got, name), value), name


def test_a_saved_state_with_a_field_this_version_does_not_know_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"ckpt/x\.pt: a saved Sample has fields this version does not know: \['colour'\]"):
        from_state(Sample, {**to_state(Sample(**SAMPLE)), "colour": 1}, "ckpt/x.pt")
    with pytest.raises(ValueError, match=r"lacks \['finish_reason'\]"):
        from_state(Sample, {"token_ids": [], "log_probs": []}, "ckpt/x.pt")


def test_a_pending_rollout_written_before_the_round_trip_still_reads(tmp_path):
    """Checkpoints written by the earlier code held each sample as (tokens, log-probs, finish)."""
    torch.save({"prompts": [[1]], "rewards": [torch.tensor([0.0, 1.0])], "stats": {}, "weights_version": 2,
                "groups": [[([4], [-0.1], "stop"), ([5], [-0.2], "length")]]}, tmp_path / "p.pt")
    g = OneStepOff().read_state(tmp_path / "p.pt")
    assert [s.token_ids for s in g.groups[0]] == [[4], [5]] and g.rewards.tolist() == [0.0, 1.0]


# ------------------------------------------------------------------ the three schedules, one interface
class CountingEngine:
    """Interruptible: sample j of prompt [p] is the response [p, j, 0] (a stop at 0); ``submit``
    answers at once, so ``interrupt`` finds nothing running."""
    interruptible = True

    def __init__(self):
        self.done = []

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=128, stop_token_ids=()):
        return [[Sample([p[0], j, 0], [-0.5] * 3, "stop") for j in range(n)] for p in prompts]

    def submit(self, requests, params):
        self.done += [(r, Sample([r.prompt[0], r.key[1], 0], [-0.5] * 3, "stop")) for r in requests]

    def collect(self, timeout=0.0):
        out, self.done = self.done, []
        return out

    def interrupt(self):
        return self.collect()

    def update_weights(self, named_tensors):
        pass

    def close(self):
        pass


def _cfg(steps, **rollout):
    return from_dict({"rollout": {"prompts_per_step": 2, "n_samples": 2, "max_sampling_rounds": 1,
                                  "dynamic_sampling": False, **rollout},
                      "algorithm": {"old_log_prob": "rollout"},
                      "train": {"steps": steps, "mini_batch_prompts": 2, "epochs_per_step": 1, "save_every": 1,
                                "async_save": False},
                      "fault": {"watchdog_generate_s": 0, "watchdog_collective_s": 0, "watchdog_sync_s": 0}})


def _task():
    return Task([[i + 3] for i in range(8)], ["a"] * 8, lambda responses, answers: [float(r[1]) for r in responses],
                stop_token_ids=[0], pad_token_id=0)


SCHEDULES = {"synchronous": ({}, Synchronous), "one_step_off": ({"max_staleness": 1}, OneStepOff),
             "partial": ({"partial_rollout": True, "max_staleness": 1}, Partial)}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_three_schedules_run_through_one_interface_and_resume(tmp_path, name):
    """Each schedule is a source of its own, run by the same phases: 3 steps with a checkpoint each;
    step 2's checkpoint holds what the source carries (the next rollout one step off, the buffer
    with partial rollout), and a run resumed from it trains step 3 on it."""
    overrides, cls = SCHEDULES[name]
    assert isinstance(source_of(_cfg(3, **overrides)), cls)
    history = train(_cfg(3, **overrides), FakePolicy(), CountingEngine(), _task(), checkpoint_root=tmp_path)
    assert [h["updates"] for h in history] == [1.0] * 3
    ages = [h["rollout_staleness"] for h in history]
    assert ages == [0.0, 1.0, 1.0] if name == "one_step_off" else ages[0] == 0.0 and max(ages) <= 1.0
    carried = json.loads((tmp_path / "step_2" / "extra_state.json").read_text())
    expect = {"pending_rollout": None, "rollout_buffer": None}
    if cls.state_key:
        expect[cls.state_key] = cls.state_file
        assert (tmp_path / "step_2" / cls.state_file).is_file()
    assert {k: carried[k] for k in expect} == expect
    shutil.rmtree(tmp_path / "step_3")
    again = train(_cfg(3, **overrides), FakePolicy(), CountingEngine(), _task(), checkpoint_root=tmp_path)
    assert len(again) == 1 and again[0]["updates"] == 1.0
    if name == "one_step_off":
        assert again[0]["rollout_staleness"] == 1.0  # the rollout saved with step 2, generated with its weights
    if name == "partial":
        assert "resumed_from_checkpoint" in again[0]


def test_the_steps_do_not_branch_on_the_schedule():
    """The phases read no schedule setting: they call the run's source."""
    text = inspect.getsource(step_module)
    for setting in ("partial_rollout", "max_staleness", "run.partial", "run.buffer", "pending"):
        assert setting not in text, setting
