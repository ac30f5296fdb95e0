"""RoPE of packed sequences in one call (``ops/rope.py``, installed by ``megatron/fast_paths.py``)
against megatron-core's own per-sequence ``_apply_rotary_pos_emb_thd``: the same output and the same
input gradient, bit for bit, in fp32 and bf16; a rotary dimension smaller than the head; a single
sequence whose ``freqs`` holds one row per token; and a fixed number of ops whatever the number of
sequences."""
import pytest
import torch

from megatron_tepo.launch_costs import LaunchCounter
from megatron_tepo.megatron import fast_paths
from megatron_tepo.ops.rope import apply_packed_rope, packed_positions, packed_rope_tables


class _OneRank:  # megatron's THD RoPE asks its context-parallel group for size and rank
    def size(self):
        return 1

    def rank(self):
        return 0


class _Ranks:  # a context-parallel group of `size` ranks, seen from `rank`
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _megatron_thd():
    from megatron.core.models.common.embeddings import rope_utils

    fn = rope_utils._apply_rotary_pos_emb_thd
    return getattr(fn, "__wrapped__", fn)  # megatron's own, also where the fast path is in effect


def _freqs(rows: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    """megatron's RotaryEmbedding table: [rows, 1, 1, rot], the half-dim angles repeated."""
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    angles = torch.outer(torch.arange(rows, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _case(lengths, heads=3, dim=16, rot=16, dtype=torch.float32, freq_rows=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    t = torch.randn(total, heads, dim, generator=g).to(dtype).requires_grad_()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    grad = torch.randn(total, heads, dim, generator=g).to(dtype)
    return t, cu, _freqs(freq_rows or max(lengths), rot), grad


def _run(fn, t, grad):
    t = t.detach().requires_grad_()
    out = fn(t)
    out.backward(grad)
    return out.detach(), t.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths, rot", [([5, 1, 17, 9], 16), ([40], 16), ([3, 30, 2], 8)])
def test_equals_megatrons_per_sequence_path(lengths, rot, dtype):
    t, cu, freqs, grad = _case(lengths, rot=rot, dtype=dtype)
    ref = _run(lambda x: _megatron_thd()(x, cu, freqs, rotary_interleaved=False, cp_group=_OneRank()), t, grad)
    cos, sin = packed_rope_tables(cu, freqs, t.shape[0], dtype)
    ours = _run(lambda x: apply_packed_rope(x, cos, sin), t, grad)
    for name, a, b in zip(("output", "grad"), ours, ref):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b), (name, float((a.float() - b.float()).abs().max()))


def test_the_fast_path_keeps_megatrons_arguments_and_one_table_per_micro_batch():
    t, cu, freqs, grad = _case([6, 11, 3], dtype=torch.bfloat16)
    fn = fast_paths._rope_thd(_megatron_thd())
    fast_paths.ROPE_TABLES.clear()
    ref = _run(lambda x: _megatron_thd()(x, cu, freqs, rotary_interleaved=False, cp_group=_OneRank(), mscale=1.5), t, grad)
    ours = _run(lambda x: fn(x, cu, freqs, rotary_interleaved=False, cp_group=_OneRank(), mscale=1.5), t, grad)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    tables = fast_paths.ROPE_TABLES.get(cu, freqs, t.shape[0], t.dtype, 1.5)
    assert fast_paths.ROPE_TABLES.get(cu, freqs, t.shape[0], t.dtype, 1.5) is tables  # all layers share it
    assert len(fast_paths.ROPE_TABLES.entries) == 1
    # what the op leaves out goes to megatron's own path
    inter = _run(lambda x: fn(x, cu, freqs, rotary_interleaved=True, cp_group=_OneRank()), t, grad)
    want = _run(lambda x: _megatron_thd()(x, cu, freqs, rotary_interleaved=True, cp_group=_OneRank()), t, grad)
    assert all(torch.equal(a, b) for a, b in zip(inter, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_ranks_rotate_at_their_true_positions(cp, dtype):
    """Context parallelism (#44): each rank holds chunks r and 2 cp - 1 - r of every sequence (the
    whole micro-batch's padded boundaries in ``cu``); the fast path equals megatron's own
    per-sequence CP path bit for bit, and both equal rotating each token at its true position."""
    from megatron_tepo.token_layout import context_split

    lengths = [4 * cp, 2 * cp, 6 * cp]  # padded already: multiples of 2 cp
    _, cu, freqs, _ = _case(lengths, dtype=dtype)
    fn = fast_paths._rope_thd(_megatron_thd())
    for rank in range(cp):
        local = sum(lengths) // cp
        g = torch.Generator().manual_seed(rank)
        t = torch.randn(local, 3, 16, generator=g).to(dtype)
        grad = torch.randn(local, 3, 16, generator=g).to(dtype)
        ref = _run(lambda x: _megatron_thd()(x, cu, freqs, rotary_interleaved=False, cp_group=_Ranks(cp, rank)), t, grad)
        fast_paths.ROPE_TABLES.clear()
        ours = _run(lambda x: fn(x, cu, freqs, rotary_interleaved=False, cp_group=_Ranks(cp, rank)), t, grad)
        for name, a, b in zip(("output", "grad"), ours, ref):
            assert torch.equal(a, b), (rank, name, float((a.float() - b.float()).abs().max()))
        positions = context_split(torch.tensor(lengths), cp, rank).positions
        angles = freqs[positions].reshape(local, 1, -1)
        want = apply_packed_rope(t, torch.cos(angles).to(dtype), torch.sin(angles).to(dtype))
        assert torch.equal(ours[0], want)


def test_a_freqs_row_per_token_is_used_as_it_is():
    """megatron's "exact mapping" case: ``freqs`` with one row per packed token (what a single
    sequence gives: the table is as long as the sequence)."""
    t, cu, freqs, grad = _case([12], freq_rows=12)
    ref = _run(lambda x: _megatron_thd()(x, cu, freqs, rotary_interleaved=False, cp_group=_OneRank()), t, grad)
    cos, sin = packed_rope_tables(cu, freqs, 12, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(_run(lambda x: apply_packed_rope(x, cos, sin), t, grad), ref))


def test_positions_restart_in_every_sequence():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert packed_positions(cu, 8, torch.device("cpu")).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_ops_are_the_same_for_2_and_for_16_sequences():
    counts = []
    for lengths in ([128, 128], [16] * 16):
        t, cu, freqs, grad = _case(lengths)
        with LaunchCounter() as c:
            cos, sin = packed_rope_tables(cu, freqs, t.shape[0], t.dtype)
            apply_packed_rope(t, cos, sin).backward(grad)
        counts.append((c.ops, c.syncs))
    assert counts[0] == counts[1], counts
    assert counts[0][1] == 0  # nothing read on the host


def test_bad_tables_are_refused():
    t, cu, freqs, _ = _case([4, 4])
    cos, sin = packed_rope_tables(cu, freqs, 8, torch.float32)
    with pytest.raises(ValueError, match="rope tables for 8 tokens"):
        apply_packed_rope(t[:5], cos, sin)
