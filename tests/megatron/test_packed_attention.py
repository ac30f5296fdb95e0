"""The single-call packed attention (FlexAttention with a causal document mask) equals the
per-sequence SDPA loop on CPU: fp32, grouped-query attention, several packed sequences of different
lengths (one of length 1). Forward: abs 1e-6 through the public API. Gradients: 1e-6 of each
tensor's largest entry (fp32 summation order alone moves dk/dv by ~1e-6 absolute); torch 2.13's
``flex_attention`` refuses ``requires_grad`` inputs on CPU by a device check alone
(``_validate_device``), so the gradient test lifts that check and runs FlexAttention's eager
(dense) backward: it checks the mask's gradient semantics, which the compiled CUDA kernel shares.
``varlen`` (flash) needs CUDA and half precision: on CPU only its resolution is checked."""
import pytest
import torch

from megatron_tepo.megatron.attention import flex_attention_fns, packed_attention

TOL = 1e-6


def _inputs(lengths, heads=4, kv_heads=2, dim=16, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, heads, dim, generator=g, dtype=torch.float32, requires_grad=grad)
    k = torch.randn(t, kv_heads, dim, generator=g, dtype=torch.float32, requires_grad=grad)
    v = torch.randn(t, kv_heads, dim, generator=g, dtype=torch.float32, requires_grad=grad)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    return q, k, v, cu


def _rel(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def _run(mode, lengths, **kw):
    q, k, v, cu = _inputs(lengths, **kw)
    out = packed_attention(q, k, v, cu, scale=0.3, mode=mode)
    g = torch.Generator().manual_seed(99)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


LENGTHS = [[5, 1, 17, 9], [40], [3, 130, 2]]
needs_flex = pytest.mark.skipif(flex_attention_fns() is None, reason="this torch has no FlexAttention")


@needs_flex
@pytest.mark.parametrize("lengths", LENGTHS)
def test_flex_forward_equals_the_per_sequence_loop(lengths):
    q, k, v, cu = _inputs(lengths, grad=False)
    with torch.no_grad():
        flex = packed_attention(q, k, v, cu, scale=0.3, mode="flex")
        loop = packed_attention(q, k, v, cu, scale=0.3, mode="loop")
    assert flex.shape == loop.shape == q.shape
    assert float((flex - loop).abs().max()) <= TOL


@needs_flex
@pytest.mark.parametrize("lengths", LENGTHS)
def test_flex_gradients_equal_the_per_sequence_loop(lengths, monkeypatch):
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)  # see the module docstring
    flex, loop = _run("flex", lengths), _run("loop", lengths)
    for name, a, b in zip(("out", "dq", "dk", "dv"), flex, loop):
        assert a.shape == b.shape, name
        assert _rel(a, b) <= TOL, (name, lengths, _rel(a, b))


@pytest.mark.skipif(flex_attention_fns() is None, reason="this torch has no FlexAttention")
def test_flex_never_attends_across_sequences():
    """Changing the second sequence's keys/values leaves the first sequence's output unchanged
    (and changes the second's): the document mask is really there."""
    q, k, v, cu = _inputs([6, 7], grad=False)
    with torch.no_grad():
        a = packed_attention(q, k, v, cu, scale=0.3, mode="flex")
        k2, v2 = k.clone(), v.clone()
        k2[6:] += 1.0
        v2[6:] -= 2.0
        b = packed_attention(q, k2, v2, cu, scale=0.3, mode="flex")
    assert torch.equal(a[:6], b[:6])
    assert float((a[6:] - b[6:]).abs().max()) > 1e-3


def test_unknown_mode_is_refused():
    q, k, v, cu = _inputs([3])
    with pytest.raises(ValueError, match="packed attention mode"):
        packed_attention(q, k, v, cu, scale=0.3, mode="fast")


@pytest.mark.parametrize("flavour", ["torch>=2.11", "torch 2.10"])
def test_varlen_call_follows_this_torchs_signature(monkeypatch, flavour):
    """varlen_attn changed between releases: torch 2.10 takes ``is_causal``, 2.11+ ``window_size``;
    2.13 has an ``enable_gqa`` flag, 2.10 and 2.11 none (they hand the KV heads to the flash kernel,
    which shares them by itself). The call must be causal on both and never repeat the KV heads
    (the kernel itself is CUDA-only: a stand-in records what it was given;
    ``test_varlen_gqa_equals_the_loop_on_cuda`` runs the real one)."""
    from megatron_tepo.megatron import attention

    seen = {}

    def new(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.update(window_size=window_size, enable_gqa=enable_gqa, kv_heads=k.shape[1])
        return q

    def old(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None):
        seen.update(is_causal=is_causal, kv_heads=k.shape[1])
        return q

    monkeypatch.setattr(attention, "varlen_attn_fn", lambda: new if flavour == "torch>=2.11" else old)
    q, k = torch.zeros(6, 4, 8), torch.zeros(6, 2, 8)
    attention.packed_attention(q, k, k, torch.tensor([0, 2, 6]), 1.0, mode="varlen")
    if flavour == "torch>=2.11":
        assert seen == {"window_size": (-1, 0), "enable_gqa": True, "kv_heads": 2}
    else:
        assert seen == {"is_causal": True, "kv_heads": 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen attention is flash attention's CUDA kernel")
def test_varlen_gqa_equals_the_loop_on_cuda():
    """The real varlen kernel with 2 KV heads for 4 query heads, passed as they are (no repeat),
    against one SDPA call per sequence (GQA by ``enable_gqa``): output and gradients in bf16."""
    from megatron_tepo.megatron.attention import varlen_attn_fn

    if varlen_attn_fn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 5, 130, 64]
    t = sum(lengths)
    q = torch.randn(t, 4, 64, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, 2, 64, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, 2, 64, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    grad = torch.randn(t, 4, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    outs = []
    for mode in ("varlen", "loop"):
        for x in (q, k, v):
            x.grad = None
        out = packed_attention(q, k, v, cu, scale=0.125, mode=mode, max_seqlen=max(lengths))
        out.backward(grad)
        outs.append([out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
        assert a.shape == b.shape, name
        assert _rel(a, b) <= 2e-2, (name, _rel(a, b))  # bf16 kernels, two summation orders
