"""The stand-ins of ``megatron/fast_paths.py`` against what they replace, on the installed
megatron-core: every target still has the construct its stand-in is written for; each stand-in
gives megatron's result (the grad norm within fp32 rounding, scaling and copies exactly); the
fused AdamW takes over torch's per-parameter loop and its step counts; ``MTEPO_FAST_PATHS=0``
turns everything off. (Whole train steps with and without them: ``test_launch_costs.py``.)"""
import pytest
import torch

from megatron_tepo.megatron import fast_paths


@pytest.mark.parametrize("name", sorted(fast_paths.TARGETS))
def test_every_target_has_the_construct_its_stand_in_replaces(name):
    for module, qualname, construct in fast_paths.TARGETS[name]:
        assert construct in fast_paths.target_source(module, qualname), (name, module, qualname, construct)


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in [(7, 5), (3,), (11, 2, 4), (1,)]]


def test_the_grad_norm_is_one_norm_of_per_tensor_norms_left_on_the_device():
    grads = _grads()
    total, per = fast_paths.foreach_l2_norm(0, None, [grads], True)
    ref = torch.norm(torch.tensor([float(torch.norm(g)) for g in grads]))  # megatron's local fallback
    assert total.shape == (1,) and total.dtype == torch.float32
    assert torch.allclose(total, ref.reshape(1), rtol=1e-6, atol=0)
    assert torch.allclose(per, torch.stack([g.norm() for g in grads]), rtol=1e-6, atol=0)


def test_scaling_and_copies_equal_megatrons_loops():
    src, dst = _grads(1), _grads(2)
    want = [(s * 0.37) for s in src]
    fast_paths.foreach_scale(0, None, [src, dst], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(dst, want))
    inplace = _grads(3)
    want = [g * 0.5 for g in inplace]
    fast_paths.foreach_scale(0, None, [inplace, inplace], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(inplace, want))
    main = _grads(4)
    model = [torch.empty_like(m, dtype=torch.bfloat16) for m in main]
    fast_paths.foreach_copy_this_to_that(main, model)
    assert all(torch.equal(b, m.to(torch.bfloat16)) for b, m in zip(model, main))


class _Megatronish:  # megatron's optimizer wrappers hold the torch optimizer as .optimizer
    def __init__(self, opt):
        self.optimizer = opt


def _adam_run(fused: bool, steps=3):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if fused:
        assert fast_paths.use_fused_adam(_Megatronish(opt)) == 1
        assert all(g["fused"] for g in opt.param_groups)
    for k in range(steps):
        for p in params:
            p.grad = torch.sin(p.detach() * (k + 1))
        opt.step()
    return params, opt


def test_fused_adam_equals_the_per_parameter_loop_within_fp32_rounding():
    fused, opt = _adam_run(True)
    loop, _ = _adam_run(False)
    for a, b in zip(fused, loop):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    assert all(s["step"].dtype == torch.float32 and s["step"].device == p.device
               for p, s in opt.state.items())


def test_step_counts_from_a_loop_checkpoint_move_where_the_fused_kernel_reads_them():
    _, loop = _adam_run(False, steps=2)
    state = loop.state_dict()
    params = [p for g in loop.param_groups for p in g["params"]]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(state)
    for s in opt.state.values():
        s["step"] = torch.tensor(float(s["step"]), dtype=torch.float64)  # as a wrong dtype arrives
    fast_paths.use_fused_adam(_Megatronish(opt))
    assert all(s["step"].dtype == torch.float32 and float(s["step"]) == 2.0 for s in opt.state.values())


def test_an_environment_switch_keeps_megatrons_own_paths(monkeypatch):
    monkeypatch.setenv("MTEPO_FAST_PATHS", "0")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
    assert fast_paths.use_fused_adam(_Megatronish(opt)) == 0
    assert not opt.param_groups[0]["fused"]
    before = fast_paths.applied_fast_paths()
    assert fast_paths.apply_fast_paths() == before  # nothing new applied


def test_swiglu_is_megatrons_and_compiles_once_for_any_length():
    from megatron_tepo.launch_costs import compiles

    torch._dynamo.reset()
    start = compiles()
    for n in (5, 9, 13):
        y = torch.randn(n, 1, 8, requires_grad=True)
        with torch.no_grad():
            fused = fast_paths.swiglu(y)
        y1, y2 = y.detach().chunk(2, -1)
        assert torch.allclose(fused, torch.nn.functional.silu(y1) * y2, rtol=1e-6, atol=1e-7)
        g = torch.randn(n, 1, 4)
        auto = torch.autograd.grad((torch.nn.functional.silu(y[..., :4]) * y[..., 4:]).mul(g).sum(), y)[0]
        with torch.no_grad():  # as in its autograd function's backward
            back = fast_paths.swiglu_back(g, y)
        assert torch.allclose(back, auto, rtol=1e-5, atol=1e-6)
    assert compiles() - start == 2  # one graph each for the function and its backward


def test_moes_weighted_swiglu_keeps_one_graph_with_the_patched_swiglu():
    """Issue #40: megatron's MoE ``weighted_swiglu`` (and its backward) is a ``torch.compile``-d function
    that calls the module's ``swiglu`` (``swiglu_back``), which the fast path replaces: traced from
    there, the replacement is the plain expression, so megatron's graph stays one graph with no break
    and no nested compile (dynamo warned of tracing through the replacement's compile cache)."""
    import warnings

    from megatron.core.fusions import fused_bias_swiglu as m

    ours = "swiglu" not in fast_paths.applied_fast_paths()
    if ours:
        fast_paths.patch_swiglu()
    try:
        assert m.swiglu is fast_paths.swiglu
        y, w, g = torch.randn(6, 8), torch.rand(6, 1), torch.randn(6, 4)
        for fn, args in ((m.weighted_swiglu, (y, w)), (m.weighted_swiglu_back, (g, y, w))):
            torch._dynamo.reset()
            plain = getattr(fn, "_torchdynamo_orig_callable", fn)
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                explained = torch._dynamo.explain(plain)(*args)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
            assert not [c for c in caught if "lru_cache" in str(c.message)], [str(c.message) for c in caught]
        y1, y2 = y.chunk(2, -1)
        with torch.no_grad():
            assert torch.allclose(m.weighted_swiglu(y, w), torch.nn.functional.silu(y1) * y2 * w, rtol=1e-6,
                                  atol=1e-7)
    finally:
        if ours:  # megatron's own again, as before this test
            for owner, attr, original in reversed(fast_paths._UNDO.pop("swiglu")):
                setattr(owner, attr, original)
        torch._dynamo.reset()
