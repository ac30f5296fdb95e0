"""Tests of megatron_tepo.ops.lm_head_log_probs_and_entropy: the fused LM head against float64
torch (gradcheck included) and against the materialized path (the logits, then the vocab op), the
bytes it holds and allocates (nothing per vocabulary block: issue #50 row 6), what its GPU path
launches a block, its Triton path under Triton's interpreter, and TP=2 via torchrun."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_tepo.ops import vocab_parallel_log_probs_and_entropy as vop
from megatron_tepo.ops import lm_head as lm_head_mod
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


class _Held(TorchDispatchMode):
    """The bytes of the tensors ops create, tracked by storage: a storage is created by an op when
    none of the op's tensor arguments has it (views, ``out=`` and in-place ops create nothing), and
    held until only this mode refers to it (``_storage_Use_Count``). ``peak``: the most held at
    once; ``created``: the sum of all created; both counting only tensors of more than
    ``min_numel`` elements (the per-token ``[n]`` vectors left out)."""

    def __init__(self, min_numel: int = 0):
        super().__init__()
        self.min_numel = min_numel
        self.live = []  # storages (held here, so their use count is >= 1)
        self.peak = self.created = 0

    def _held(self):
        self.live = [st for st in self.live if torch._C._storage_Use_Count(st._cdata) > 1]
        return sum(st.nbytes() for st in self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.min_numel:
                st = t.untyped_storage()
                if st.data_ptr() not in inputs and all(st.data_ptr() != x.data_ptr() for x in self.live):
                    self.live.append(st)
                    self.created += st.nbytes()
        self.peak = max(self.peak, self._held())
        return out


def _backward_memory(blocks, dtype, block=128, n=64, h=16, min_numel=None):
    """(peak held, created) by one backward of the head over ``blocks`` vocabulary blocks of
    ``block`` columns, less its outputs (the two gradients), after a warm-up call."""
    hidden, weight, labels, g1, g2 = _inputs(n=n, h=h, v=blocks * block, dtype=dtype, seed=13)
    _run(head, hidden[:2], weight, labels[:2], g1[:2], g2[:2], block_size=block)  # (first-call probes)
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = head(hh, ww, labels, block_size=block)
    loss = (lp * g1.to(lp.dtype)).sum() + (ent * g2.to(lp.dtype)).sum()
    with _Held(n if min_numel is None else min_numel) as mem:
        loss.backward()
    outputs = hh.grad.nbytes + ww.grad.nbytes
    return mem.peak - outputs, mem.created - outputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_backward_allocates_nothing_per_vocabulary_block(dtype):
    """Issue #50 row 6: the backward's extra memory (beyond the two gradients it returns) is the
    same at 2 and at 8 vocabulary blocks of the same width: the blocks' buffers, the hidden
    gradient's accumulator and its staging buffers (bf16 on CPU, where no GEMM adds a bf16 product
    into fp32) and the chunked loop's buffers are made once, nothing larger than a per-token vector
    per block. 70fb325 allocated each block's logits, their gradient, the chunk buffers and an fp32
    upcast of the block's gradient and weights (and, on CUDA, an fp32 [n, h] product) anew."""
    two, eight = _backward_memory(2, dtype), _backward_memory(8, dtype)
    assert two[0] > 0 and two[1] > 0
    assert eight == two, (two, eight)


class _KernelStub:
    """A Triton kernel stood in by one aten op (``kernel[grid](*args)``): on CPU without the
    interpreter the GPU path runs with its wrappers' torch code as on CUDA."""

    def __init__(self, write: int):
        self.write = write  # the argument the kernel writes

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            args[self.write].copy_(args[0]) if self.write == 2 else args[self.write].add_(0)
        return launch


@pytest.fixture
def gpu_path(monkeypatch):
    """The head's GPU path (``impl="triton"``) on CPU tensors: the vocab op's Triton kernels are
    stubs (:class:`_KernelStub`), what ``auto`` resolves to is ``"triton"``."""
    pytest.importorskip("triton")
    from megatron_tepo.ops import vocab_parallel as vp_mod
    from megatron_tepo.ops import vocab_triton as vt

    for name, write in (("_local_stats_kernel", 3), ("_running_stats_kernel", 4), ("_logits_grad_kernel", 2)):
        monkeypatch.setattr(vt, name, _KernelStub(write), raising=False)
    monkeypatch.setattr(vp_mod, "_TRITON_STATE", (vt, None))
    monkeypatch.setattr(lm_head_mod, "_resolve_impl", lambda impl, hidden: "triton")


def _pass_counts(blocks, block=128, n=32, h=16):
    from megatron_tepo.launch_costs import LaunchCounter

    hidden, weight, labels, g1, g2 = _inputs(n=n, h=h, v=blocks * block, dtype=torch.float32, seed=14)
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.no_grad(), LaunchCounter() as fwd:
        head(hh, ww, labels, block_size=block)
    lp, ent = head(hh, ww, labels, block_size=block)
    loss = (lp * g1.float()).sum() + (ent * g2.float()).sum()
    with LaunchCounter() as bwd:
        loss.backward()
    return fwd, bwd


