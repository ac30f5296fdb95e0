"""Tests of megatron_tepo.ops.vocab_parallel_log_probs_and_entropy (TP=1 here, TP=2 via torchrun)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_tepo.ops import default_chunk_size, vocab_parallel_log_probs_and_entropy as vp
from tests.dist_utils import torchrun

WORKER = Path(__file__).with_name("vocab_parallel_worker.py")


def reference(logits, labels, temperature=1.0):
    lp = (logits.double() / temperature).log_softmax(-1)
    return lp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)


def _grads(fn, logits, labels, g1, g2, **kw):
    x = logits.detach().clone().requires_grad_()
    logp, ent = fn(x, labels, **kw)
    loss = 0
    if g1 is not None:
        loss = loss + (logp.double() * g1).sum()
    if g2 is not None:
        loss = loss + (ent.double() * g2).sum()
    loss.backward()
    return logp, ent, x.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [2, 3, 7, 100, None])
def test_gradcheck_float64(temperature, chunk_size):
    x = (torch.randn(7, 11, dtype=torch.float64) * 2).requires_grad_()
    labels = torch.randint(0, 11, (7,))
    logp, ent = vp(x, labels, temperature=temperature, chunk_size=chunk_size)
    r_logp, r_ent = reference(x.detach(), labels, temperature)
    assert logp.dtype == ent.dtype == torch.float64
    torch.testing.assert_close(logp, r_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, r_ent, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda z: vp(z, labels, temperature=temperature, chunk_size=chunk_size), (x,),
        eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
@pytest.mark.parametrize("chunk_size", [3, 5, None])
def test_leading_dims_match_reference_forward_and_backward(temperature, chunk_size):
    s, b, v = 3, 4, 9
    x = torch.randn(s, b, v, dtype=torch.float64) * 3
    labels = torch.randint(0, v, (s, b))
    g1, g2 = torch.randn(s, b, dtype=torch.float64), torch.randn(s, b, dtype=torch.float64)
    logp, ent, grad = _grads(vp, x, labels, g1, g2, temperature=temperature, chunk_size=chunk_size)
    r_logp, r_ent, r_grad = _grads(reference, x, labels, g1, g2, temperature=temperature)
    assert logp.shape == ent.shape == (s, b)
    torch.testing.assert_close(logp, r_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, r_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, r_grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda z: vp(z, labels, temperature=temperature, chunk_size=chunk_size),
        (x.clone().requires_grad_(),), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("use", ["logp", "ent"])
def test_backward_with_one_output_unused(use):
    x = torch.randn(6, 13, dtype=torch.float64)
    labels = torch.randint(0, 13, (6,))
    g = torch.randn(6, dtype=torch.float64)
    g1, g2 = (g, None) if use == "logp" else (None, g)
    _, _, grad = _grads(vp, x, labels, g1, g2, temperature=0.8, chunk_size=4)
    _, _, r_grad = _grads(reference, x, labels, g1, g2, temperature=0.8)
    torch.testing.assert_close(grad, r_grad, rtol=0, atol=1e-12)


def test_float32_matches_float64_reference():
    x = torch.randn(37, 301) * 4
    labels = torch.randint(0, 301, (37,))
    g1, g2 = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    logp, ent, grad = _grads(vp, x, labels, g1, g2, chunk_size=8, temperature=0.9)
    r_logp, r_ent, r_grad = _grads(reference, x.double(), labels, g1, g2, temperature=0.9)
    assert logp.dtype == ent.dtype == grad.dtype == torch.float32
    torch.testing.assert_close(logp.double(), r_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), r_grad, rtol=0, atol=1e-5)


def test_bf16_logits_give_fp32_outputs_and_bf16_grads():
    x = (torch.randn(2, 5, 257) * 3).bfloat16()
    labels = torch.randint(0, 257, (2, 5))
    g1, g2 = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    logp, ent, grad = _grads(vp, x, labels, g1, g2, temperature=0.7, chunk_size=3)
    r_logp, r_ent, r_grad = _grads(reference, x.float(), labels, g1, g2, temperature=0.7)
    assert logp.dtype == ent.dtype == torch.float32
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp.double(), r_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent, rtol=0, atol=1e-5)
    # the gradient is exact in fp32 and then rounded to bf16 (relative eps 2^-8)
    torch.testing.assert_close(grad.double(), r_grad.double(), rtol=2 ** -8, atol=1e-6)


def test_extreme_logits_are_finite_and_accurate():
    x = torch.randn(9, 50, dtype=torch.float64) * 1e4        # spread ~ 1e4
    x[0, 3] = 1e4
    x[1] = 0.0
    x[1, 7] = 1e4                                          # one dominant token
    labels = torch.randint(0, 50, (9,))
    labels[1] = 7
    g1, g2 = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    for dtype, tol in [(torch.float64, 1e-9), (torch.float32, 2e-3)]:
        logp, ent, grad = _grads(vp, x.to(dtype), labels, g1, g2, chunk_size=4)
        r_logp, r_ent, r_grad = _grads(reference, x.to(dtype), labels, g1, g2)
        for t in (logp, ent, grad):
            assert torch.isfinite(t).all()
        assert (ent >= -tol).all()
        torch.testing.assert_close(logp.double(), r_logp, rtol=1e-6, atol=tol)
        torch.testing.assert_close(ent.double(), r_ent, rtol=0, atol=tol)
        torch.testing.assert_close(grad.double(), r_grad.double(), rtol=0, atol=tol)


def test_non_contiguous_inputs_and_input_not_modified():
    base = torch.randn(4, 3, 20, dtype=torch.float64)
    labels = torch.randint(0, 16, (3, 4))
    g1, g2 = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    # [b, s, V] -> [s, b, V] (not flattenable without a copy), a vocab slice of a contiguous
    # tensor (a view with row stride 20) and a layout whose vocab dim has stride != 1
    vocab_last_strided = torch.randn(16, 3, 4, dtype=torch.float64).permute(1, 2, 0)
    assert vocab_last_strided.stride(-1) != 1
    for x in (base.transpose(0, 1)[..., :16], base.transpose(0, 1).contiguous()[..., :16],
              vocab_last_strided):
        leaf = x.detach().requires_grad_()
        before = leaf.detach().clone()
        logp, ent = vp(leaf, labels, chunk_size=5)
        ((logp * g1) + (ent * g2)).sum().backward()
        assert torch.equal(leaf.detach(), before)
        r_logp, r_ent, r_grad = _grads(reference, before, labels, g1, g2)
        torch.testing.assert_close(logp, r_logp, rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, r_ent, rtol=0, atol=1e-12)
        torch.testing.assert_close(leaf.grad, r_grad, rtol=0, atol=1e-12)


def test_saves_only_logits_by_reference_labels_and_token_vectors():
    x = torch.randn(10, 33, requires_grad=True)
    labels = torch.randint(0, 33, (10,))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = vp(x, labels, chunk_size=3)
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()   # the logits, not a copy
    assert all(t.numel() <= 10 for t in saved if t is not big[0])
    assert len(saved) == 4


def test_empty_tokens():
    x = torch.randn(0, 5, requires_grad=True)
    logp, ent = vp(x, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert x.grad.shape == (0, 5)


def test_default_chunk_size():
    # 4096 x 32768 fp32 on CPU: 4 MiB cap -> 32 tokens; always <= 1/8 of the shard, >= 1
    assert default_chunk_size(4096, 32768, torch.device("cpu")) == 32
    assert default_chunk_size(4096, 32768, torch.device("cuda")) == 512   # 64 MiB cap
    assert default_chunk_size(64, 1000, torch.device("cuda")) == 8         # shard / 8
    assert default_chunk_size(7, 11, torch.device("cpu")) == 1
    assert default_chunk_size(3, 10**8, torch.device("cpu")) == 1


def test_bad_inputs_raise_value_error_naming_the_argument():
    x = torch.randn(4, 6)
    labels = torch.randint(0, 6, (4,))
    with pytest.raises(ValueError, match="labels"):
        vp(x, labels[:3])
    with pytest.raises(ValueError, match="labels"):
        vp(x, labels.view(4, 1))
    with pytest.raises(ValueError, match="labels"):
        vp(x, labels.float())
    with pytest.raises(ValueError, match="labels"):
        vp(x, labels.bool())
    with pytest.raises(ValueError, match="labels"):
        vp(x, torch.full((4,), 6))                 # out of range
    with pytest.raises(ValueError, match="labels"):
        vp(x, torch.full((4,), -1))
    for t in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            vp(x, labels, temperature=t)
    for c in (0, -2, 1.5):
        with pytest.raises(ValueError, match="chunk_size"):
            vp(x, labels, chunk_size=c)
    with pytest.raises(ValueError, match="logits"):
        vp(torch.ones(4, 6, dtype=torch.long), labels)


@pytest.mark.distributed
def test_tp2_matches_full_vocab_reference(tmp_path):
    results = torchrun(WORKER, 2, tmp_path=tmp_path, timeout=120)
    assert [r.get("rank") for r in results] == [0, 1]
    for r in results:
        cases = r["cases"]
        assert len(cases) == 7
        for name, c in cases.items():
            tol = 1e-5 if name.startswith("f32") else 1e-10
            if name == "f64_extreme":
                tol = 1e-9
            assert c["finite"], name
            assert c["input_unchanged"], name
            assert c["logp_err"] <= tol, (r["rank"], name, c)
            assert c["ent_err"] <= tol, (r["rank"], name, c)
            assert c["grad_err"] <= tol, (r["rank"], name, c)
            assert c["grad_scale"] > 0, name                      # the shard got a real gradient
        assert cases["f32_temp_chunk7"]["out_dtype"] == "torch.float32"
        assert cases["f32_temp_chunk7"]["grad_dtype"] == "torch.float32"
        assert cases["f64_t1"]["out_dtype"] == "torch.float64"
