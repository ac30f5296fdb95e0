"""The schedules are rollout sources (``trainer/sources.py``): the step's verbs call one interface
and do not branch on the schedule; what a source carries between steps goes through one sample
round trip, which keeps every field of a :class:`Sample` and a :class:`Request` (the fourth GPU
reading's row 8: the pending one-step-off rollout lost ``routed_experts``, ``versions`` and
``meta``, so a resumed r3 run failed its first step)."""
import ast
import dataclasses
import inspect
import json
import shutil

import pytest
import torch

from megatron_tepo.config import from_dict
from megatron_tepo.rollout.engine import Request, RolloutEngine, Sample, from_state, to_state
from megatron_tepo.trainer import step as step_module
from megatron_tepo.trainer.loop import Task, train
from megatron_tepo.trainer.partial import BUFFER_FILE, read_buffer, write_buffer
from megatron_tepo.trainer.groups import Generated, GroupProducer
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
class CountingEngine(RolloutEngine):
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


# ------------------------------------------------------------------ one group producer for every schedule
@pytest.fixture
def producer_calls(monkeypatch):
    """What the run's GroupProducer was asked: each group it judged (prompt index, kept) and each
    step's rollout it put together."""
    calls = {"judged": [], "generated": []}
    judge, generated = GroupProducer.judge, GroupProducer.generated

    def spy_judge(self, indices, groups):
        out = judge(self, indices, groups)
        calls["judged"] += list(zip(indices, out[2]))
        return out

    def spy_generated(self, *args):
        got = generated(self, *args)
        calls["generated"].append(got)
        return got

    monkeypatch.setattr(GroupProducer, "judge", spy_judge)
    monkeypatch.setattr(GroupProducer, "generated", spy_generated)
    return calls


def _first_step(name, calls):
    overrides, _ = SCHEDULES[name]
    calls["generated"].clear()
    train(_cfg(1, **overrides), FakePolicy(), CountingEngine(), _task())
    (got,) = calls["generated"]
    return got.prompts, [[s.token_ids for s in g] for g in got.groups], got.rewards.tolist(), got.records


def test_the_three_schedules_take_the_same_first_groups_from_the_one_producer(producer_calls):
    """The same task and seed: step 1's prompts, groups and rewards are the same whether the step
    generates them now, one step off, or from the partial-rollout buffer (each draws the prompt
    stream's first pass, samples with the same parameters and scores with the same reward): every
    schedule's step is the producer's rollout."""
    sync = _first_step("synchronous", producer_calls)
    assert len(sync[0]) == 2 and sync[2] == [0.0, 1.0, 0.0, 1.0] and sync[3] == [None, None]
    assert _first_step("one_step_off", producer_calls) == sync
    assert _first_step("partial", producer_calls) == sync


def _dropping_task():
    """Prompts [3] .. [10]: an odd one's samples score 0 and 1 (kept), an even one's all 0 (dropped)."""
    return Task([[i + 3] for i in range(8)], ["a"] * 8,
                lambda responses, answers: [float(r[1]) if r[0] % 2 else 0.0 for r in responses],
                stop_token_ids=[0], pad_token_id=0)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_trains_only_on_groups_the_producer_kept(name, producer_calls):
    """Dynamic sampling is applied in one place, the producer's judge: every schedule's steps are
    its rollouts, each trained group was judged and kept, and every drop a step counts is one of
    its verdicts."""
    overrides, _ = SCHEDULES[name]
    cfg = _cfg(3, **{**overrides, "dynamic_sampling": True, "max_sampling_rounds": 4})
    history = train(cfg, FakePolicy(), CountingEngine(), _dropping_task())
    assert len(producer_calls["generated"]) == 3
    kept = [i for i, k in producer_calls["judged"] if k]
    dropped = [i for i, k in producer_calls["judged"] if not k]
    assert dropped and all(i % 2 == 1 for i in dropped) and all(i % 2 == 0 for i in kept)  # (prompt i is [i + 3])
    for got, metrics in zip(producer_calls["generated"], history):
        assert got.prompts and all(p[0] % 2 for p in got.prompts)
        assert metrics["updates"] == 1.0
    assert 0 < sum(m["groups_dropped"] for m in history) <= len(dropped)


