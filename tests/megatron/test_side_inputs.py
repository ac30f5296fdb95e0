"""The per-micro-batch side inputs (token_layout.py: SideInputs) and the routing field they carry
(``RolloutBatch.routed_experts``): laid out in megatron's token order for packed and padded
micro-batches (pad segments and dummy rows included), inverted back to rows, split for sequence
parallelism; the actor's routing-replay settings checked before any process group; nothing of it
built with replay off. No process group."""
import pytest
import torch
import torch.distributed as dist

from megatron_tepo.token_layout import build_micro_batch
from megatron_tepo.token_layout import SideInputs, positions_to_rows
from tests.megatron.helpers import make_batch, tiny_hf_config

LAYERS, TOPK, EXPERTS = 3, 2, 8


def _routed(batch):
    """``[B, L, LAYERS, TOPK]`` int32 whose every entry says where it came from (row, position,
    layer, slot as decimal digits), -1 past each row's tokens."""
    b, length = batch.input_ids.shape
    pos = torch.arange(length)[None, :, None, None]
    row = torch.arange(b)[:, None, None, None]
    layer = torch.arange(LAYERS)[None, None, :, None]
    slot = torch.arange(TOPK)[None, None, None, :]
    routed = (row * 100000 + pos * 100 + layer * 10 + slot).to(torch.int32)
    real = torch.arange(length)[None] < batch.seq_lens()[:, None]
    routed[~real] = -1
    return routed


def _expected_token_order(mb, routed):
    """[N, LAYERS, TOPK] by plain loops: packed -- the rows end to end, then -1; padded [b, S] --
    token n = s * b + r."""
    seq = mb.data.seq_lens()
    b, s = mb.shape
    out = torch.full((b * s, LAYERS, TOPK), -1, dtype=routed.dtype)
    if mb.packed:
        n = 0
        for i, row in enumerate(mb.rows):
            for p in range(int(seq[i])):
                out[n] = routed[row, p]
                n += 1
        return out
    for r, row in enumerate(mb.rows):
        for p in range(int(seq[r])):
            out[p * b + r] = routed[row, p]
    return out


@pytest.mark.parametrize("packed", [True, False])
def test_a_micro_batch_lays_out_its_routing_in_megatron_token_order(packed):
    batch = make_batch(3)
    batch.routed_experts = _routed(batch)
    rows = [2, 0, 5, 7]
    mb = build_micro_batch(batch, rows, packed=packed)
    assert mb.side is not None
    assert torch.equal(mb.side.routed_experts, _expected_token_order(mb, batch.routed_experts))
    # scored: every real position but each sequence's last
    seq = batch.seq_lens()[rows]
    assert int(mb.side.scored.sum()) == int((seq - 1).sum())
    # ... and back to the rows
    back = positions_to_rows(mb.side.routed_experts, width=batch.input_ids.shape[1], **mb.side_layout())
    assert torch.equal(back, batch.routed_experts[rows])
    # grown to a common shape (pad segment / dummy rows and columns): the real tokens keep theirs
    grown = mb.padded_to(1, mb.shape[1] + 5) if packed else mb.padded_to(mb.shape[0] + 2, mb.shape[1] + 3)
    assert grown.side.routed_experts.shape[0] == grown.input_ids.numel()
    assert torch.equal(grown.side.routed_experts, _expected_token_order(grown, batch.routed_experts))
    assert int(grown.side.scored.sum()) == int((seq - 1).sum())
    # staged: the side inputs travel with the micro-batch
    staged = grown.staged(torch.device("cpu"))
    assert torch.equal(staged.side.routed_experts, grown.side.routed_experts)


def test_without_routing_no_side_inputs_are_built():
    batch = make_batch(3)
    assert build_micro_batch(batch, [0, 1], packed=True).side is None
    assert build_micro_batch(batch, [0, 1], packed=False).padded_to(3, 40).side is None
    assert build_micro_batch(batch, [], packed=True).side is None


def test_a_dummy_micro_batch_carries_routing_that_needs_no_replay():
    batch = make_batch(3)
    batch.routed_experts = _routed(batch)
    mb = build_micro_batch(batch, [], packed=True)
    assert mb.side.routed_experts.shape == (1, LAYERS, TOPK) and int(mb.side.routed_experts.max()) == -1
    assert not bool(mb.side.scored.any())


def test_sequence_parallel_shard_is_a_contiguous_token_range():
    side = SideInputs(routed_experts=torch.arange(24).reshape(8, 3, 1), scored=torch.arange(8) % 2 == 0)
    parts = [side.shard(r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p.routed_experts for p in parts]), side.routed_experts)
    assert parts[1].scored.tolist() == [True, False]
    assert side.shard(0, 1) is side
    with pytest.raises(ValueError, match="do not split over 3"):
        side.shard(0, 3)


