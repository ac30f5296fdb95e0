"""Packed and padded micro-batches (token_layout.py), the packing plan, the sdpa core
attention on packed input, and the actor's settings checked before any process group starts."""
import pytest
import torch
import torch.distributed as dist

from megatron_tepo.actor.batching import plan_packed_micro_batches
from megatron_tepo.token_layout import build_micro_batch
from megatron_tepo.config import ActorConfig
from tests.megatron.helpers import make_batch, tiny_hf_config


def test_packed_plan_fills_the_budget_first_fit_decreasing():
    lens = [5, 30, 7, 7, 12, 3, 40, 2]
    plan = plan_packed_micro_batches(lens, max_tokens_per_micro_batch=32)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lens)))  # every row once
    assert [6] in plan  # 40 > 32 travels alone
    for mb in plan:
        assert sum(lens[i] for i in mb) <= 32 or len(mb) == 1
    # longest first, each into the first that has room: 12 + 7 + 7 + 5 = 31 leaves no room for the 3,
    # which opens a fourth; the 2 then fills 30 + 2 = 32 exactly
    assert plan == [[6], [1, 7], [4, 2, 3, 0], [5]]
    assert plan_packed_micro_batches(lens, 10**6) == [sorted(range(8), key=lambda i: -lens[i])]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_packed_micro_batches(lens, 0)


def test_packed_micro_batch_layout():
    b = make_batch(3)
    rows = [2, 0, 5]
    mb = build_micro_batch(b, rows, packed=True)
    lens = b.seq_lens()[rows].tolist()
    assert mb.packed and mb.shape == (1, sum(lens)) and mb.rows == rows
    assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert mb.max_seqlen == max(lens)
    start = 0
    for r, n in zip(rows, lens):  # each sequence's own tokens, positions from 0
        assert torch.equal(mb.input_ids[0, start:start + n], b.input_ids[r, :n])
        assert mb.position_ids[0, start:start + n].tolist() == list(range(n))
        start += n
    # every real response slot is scored by the position before its token, with that token as label
    for i, r in enumerate(rows):
        p = int(b.prompt_lens[r])
        for j in range(b.response_len):
            real = bool(b.response_mask[r, j]) and p + j < lens[i]
            assert bool(mb.valid[i, j]) == real
            if real:
                pos = int(mb.score_index[i, j])
                assert pos == int(mb.cu_seqlens[i]) + p + j - 1
                assert int(mb.labels[pos]) == int(b.input_ids[r, p + j])
    assert int(mb.valid.sum()) == int((b.response_mask[rows] != 0).sum())  # (holes stay out)


@pytest.mark.parametrize("packed", [True, False])
def test_a_rank_s_micro_batches_are_one_layout_call(packed):
    """token_layout.micro_batches: built at the SP multiple, padded to what the group's maximum
    answers (the caller's collective, here a stand-in asking for more), and with CP each rank's
    share of the group's size; without a group each micro-batch keeps its own shape."""
    from megatron_tepo.token_layout import micro_batches

    b = make_batch(3)
    plan = [[2, 0], [1]]
    asked = []

    def bigger(sizes):  # two more of each (a packed micro-batch's one row stays one)
        asked.append(sizes)
        return [[v if packed and len(row) == 2 and i == 0 else v + 2 for i, v in enumerate(row)] for row in sizes]

    own = micro_batches(b, plan, packed=packed, sp=2)
    assert [mb.rows for mb in own] == plan and all(mb.input_ids.shape[-1] % 2 == 0 for mb in own)
    grown = micro_batches(b, plan, packed=packed, sp=2, group_max=bigger)
    assert asked == [[list(mb.shape) for mb in own]]
    if packed:  # one row: a pad segment to the group's length
        assert [mb.shape[1] for mb in grown] == [mb.shape[1] + 2 for mb in own]
    else:  # dummy rows and pad columns
        assert [mb.shape for mb in grown] == [(r + 2, n + 2) for r, n in (mb.shape for mb in own)]
    assert [int(mb.valid.sum()) for mb in grown] == [int(mb.valid.sum()) for mb in own]  # scores the same slots
    if packed:  # context parallelism: each rank's share of the group's tokens
        asked.clear()
        shards = [micro_batches(b, plan, packed=True, sp=2, cp=2, cp_rank=r, group_max=bigger) for r in (0, 1)]
        local = [t for (t,) in asked[0]]
        assert [mb.input_ids.shape[1] for mb in shards[0]] == [t + 2 for t in local] == \
            [mb.input_ids.shape[1] for mb in shards[1]]


