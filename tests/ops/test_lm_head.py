"""Tests of megatron_tepo.ops.lm_head_log_probs_and_entropy: the fused LM head against float64
torch (gradcheck included) and against the materialized path (the logits, then the vocab op), the
bytes it holds, its Triton path under Triton's interpreter, and TP=2 via torchrun."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tepo.ops import vocab_parallel_log_probs_and_entropy as vop
from megatron_tepo.ops.lm_head import default_block_size, lm_head_log_probs_and_entropy as head
from tests.dist_utils import torchrun

WORKER = Path(__file__).with_name("lm_head_worker.py")
REPO = Path(__file__).resolve().parents[2]


def reference(hidden, weight, labels, temperature=1.0):
    """Plain float64 torch: the full logits, log_softmax and the entropy."""
    lp = ((hidden.double() @ weight.double().t()) / temperature).log_softmax(-1)
    return lp.gather(-1, labels[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


def _inputs(n=23, h=12, v=70, dtype=torch.float64, seed=0, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64) * spread).to(dtype)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[0], labels[1] = 0, v - 1  # the first and the last block own a label
    g1 = torch.randn(n, generator=g, dtype=torch.float64)
    g2 = torch.randn(n, generator=g, dtype=torch.float64)
    return hidden, weight, labels, g1, g2


def _run(fn, hidden, weight, labels, g1, g2, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = fn(h, w, labels, **kw)
    ((lp.double() * g1).sum() + (ent.double() * g2).sum()).backward()
    return lp, ent, h.grad, w.grad


def _materialized(h, w, labels, temperature=1.0, **_):
    return vop(h @ w.t(), labels, temperature=temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("block", [1, 7, 32, 70, None])
def test_gradcheck_and_float64_reference(temperature, block):
    hidden, weight, labels, g1, g2 = _inputs()
    lp, ent, gh, gw = _run(head, hidden, weight, labels, g1, g2, temperature=temperature, block_size=block)
    r = _run(reference, hidden, weight, labels, g1, g2, temperature=temperature)
    assert lp.dtype == ent.dtype == torch.float64
    for got, want in zip((lp, ent, gh, gw), r):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    h, w = hidden[:5].clone().requires_grad_(), weight[:30].clone().requires_grad_()
    lab = labels[:5] % 30
    assert torch.autograd.gradcheck(lambda a, b: head(a, b, lab, temperature=temperature, block_size=block),
                                    (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("use", ["lp", "ent"])
def test_one_output_unused(use):
    hidden, weight, labels, g1, g2 = _inputs(seed=1)
    g1, g2 = (g1, g2 * 0) if use == "lp" else (g1 * 0, g2)
    got = _run(head, hidden, weight, labels, g1, g2, block_size=16)
    want = _run(reference, hidden, weight, labels, g1, g2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_float32_equals_the_materialized_path_and_float64(temperature):
    """fp32: log-probs, entropy and both gradients as close to float64 as the logits + vocab op's
    (within twice their error, or fp32 rounding: at T = 0.6 the log-sum-exp is ~120, whose last
    fp32 unit, 7.6e-6, moves every p by that share), and within fp32 rounding of float64."""
    hidden, weight, labels, g1, g2 = _inputs(n=40, h=16, v=300, dtype=torch.float32, seed=2)
    fused = _run(head, hidden, weight, labels, g1, g2, temperature=temperature, block_size=64)
    mat = _run(_materialized, hidden, weight, labels, g1, g2, temperature=temperature)
    ref = _run(reference, hidden.double(), weight.double(), labels, g1, g2, temperature=temperature)
    assert fused[0].dtype == torch.float32 and fused[2].dtype == fused[3].dtype == torch.float32
    for f, m, r in zip(fused, mat, ref):
        scale = max(float(r.abs().max()), 1.0)
        err_f, err_m = (float((x.double() - r).abs().max()) for x in (f, m))
        assert err_f <= max(2 * err_m, 5e-6 * scale), (err_f, err_m)
        assert err_f <= 1e-5 * scale


def test_bf16_equals_the_materialized_path_within_bf16_rounding():
    """bf16 inputs: fp32 outputs, bf16 gradients; the logits are the same bf16 numbers, the
    gradients agree within bf16 rounding (the hidden states' is summed over blocks in fp32)."""
    hidden, weight, labels, g1, g2 = _inputs(n=40, h=16, v=300, dtype=torch.bfloat16, seed=3)
    fused = _run(head, hidden, weight, labels, g1, g2, temperature=0.8, block_size=64)
    mat = _run(_materialized, hidden, weight, labels, g1, g2, temperature=0.8)
    assert fused[0].dtype == fused[1].dtype == torch.float32
    assert fused[2].dtype == fused[3].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], mat[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(fused[1], mat[1], rtol=0, atol=1e-5)
    for f, m in zip(fused[2:], mat[2:]):
        assert float((f.float() - m.float()).abs().max()) <= 2 ** -7 * float(m.float().abs().max())


def test_extreme_logits_stay_finite_and_accurate():
    hidden, weight, labels, g1, g2 = _inputs(n=9, h=4, v=50, seed=4, spread=300.0)
    got = _run(head, hidden, weight, labels, g1, g2, block_size=8)
    want = _run(reference, hidden, weight, labels, g1, g2)
    for a, b in zip(got, want):
        assert bool(torch.isfinite(a).all())
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op creates (what the head holds at its peak, at most
    twice that at once)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tensor_of_the_logits_size_exists_and_only_vectors_are_saved():
    """The forward and backward create no tensor larger than one block of logits or the weight's
    gradient; saved for backward: the inputs by reference, the labels and two [n] vectors."""
    n, h, v = 256, 8, 4096
    hidden, weight, labels, g1, g2 = _inputs(n=n, h=h, v=v, dtype=torch.float32, seed=5)
    block = default_block_size(n, v, 4)
    assert block == 128 and block * 32 <= v  # (1/32 of the logits, at least 128 columns)
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with _Largest() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = head(hh, ww, labels)
        ((lp * g1.float()).sum() + (ent * g2.float()).sum()).backward()
    assert mode.numel <= max(n * block, v * h)
    assert mode.numel < n * v / 16
    big = [t for t in saved if t.numel() > n]
    assert [t.data_ptr() for t in big] == [hh.data_ptr(), ww.data_ptr()]
    want = _run(reference, hidden, weight, labels, g1, g2)[2]
    assert float((hh.grad - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_default_block_size():
    assert default_block_size(8192, 151936, 4) == 4736  # 1/32 of the shard, a multiple of 128
    assert default_block_size(131072, 151936, 2) == 1024  # 256 MiB
    assert default_block_size(10, 151936, 2) == 4736
    assert default_block_size(1 << 20, 151936, 2) == 128  # at least 128 columns
    assert default_block_size(4, 100, 4) == 100 and default_block_size(4, 16, 2) == 16


def test_the_fit_check_prices_the_blocks_the_head_takes():
    """launch/memory.py (torch-free) repeats the block rule: the two agree everywhere."""
    from megatron_tepo.launch.memory import fused_block_columns

    for tokens in (1, 100, 4096, 8192, 16384, 131072, 1 << 20):
        for vocab in (16, 128, 129, 1000, 37984, 75968, 151936):
            for elem in (2, 4):
                assert fused_block_columns(tokens, vocab, elem) == default_block_size(tokens, vocab, elem)


def test_no_tokens_gives_empty_outputs_and_zero_gradients():
    h = torch.randn(0, 4, requires_grad=True)
    w = torch.randn(10, 4, requires_grad=True)
    lp, ent = head(h, w, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert w.grad is not None and float(w.grad.abs().sum()) == 0.0


def test_bad_inputs_raise_value_error_naming_the_argument():
    h, w, lab = torch.randn(3, 4), torch.randn(10, 4), torch.tensor([1, 2, 3])
    for kwargs, name in [
        (dict(hidden=torch.randn(3)), "hidden"), (dict(weight=torch.randn(10, 5)), "weight"),
        (dict(weight=w.double()), "weight"), (dict(labels=torch.tensor([1.0, 2.0, 3.0])), "labels"),
        (dict(labels=torch.tensor([1, 2])), "labels"), (dict(labels=torch.tensor([1, 2, 10])), "labels"),
        (dict(temperature=0.0), "temperature"), (dict(block_size=0), "block_size"),
    ]:
        args = {**dict(hidden=h, weight=w, labels=lab), **kwargs}
        with pytest.raises(ValueError, match=name):
            head(**args)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (dev extra)")
def test_triton_path_under_the_interpreter_equals_float64():
    """The per-block statistics and gradients through the vocab op's Triton kernels (the GPU
    path), run by Triton's interpreter in a child process, against float64 torch."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(REPO)!r})
sys.path.insert(0, {str(REPO / 'tests' / 'ops')!r})
import megatron_tepo.ops.vocab_triton as vt
from megatron_tepo.ops.lm_head import lm_head_log_probs_and_entropy as head
from test_lm_head import _inputs, _run, reference
assert vt.INTERPRETED
vt.MAX_BLOCK_V = 32
hidden, weight, labels, g1, g2 = _inputs(n=9, h=8, v=100, dtype=torch.float32, seed=6)
got = _run(head, hidden, weight, labels, g1, g2, temperature=0.7, block_size=48, impl="triton")
want = _run(reference, hidden, weight, labels, g1, g2, temperature=0.7)
err = max(float((a.double() - b).abs().max()) / max(float(b.abs().max()), 1.0) for a, b in zip(got, want))
print("ERR", err)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = float(proc.stdout.split("ERR")[-1])
    assert err <= 2e-5


@pytest.mark.distributed
def test_tp2_matches_the_full_vocabulary_reference(tmp_path):
    """Each of 2 ranks holds half the output weight: outputs on both, the hidden states' gradient
    summed over the ranks, and each rank's weight-shard gradient against float64 torch."""
    results = torchrun(WORKER, 2, tmp_path=tmp_path, timeout=180)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert sorted(r["cases"]) == ["f32_blocks", "f64_blocks", "f64_one_block"]
        for name, c in r["cases"].items():
            tol = 2e-5 if name.startswith("f32") else 1e-10
            for key in ("lp", "ent", "grad_hidden", "grad_weight"):
                assert c[key] <= tol, (r["rank"], name, key, c)
            assert c["weight_grad_scale"] > 0 and c["owned_labels"] > 0, (r["rank"], name, c)
