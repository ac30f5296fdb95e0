"""The actor's layout check before any process group (the rules themselves: tests/test_layout.py),
batch format, token-budget batching."""
import pytest
import torch
import torch.distributed as dist

from megatron_tepo.actor import RolloutBatch, balance_to_count, plan_micro_batches
from megatron_tepo.actor.batching import padded_tokens
from megatron_tepo.layout import ParallelLayout
from megatron_tepo.megatron.parallel import initialize_parallel, validate_layout_here
from megatron_tepo.models import family_config_from_hf
from tests.megatron.helpers import make_batch, tiny_hf_config


def cfg(**overrides):
    return family_config_from_hf(tiny_hf_config("qwen3", **overrides), spec="local")


def test_padded_micro_batch_adds_masked_rows_and_columns():
    b = make_batch(4).select([0, 1])
    p = b.padded(3, b.input_ids.shape[1] + 2)
    assert p.input_ids.shape == (3, b.input_ids.shape[1] + 2)
    assert p.response_mask[2].sum() == 0 and torch.equal(p.response_mask[:2], b.response_mask)
    assert torch.equal(p.seq_lens()[:2], b.seq_lens())


def test_initialize_parallel_validates_first(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"parallel.pp=3 does not divide num_hidden_layers=4"):
        initialize_parallel(ParallelLayout(pp=3), cfg())
    assert not dist.is_initialized()


def test_the_actor_check_fills_in_this_machine(monkeypatch):
    """On a machine without CUDA (made so here, so that the test means the same on a GPU machine):
    MoE with PP is refused by the actor's check; sequence parallelism is not, Transformer Engine or
    not (the local spec's norms support it: megatron/spec.py); MoE with TP needs it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert validate_layout_here(ParallelLayout(tp=2), cfg(), world_size=2, sequence_parallel=True) == 1
    moe = family_config_from_hf(tiny_hf_config("qwen3_moe"), spec="local")
    with pytest.raises(ValueError, match=r"MoE with parallel.pp=2 does not run on CPU"):
        validate_layout_here(ParallelLayout(pp=2), moe, world_size=2)
    with pytest.raises(ValueError, match=r"MoE with parallel.tp=2 needs actor.sequence_parallel=true"):
        validate_layout_here(ParallelLayout(tp=2), moe, world_size=2)
    assert validate_layout_here(ParallelLayout(tp=2), moe, world_size=2, sequence_parallel=True) == 1
    assert validate_layout_here(ParallelLayout(ep=2), moe, world_size=4) == 4


def test_rollout_batch_fields_and_lengths():
    b = make_batch(3)
    assert b.response_len == 14
    lens = b.seq_lens()
    for i in range(b.batch_size):
        nz = torch.nonzero(b.response_mask[i])
        expect = int(b.prompt_lens[i]) + (int(nz.max()) + 1 if len(nz) else 0)
        assert int(lens[i]) == expect
    width = int(max(lens[2], lens[0]))
    sub = b.select([2, 0], max_len=width)
    assert sub.input_ids.shape == (2, width) and torch.equal(sub.advantages[1], b.advantages[0])
    halves = [b.split_for_data_parallel(r, 2) for r in range(2)]
    assert torch.equal(halves[0].input_ids, b.input_ids[0::2]) and torch.equal(halves[1].input_ids, b.input_ids[1::2])
    with pytest.raises(ValueError, match="advantages"):
        RolloutBatch(input_ids=b.input_ids, prompt_lens=b.prompt_lens, response_mask=b.response_mask,
                     advantages=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="prompt_lens >= 1"):
        RolloutBatch(input_ids=b.input_ids, prompt_lens=torch.zeros_like(b.prompt_lens),
                     response_mask=b.response_mask)


def test_token_budget_packing():
    lens = [5, 30, 7, 7, 12, 3, 40]
    plan = plan_micro_batches(lens, max_tokens_per_micro_batch=32)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lens)))  # every row once
    for mb in plan:
        assert padded_tokens(mb, lens) <= 32 or len(mb) == 1  # over-long rows travel alone
        assert [lens[i] for i in mb] == sorted((lens[i] for i in mb), reverse=True)
    assert [6] in plan and [1] in plan  # 40 > 32 alone; 30 cannot share (2*30 > 32)
    assert plan_micro_batches(lens, 10**6) == [sorted(range(7), key=lambda i: -lens[i])]


def test_balance_to_count_splits_then_pads():
    plan = [[0, 1, 2, 3], [4]]
    four = balance_to_count(plan, 4)
    assert len(four) == 4 and sorted(i for mb in four for i in mb) == [0, 1, 2, 3, 4]
    assert balance_to_count([[0]], 3) == [[0], [], []]
    with pytest.raises(ValueError):
        balance_to_count([[0], [1]], 1)


@pytest.mark.parametrize("style, expect", [
    ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.0, 0.5, 1.0, 0.7, 0.4, 0.1]),
    ("cosine", None),
])
def test_lr_schedule_warmup_and_decay(style, expect):
    from megatron_tepo.actor.actor import OptimConfig, build_lr_scheduler

    class FakeOptimizer:  # OptimizerParamScheduler only touches param_groups
        param_groups = [{"max_lr": 1.0, "min_lr": 0.1, "wd_mult": 1.0}]

    opt = FakeOptimizer()
    sched = build_lr_scheduler(opt, OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_steps=5,
                                                lr_decay_style=style))
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step(1)
    if expect is None:  # cosine: warmup, then from 1.0 down to min_lr along a half cosine
        assert lrs[:3] == [0.0, 0.5, 1.0] and lrs[3] > 0.7 and abs(lrs[5] - 0.1) < 1e-12
        assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    else:
        assert lrs == pytest.approx(expect)
    with pytest.raises(ValueError, match="lr_decay_style"):
        build_lr_scheduler(opt, OptimConfig(lr_decay_style="wsd"))
