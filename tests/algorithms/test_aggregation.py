"""Aggregation modes, the global normaliser, all-masked inputs."""
import pytest
import torch

from megatron_tepo.algorithms import AGG_MODES, aggregate, count_for_normalizer

NAN, INF = float("nan"), float("inf")
VALUES = [[1.0, 2.0, 3.0, NAN], [4.0, INF, -INF, NAN], [5.0, 6.0, 0.0, 0.0]]
MASK = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]


def _inputs():
    return torch.tensor(VALUES, requires_grad=True), torch.tensor(MASK, dtype=torch.bool)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 5 + 6) / 5),
        ("seq-mean-token-sum", ((1 + 2 + 3) + (5 + 6)) / 2),  # the empty row is not counted
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + (5 + 6) / 2) / 2),
    ],
)
def test_modes_hand_values_with_garbage_padding(mode, expected):
    values, mask = _inputs()
    out = aggregate(values, mask, mode)
    assert out.dim() == 0
    assert out.item() == pytest.approx(expected)
    out.backward()
    assert torch.isfinite(values.grad).all()
    assert (values.grad[~mask] == 0).all()


def test_float_mask_equals_bool_mask():
    values, mask = _inputs()
    for mode in AGG_MODES:
        assert aggregate(values, mask.float(), mode).item() == aggregate(values, mask, mode).item()


def test_normalizer_replaces_the_count():
    values, mask = _inputs()
    assert aggregate(values, mask, "token-mean", normalizer=10).item() == pytest.approx(17 / 10)
    assert aggregate(values, mask, "seq-mean-token-sum", normalizer=torch.tensor(4)).item() == pytest.approx(17 / 4)
    assert aggregate(values, mask, "seq-mean-token-mean", normalizer=4.0).item() == pytest.approx((2 + 5.5) / 4)
    with pytest.raises(ValueError, match="normalizer"):
        aggregate(values, mask, "token-mean", normalizer=-1.0)


def test_count_for_normalizer():
    mask = torch.tensor(MASK)
    assert count_for_normalizer(mask, "token-mean").item() == 5
    assert count_for_normalizer(mask, "seq-mean-token-sum").item() == 2
    assert count_for_normalizer(mask, "seq-mean-token-mean").item() == 2


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_normalizer_sum_to_whole(mode):
    torch.manual_seed(0)
    values = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(7, 5) > 0.4
    mask[2] = False
    whole = aggregate(values, mask, mode)
    (g_whole,) = torch.autograd.grad(whole, values)
    splits = [(0, 1), (1, 4), (4, 7)]
    norm = sum(count_for_normalizer(mask[a:b], mode) for a, b in splits)
    total = sum(aggregate(values[a:b], mask[a:b], mode, normalizer=norm) for a, b in splits)
    (g_parts,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(total, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_parts, g_whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("normalizer", [None, 0, torch.tensor(0)])
def test_all_masked_is_zero_with_grad_fn(mode, normalizer):
    values = torch.full((2, 3), NAN, requires_grad=True)
    out = aggregate(values, torch.zeros(2, 3, dtype=torch.bool), mode, normalizer=normalizer)
    assert out.item() == 0.0
    assert out.grad_fn is not None
    out.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))


def test_bf16_values_computed_in_fp32():
    out = aggregate(torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16), torch.ones(1, 2), "token-mean")
    assert out.dtype == torch.float32 and out.item() == 1.5


def test_errors():
    values, mask = _inputs()
    with pytest.raises(ValueError, match="token-avg"):
        aggregate(values, mask, "token-avg")
    with pytest.raises(ValueError, match=r"\(3, 3\)"):
        aggregate(values[:, :3], mask, "token-mean")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        count_for_normalizer(mask, "nope")