def test_the_gpu_path_launches_a_handful_of_ops_a_vocabulary_block(gpu_path):
    """Issue #50 row 6: the GPU path's ops a vocabulary block, counted on CPU as
    ``launch_costs.LaunchCounter`` counts them (every aten op dispatched, views included; each
    Triton kernel stubbed by one op: :func:`gpu_path`), are at most 12 in the log-prob pass and in
    the backward (here: the block GEMM and the statistics kernel, 4; the GEMM again, the gradient
    kernel and the two gradients' GEMMs, 8), with no host sync a block. fp32 inputs: the hidden gradient's
    one in-place ``addmm`` is the same call as bf16's with ``out_dtype`` on CUDA. 70fb325: 46 and 19
    (the block's labels, the per-block statistics' merge in float64 and their casts)."""
    (f2, b2), (f6, b6) = _pass_counts(2), _pass_counts(6)
    per_block = {"log-prob pass": (f6.ops - f2.ops) / 4, "backward": (b6.ops - b2.ops) / 4}
    assert all(0 < v <= 12 for v in per_block.values()), (per_block, f6.by_op - f2.by_op, b6.by_op - b2.by_op)
    # (the forward's two: the labels' range, checked on CPU tensors only)
    assert f6.syncs == f2.syncs and b6.syncs == b2.syncs == 0, (f6.sync_sites, b6.sync_sites)


def test_the_gpu_path_holds_what_the_fit_check_prices(gpu_path):
    """The GPU path's backward in bf16, on CPU (the Triton kernels stubbed, the hidden gradient
    through the staging buffers of a torch without an in-place mixed-precision GEMM, which the fit
    check prices too): what it holds at its peak, its outputs included, is within
    ``launch/memory.py``'s figure for the head less the hidden states it is given, plus 64 bytes a
    token for the per-token vectors the figure leaves out; and it allocates nothing per block."""
    from megatron_tepo.launch.memory import fused_head_bytes

    n, h, block = 64, 32, 128
    for blocks in (2, 5):
        v = blocks * block
        peak, created = _backward_memory(blocks, torch.bfloat16, block=block, n=n, h=h, min_numel=0)
        assert default_block_size(n, v, 2) == block or blocks == 5
        figure = fused_head_bytes(n, h, v, 2) - 2 * n * h
        outputs = 2 * n * h + 2 * v * h
        assert 0 < peak + outputs <= figure + 64 * n, (blocks, peak + outputs, figure)
    assert _backward_memory(2, torch.bfloat16, n=n, h=h, min_numel=0)[1] == \
        _backward_memory(6, torch.bfloat16, n=n, h=h, min_numel=0)[1]


def test_mixed_gemm_probe_on_cpu():
    """No CPU torch has the in-place mixed-precision GEMM so far: the head takes the staging path
    there (the probe answers once, and is not fooled by an error)."""
    assert lm_head_mod.mixed_gemm_accumulates("cpu") is False
    assert lm_head_mod._MIXED_ADDMM["cpu"] is False


def test_a_torch_without_the_in_place_mixed_gemm_is_said_once(monkeypatch, capsys):
    """At the actor's build (megatron/model.py): one line, once a process, where the fused head of a
    bf16 actor on CUDA has no in-place mixed-precision GEMM (the probe's answer faked here); nothing
    for fp32, the materialized head, CPU, or a torch that has it."""
    from megatron_tepo.megatron import lm_head as seam

    monkeypatch.setattr(seam, "_NOTED", [])
    monkeypatch.setattr(lm_head_mod, "_MIXED_ADDMM", {"cuda": True})
    assert seam.note_hidden_gradient_gemm(torch.device("cuda", 0), True, "fused") is None
    monkeypatch.setattr(lm_head_mod, "_MIXED_ADDMM", {"cuda": False})
    assert seam.note_hidden_gradient_gemm("cuda", False, "fused") is None
    assert seam.note_hidden_gradient_gemm("cuda", True, "materialized") is None
    assert seam.note_hidden_gradient_gemm("cpu", True, "fused") is None
    assert seam.note_hidden_gradient_gemm(torch.device("cuda", 1), True, "fused", say=False) is not None
    assert capsys.readouterr().out == ""
    first = seam.note_hidden_gradient_gemm(torch.device("cuda", 0), True, "fused")
    assert seam.note_hidden_gradient_gemm(torch.device("cuda", 0), True, "fused") == first
    out = capsys.readouterr().out
    assert out == first + "\n" and torch.__version__ in first and "fp32" in first


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
    path: the running statistics continued block after block, the gradient kernel finding the
    label's column in its block), run by Triton's interpreter in a child process: fp32 against
    float64 torch, bf16 against the chunked path (fp32 rounding for the outputs; the gradients
    within two bf16 units: the interpreter truncates fp32 to bf16 where the GPU rounds)."""
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
hidden, weight, labels, g1, g2 = _inputs(n=10, h=8, v=100, dtype=torch.bfloat16, seed=7)
got = _run(head, hidden, weight, labels, g1, g2, temperature=0.8, block_size=40, impl="triton")
want = _run(head, hidden, weight, labels, g1, g2, temperature=0.8, block_size=40, impl="chunked")
print("BF16", *(float((a.double() - b.double()).abs().max()) / float(b.double().abs().max())
                for a, b in zip(got, want)))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = float(proc.stdout.split("ERR")[-1].split()[0])
    assert err <= 2e-5
    lp, ent, gh, gw = (float(x) for x in proc.stdout.split("BF16")[-1].split())
    assert lp <= 1e-5 and ent <= 1e-5 and gh <= 2 ** -6 and gw <= 2 ** -6, (lp, ent, gh, gw)  # two bf16 units


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