def test_padded_micro_batch_layout_scores_the_same_tokens():
    b = make_batch(3)
    rows = [1, 4]
    packed = build_micro_batch(b, rows, packed=True)
    padded = build_micro_batch(b, rows, packed=False)
    assert padded.cu_seqlens is None and padded.shape == (2, int(b.seq_lens()[rows].max()))
    assert torch.equal(packed.valid, padded.valid)
    flat_p, flat_q = packed.input_ids.reshape(-1), padded.input_ids.reshape(-1)
    v = packed.valid
    # the same labels at the scored positions, and the token before each is the same token
    assert torch.equal(packed.labels[packed.score_index[v]], padded.labels[padded.score_index[v]])
    assert torch.equal(flat_p[packed.score_index[v]], flat_q[padded.score_index[v]])


@pytest.mark.parametrize("packed", [True, False])
def test_the_head_runs_at_the_scored_positions_only(packed):
    """``scored_index``: one entry per valid response slot, the flat position that scores it (the
    token before it) and its slot; no prompt or padding position, and the same once staged."""
    batch = make_batch(seed=3)
    mb = build_micro_batch(batch, list(range(batch.batch_size)), packed=packed)
    positions, slots = mb.scored_index()
    assert int(mb.valid.sum()) == len(positions) == len(slots) > 0
    assert torch.equal(positions, mb.score_index.reshape(-1)[slots]) and bool(mb.valid.reshape(-1)[slots].all())
    flat_ids = mb.input_ids.reshape(-1)
    # the label a scored position carries is the next token of the sequence, a response token
    assert torch.equal(mb.labels[positions], flat_ids[positions + 1])
    assert len(positions) < mb.input_ids.numel() - batch.batch_size  # prompts are never scored
    staged = mb.staged(torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(staged.scored, (positions, slots)))


def test_pad_segment_and_common_shapes():
    b = make_batch(3)
    mb = build_micro_batch(b, [0, 1, 2], packed=True, pad_multiple=8)
    t = int(b.seq_lens()[[0, 1, 2]].sum())
    assert mb.shape[1] % 8 == 0 and mb.shape[1] - t < 8
    if mb.shape[1] > t:  # a sequence of its own: no real token attends to it, nothing scores it
        assert mb.cu_seqlens.tolist()[-2:] == [t, mb.shape[1]]
        assert mb.position_ids[0, t:].tolist() == list(range(mb.shape[1] - t))
    grown = mb.padded_to(1, mb.shape[1] + 5)
    assert grown.shape == (1, mb.shape[1] + 5) and int(grown.cu_seqlens[-1]) == mb.shape[1] + 5
    assert torch.equal(grown.score_index, mb.score_index) and torch.equal(grown.labels[: mb.shape[1]], mb.labels)
    padded = build_micro_batch(b, [0, 1], packed=False).padded_to(3, 40)
    assert padded.shape == (3, 40) and padded.data.batch_size == 3 and not padded.valid[2].any()
    assert torch.equal(padded.valid[:2], build_micro_batch(b, [0, 1], packed=False).valid)
    dummy = build_micro_batch(b, [], packed=True)
    assert dummy.rows == [] and not dummy.valid.any() and dummy.shape == (1, 1)