def test_a_prompts_row_reaches_its_reward_and_its_group(tmp_path):
    """A task with rows (each prompt's data row): a reward that takes rows is called with each
    sample's row, and the step's rollout carries each group's, through a checkpoint's pending rollout too."""
    seen = []

    def reward(responses, answers, rows=None, episodes=None):
        seen.extend(rows)
        return [float(r[1]) for r in responses]

    reward.takes_rows = True
    rows = [{"row": i, "topic": f"t{i % 3}"} for i in range(8)]
    task = Task([[i + 3] for i in range(8)], ["a"] * 8, reward, stop_token_ids=[0], pad_token_id=0, train_rows=rows)
    got = GroupProducer(task, _cfg(1)).step(CountingEngine(), 1)
    kept = [r["row"] for r in got.records]
    assert [p[0] - 3 for p in got.prompts] == kept and seen == [rows[i] for i in kept for _ in range(2)]
    source = OneStepOff()
    source.write_state(got, tmp_path / source.state_file)
    assert source.read_state(tmp_path / source.state_file).records == got.records
    with pytest.raises(ValueError, match=r"Task.train_rows: 3 rows for 8 prompts"):
        Task([[i] for i in range(8)], ["a"] * 8, reward, [0], train_rows=rows[:3])


# ------------------------------------------------------------------ the engine contract
def _calls_on_an_engine(path):
    """Each ``getattr`` / ``hasattr`` call in ``path`` whose object names an engine, as ``line: source``."""
    text = path.read_text()
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and "engine" in ast.get_source_segment(text, node.args[0]).lower():
            found.append(f"{path.name}:{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


def test_no_trainer_module_reads_an_engine_by_getattr_or_hasattr():
    """#57: what the trainer reads of an engine is declared on RolloutEngine (metrics, the sampling
    RNG's state, whether it is interruptible, its weight sync), with defaults: no trainer module asks
    an engine with getattr or hasattr (the old code did, in loop.py, sources.py, run_state.py and
    partial.py); the episode engine forwards by name, without a catch-all ``__getattr__``, and the
    follower rank's engine is a RolloutEngine."""
    from megatron_tepo.rollout.episode import EpisodeEngine
    from megatron_tepo.trainer.driver import FollowerEngine
    from tests.source_imports import PKG

    found = [c for f in sorted((PKG / "trainer").rglob("*.py")) for c in _calls_on_an_engine(f)]
    assert found == [], found
    assert "__getattr__" not in vars(EpisodeEngine)
    assert issubclass(FollowerEngine, RolloutEngine)
    assert FollowerEngine().rng_state() is None and FollowerEngine().step_metrics([], []) == {}
    assert _calls_on_an_engine(PKG / "rollout" / "episode.py")  # (the check sees one where it is allowed)


def test_a_request_saved_with_the_old_all_model_mask_reads_as_none():
    """One convention for an all-model loss mask: None, in a Sample and a Request alike (a Request
    said it with ``[]`` before; a state saved then still reads, as None)."""
    old = {**to_state(Request([1, 2], 9, token_ids=[5, 6], log_probs=[-0.1, -0.2], versions=[1, 1])), "loss_mask": []}
    req = from_state(Request, old)
    assert req.loss_mask is None and req.to_sample("stop").loss_mask is None
    req.extend(Sample([7], [-0.3], "stop", loss_mask=[0]), 2)
    assert req.loss_mask == [1, 1, 0]
    req.restart()
    assert req.loss_mask is None
    with pytest.raises(ValueError, match="2 tokens but 1 loss-mask entries"):
        Request([1], 9, token_ids=[5, 6], log_probs=[-0.1, -0.2], loss_mask=[1])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_resumed_run_draws_the_prompts_the_run_would_have(name, producer_calls, tmp_path):
    """The prompt stream is saved once, in the run state, as it stood when the source's carried
    state was taken (partial rollout: at the update, before the feeder drew on): a run resumed from
    step 2 trains steps 3 and 4 on the prompts the uninterrupted run trained on. The buffer's file
    no longer holds the stream."""
    overrides, _ = SCHEDULES[name]
    cfg = lambda: _cfg(4, **{**overrides, "dynamic_sampling": True, "max_sampling_rounds": 4})  # noqa: E731
    train(cfg(), FakePolicy(), CountingEngine(), _dropping_task(), checkpoint_root=tmp_path)
    whole = [got.prompts for got in producer_calls["generated"]]
    saved = json.loads((tmp_path / "step_2" / "extra_state.json").read_text())
    assert {"rng", "order", "cursor"} <= set(saved)
    if name == "partial":
        assert not {"rng", "order", "cursor", "stream"} & set(read_buffer(tmp_path / "step_2" / BUFFER_FILE))
    for step in (3, 4):
        shutil.rmtree(tmp_path / f"step_{step}")
    producer_calls["generated"].clear()
    train(cfg(), FakePolicy(), CountingEngine(), _dropping_task(), checkpoint_root=tmp_path)
    again = [got.prompts for got in producer_calls["generated"]]
    assert again == (whole[3:] if name == "one_step_off" else whole[2:])  # (one step off: step 3 was saved)


def test_partial_rollout_saves_the_stream_as_it_stood_at_the_update():
    """The buffer's snapshot is taken at the update; the feeder draws on after it, so the stream a
    partial-rollout checkpoint keeps is the one of the snapshot, not the live one."""
    stream = GroupProducer(_task(), _cfg(3)).stream
    source = Partial()
    source.saved = {"stream": stream.state(), "groups": []}
    at_update = stream.state()
    stream.next(), stream.next()  # (the feeder, after the update)
    assert source.stream_state(stream) == at_update != stream.state()
    assert Synchronous().stream_state(stream) == stream.state()


def test_a_checkpoint_written_before_the_one_stream_still_resumes_exactly(tmp_path):
    """Checkpoints written before the schedules shared the prompt stream: the run state's JSON held
    ``rng`` and ``order`` (no cursor), and the partial-rollout buffer's file its own ``rng``,
    ``order`` and ``cursor``. Both still read, the buffer's winning for partial rollout."""
    import random

    from megatron_tepo.trainer.partial import RolloutBuffer
    from megatron_tepo.trainer.run_state import RunState

    rng = random.Random(7)
    order = list(range(8))
    rng.shuffle(order)
    version, internal, gauss = rng.getstate()
    old_rng = [version, list(internal), gauss]
    state = RunState.new(_cfg(3), 8)
    state.restore({"step": 2, "rng": old_rng, "order": order, "engine_rng": None}, CountingEngine())
    assert state.start == 3 and state.stream.order == order and state.stream.cursor == 8
    twin = random.Random()
    twin.setstate(rng.getstate())
    assert [state.stream.any() for _ in range(5)] == [twin.randrange(8) for _ in range(5)]

    producer = GroupProducer(_task(), _cfg(3, partial_rollout=True, max_staleness=1))
    old_buffer = {"version": 3, "rng": old_rng, "order": order, "cursor": 5, "next_gid": 9, "dropped": [],
                  "groups": []}
    write_buffer(old_buffer, tmp_path / "b.pt")
    buf = RolloutBuffer(CountingEngine(), producer, 3, snapshot=read_buffer(tmp_path / "b.pt"))
    try:
        assert producer.stream.state() == {"rng": old_rng, "order": order, "cursor": 5} and buf.next_gid == 9
        assert [producer.stream.next() for _ in range(3)] == order[5:8]
    finally:
        buf.close()