def test_routing_replay_settings_are_checked_before_any_process_group():
    from megatron_tepo.actor.actor import plan_actor
    from megatron_tepo.config import ConfigError
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.model import actor_transformer_config as tc

    dense = tiny_hf_config("qwen3")
    for mode in ("r2", "r3"):
        with pytest.raises(ConfigError, match=rf"^actor.routing_replay: {mode} replays MoE routing, and qwen3 is "
                                              r"a dense model"):
            plan_actor(dense, ParallelLayout(), routing_replay=mode, world_size=1)
    moe = tiny_hf_config("qwen3_moe")
    settings, fam = plan_actor(moe, ParallelLayout(), routing_replay="r3", world_size=1)
    assert tc(fam, ParallelLayout(), settings).moe_enable_routing_replay is True
    settings, fam = plan_actor(moe, ParallelLayout(), world_size=1)
    assert settings.routing_replay == "off"
    assert tc(fam, ParallelLayout(), settings).moe_enable_routing_replay is False  # off: megatron builds none
    assert not dist.is_initialized()


def test_replay_off_leaves_megatron_registry_alone():
    """``moe_enable_routing_replay`` False: megatron creates no RouterReplay, so its class-wide
    registry stays as it was (verl #7805: a registry touched with replay off)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.model import actor_transformer_config, plan_actor

    before = list(RouterReplay.global_router_replay_instances)
    settings, fam = plan_actor(tiny_hf_config("qwen3_moe"), ParallelLayout(), world_size=1)
    actor_transformer_config(fam, ParallelLayout(), settings)
    assert RouterReplay.global_router_replay_instances == before


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_context_split_gives_every_padded_token_to_one_rank_in_balanced_chunks(size):
    """Each sequence padded to a multiple of 2N and cut in 2N chunks; rank r holds chunks r and
    2N - 1 - r of every sequence, with their true positions; the ranks' tokens cover the padded
    layout once, and every rank holds as many tokens. Sequences shorter than 2N tokens included."""
    from megatron_tepo.token_layout import context_split

    lens = torch.tensor([7, 1, 12, 3])
    splits = [context_split(lens, size, r) for r in range(size)]
    padded = splits[0].padded_lens
    assert bool((padded % (2 * size) == 0).all()) and bool((padded >= lens).all())
    assert bool((padded - lens < 2 * size).all())
    covered = torch.cat([s.index for s in splits])
    assert sorted(covered.tolist()) == list(range(int(padded.sum())))
    assert len({len(s.index) for s in splits}) == 1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)[:-1]])
    for s in splits:
        assert s.cu_seqlens.dtype == torch.int32 and s.cu_seqlens[-1] == len(s.index)
        for i in range(len(lens)):
            c = int(padded[i]) // (2 * size)
            mine = s.index[s.cu_seqlens[i]:s.cu_seqlens[i + 1]] - starts[i]
            want = list(range(s.rank * c, (s.rank + 1) * c)) + list(range((2 * size - 1 - s.rank) * c,
                                                                            (2 * size - s.rank) * c))
            assert mine.tolist() == want
            assert s.positions[s.cu_seqlens[i]:s.cu_seqlens[i + 1]].tolist() == want


def test_the_context_split_cuts_every_field_in_one_place_and_keeps_labels_across_chunks():
    """``take`` slices any per-token field of the packed layout (a pad segment after the
    sequences is ignored); labels taken before the split keep, at a chunk's last token, the next
    chunk's first token, which another rank holds."""
    from megatron_tepo.token_layout import context_split

    lens = torch.tensor([8, 5])
    ids = torch.arange(100, 113)  # the two sequences' tokens end to end
    labels = torch.cat([ids[1:8], torch.tensor([0]), ids[9:13], torch.tensor([0])])  # next token, 0 at the end
    field = torch.cat([ids, torch.tensor([0, 0, 0])])  # a pad segment after them
    s0, s1 = context_split(lens, 2, 0), context_split(lens, 2, 1)
    got0, got1 = s0.take(field), s1.take(field)
    # sequence 0 (8 tokens, chunks of 2): rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert got0[:4].tolist() == [100, 101, 106, 107] and got1[:4].tolist() == [102, 103, 104, 105]
    # the last token of rank 0's first chunk (101) is scored against 102, rank 1's first token
    assert s0.take(labels)[1] == 102 == got1[0]
    # sequence 1 (5 tokens, padded to 8): rank 0's late chunk is padding
    assert got0[4:].tolist() == [108, 109, 0, 0] and got1[4:].tolist() == [110, 111, 112, 0]
    with pytest.raises(ValueError, match="the field has 12 tokens, the sequences 13"):
        s0.take(field[:12])
    with pytest.raises(ValueError, match="rank 2 of 2"):
        context_split(lens, 2, 2)