def test_sdpa_core_attention_packed_equals_one_sequence_at_a_time():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tepo.megatron.attention import SDPACoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0, use_cpu_initialization=True)
    attn = SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9]
    q = torch.randn(sum(lens), 4, 8, generator=g)
    k, v = torch.randn(sum(lens), 2, 8, generator=g), torch.randn(sum(lens), 2, 8, generator=g)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    out = attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                                cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9))
    assert out.shape == (15, 32)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each sequence alone, [s, b=1, h, d]
        alone = attn(q[a:b, None], k[a:b, None], v[a:b, None], None)
        assert torch.allclose(out[a:b], alone[:, 0], atol=1e-6)
    # the reference: softmax(q k^T / sqrt(d) + causal) v with each KV head serving 2 query heads
    a, b = 6, 15
    kk, vv = k[a:b].repeat_interleave(2, dim=1), v[a:b].repeat_interleave(2, dim=1)
    scores = torch.einsum("shd,thd->hst", q[a:b], kk) / 8 ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(9, 9, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("hst,thd->shd", scores.softmax(-1), vv).reshape(9, 32)
    assert torch.allclose(out[a:b], ref, atol=1e-5)
    with pytest.raises(NotImplementedError, match="attention_dropout"):
        SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self", attention_dropout=0.1)


def test_settings_are_checked_before_any_process_group():
    from megatron_tepo.actor.actor import plan_actor
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.resolve import resolve_actor_config

    hf = tiny_hf_config("qwen3")
    with pytest.raises(ValueError, match="pack_sequences=true needs actor.attention sdpa or te"):
        plan_actor(hf, ParallelLayout(), attention="unfused", world_size=1)
    with pytest.raises(ValueError, match="actor.attention: te needs Transformer Engine"):
        plan_actor(hf, ParallelLayout(), attention="te", world_size=1)
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['precison'\]"):
        plan_actor(hf, ParallelLayout(), precison="bf16", world_size=1)
    with pytest.raises(ValueError, match=r"sequence_parallel=true needs parallel.tp > 1"):
        plan_actor(hf, ParallelLayout(), sequence_parallel=True, world_size=1)
    # (sequence parallelism needs no Transformer Engine: the local spec's norms run it, megatron/spec.py)
    assert plan_actor(hf, ParallelLayout(tp=2), sequence_parallel=True, world_size=2)[0].sequence_parallel
    settings, fam = plan_actor(hf, ParallelLayout(), ActorConfig(recompute="full"), world_size=1,
                               pack_sequences=False)
    assert (settings.attention, settings.recompute, settings.pack_sequences, fam.spec) == ("sdpa", "full", False, "local")
    assert resolve_actor_config(ActorConfig(), cuda=True, te=True).attention == "te"
    assert resolve_actor_config(ActorConfig(), cuda=True, te=True).fusions == "on"
    assert resolve_actor_config(ActorConfig(), cuda=False, te=False).fusions == "off"
    assert not dist.is_initialized()


@pytest.mark.parametrize("size", [2, 3])
def test_a_context_shard_scores_every_slot_on_one_rank_with_the_whole_layouts_labels(size):
    """``MicroBatch.context_shard``: the ranks' parts score every valid slot once, each against the
    label of the whole layout, from the same token at its true position (a chunk's last token is
    scored against the next chunk's first, held by another rank)."""
    batch = make_batch(seed=5)
    mb = build_micro_batch(batch, list(range(batch.batch_size)), packed=True, pad_multiple=4)
    positions, slots = mb.scored_index()
    want = {int(s): (int(mb.labels[p]), int(mb.input_ids[0, p]), int(mb.position_ids[0, p]))
            for p, s in zip(positions, slots)}
    got, crossing = {}, 0
    parts = [mb.context_shard(size, r) for r in range(size)]
    assert len({part.input_ids.shape for part in parts}) == 1  # the same work on every rank
    for part in parts:
        assert part.cu_seqlens[-1] == part.input_ids.shape[1] and part.max_seqlen > 0
        p_local, s_local = part.scored_index()
        for p, s in zip(p_local.tolist(), s_local.tolist()):
            assert s not in got  # one rank scores a slot
            got[s] = (int(part.labels[p]), int(part.input_ids[0, p]), int(part.position_ids[0, p]))
            # the label is the next token of the sequence: on this rank only when the next position is
            nxt = p + 1 < part.input_ids.shape[1] and part.position_ids[0, p + 1] == part.position_ids[0, p] + 1
            crossing += not nxt
    assert got == want
    assert crossing > 0  # some scored tokens' labels lie in a chunk another rank holds
    with pytest.raises(ValueError, match="packed micro-batches"):
        build_micro_batch(batch, [0, 1], packed=False).context_shard(2, 0)


def test_a_token_whose_label_lies_in_the_next_chunk_is_scored_right():
    """One 8-token sequence (2 prompt, 6 response tokens) at CP=2: chunks of 2 tokens, rank 0 holds
    chunks 0 and 3 (positions 0, 1, 6, 7), rank 1 chunks 1 and 2 (positions 2-5). Position 1 ends
    rank 0's first chunk and scores the token at position 2, which rank 1 holds; position 5 ends
    rank 1's part and scores position 6, on rank 0. Each is scored by the rank that holds it,
    against the next token of the whole sequence, never a roll of its own chunk (verl PR #4250's
    bug); the ranks' own chunks restart nothing: positions stay true."""
    from megatron_tepo.batch import RolloutBatch

    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18]])
    batch = RolloutBatch(input_ids=ids, prompt_lens=torch.tensor([2]), response_mask=torch.ones(1, 6))
    mb = build_micro_batch(batch, [0], packed=True)
    rank0, rank1 = mb.context_shard(2, 0), mb.context_shard(2, 1)
    assert rank0.input_ids.tolist() == [[11, 12, 17, 18]] and rank0.position_ids.tolist() == [[0, 1, 6, 7]]
    assert rank1.input_ids.tolist() == [[13, 14, 15, 16]] and rank1.position_ids.tolist() == [[2, 3, 4, 5]]
    scored = {}
    for rank, part in enumerate((rank0, rank1)):
        for p, slot in zip(*(t.tolist() for t in part.scored_index())):
            scored[slot] = (rank, int(part.position_ids[0, p]), int(part.labels[p]))
    # response slot j is the token at position 2 + j, scored by the output at position 1 + j
    assert scored[0] == (0, 1, 13)  # position 1 (rank 0) scores position 2's token, held by rank 1
    assert scored[4] == (1, 5, 17)  # position 5 (rank 1) scores position 6's token, held by rank 0
    assert scored == {j: (0 if j in (0, 5) else 1, 1 + j, 13 + j) for j in range(6)}
    # the whole micro-batch's padded boundaries, for RoPE and Transformer Engine
    assert rank0.cp_cu_seqlens.tolist() == [0, 8] and rank0.cp_max_seqlen == 8


def test_context_parallel_padding_and_the_gather_back():
    """``with_context_tokens`` adds a pad segment so each CP rank's share is a multiple of the
    sequence-parallel split (or another rank's size), and ``context_gather`` puts every rank's
    per-token values back in the whole packed layout."""
    batch = make_batch(seed=3)
    mb = build_micro_batch(batch, list(range(batch.batch_size)), packed=True)
    total = mb.input_ids.shape[1]
    have = mb.context_tokens(2)
    assert have % 2 == 0 and have * 2 >= total
    grown = mb.with_context_tokens(2, tokens=have + 6, multiple=4)
    assert grown.context_tokens(2) % 4 == 0 and have + 6 <= grown.context_tokens(2) < have + 6 + 4
    assert grown.input_ids.shape[1] > total and grown.cu_seqlens[-2] == total  # one pad segment after
    assert mb.with_context_tokens(2) is mb
    parts = [grown.context_shard(2, r) for r in range(2)]
    assert [p.input_ids.shape[1] for p in parts] == [grown.context_tokens(2)] * 2
    back = grown.context_shard(2, 0).context_gather([p.input_ids[0] for p in parts])
    assert torch.equal(back, grown.input_ids[0])
