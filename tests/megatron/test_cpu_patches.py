"""Each CPU patch of megatron_tepo.megatron.cpu_patches is necessary, and together they suffice.

The worker (2 ranks, PP=2) applies all patches but one and runs that patch's probes -- real
megatron-core operations the actor performs -- which must fail at the expected megatron
function; with every patch applied all probes pass. Also checks the scoping of the two
``Tensor`` method fakes and that ``revert_cpu_patches`` restores the originals.
"""
from pathlib import Path

import pytest
import torch

from megatron_tepo.megatron import PATCHES
from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "workers" / "cpu_patch_worker.py"

# patch -> {probe: innermost megatron "file:function" that fails without the patch}
EXPECTED_FAILURE = {
    "current_device": {"probe_gpt_forward": "rotary_pos_embedding.py:get_emb"},
    "rng_tracker": {"probe_rng_seed": "random.py:add"},
    "cuda_synchronize": {"probe_p2p_variable_shapes": "p2p_communication.py:_communicate_shapes"},
    "cuda_tensor_factories": {
        "probe_schedule_forward_only": "schedules.py:forward_backward_no_pipelining",
        "probe_grad_norm": "clip_grads.py:get_grad_norm_fp32",
        "probe_distributed_optimizer": "optimizer.py:__init__",
    },
    "tensor_type_checks": {
        "probe_clip_grads": "clip_grads.py:clip_grad_by_total_norm_fp32",
        "probe_distributed_optimizer": "distrib_optimizer.py:_build_model_and_main_param_groups",
    },
    "tied_embedding_setup": {
        "probe_tied_embeddings_pp2": "language_module.py:setup_embeddings_and_output_layer"},
    "moe_router_gemm": {"probe_moe_router": "moe_utils.py:forward"},
    "grad_sync_stream": {"probe_grad_sync": "param_and_grad_buffer.py:start_grad_sync"},
    "gdn_kernels": {"probe_gdn_forward": "common.py:__init__"},
}


def test_every_patch_has_a_probe():
    assert set(EXPECTED_FAILURE) == set(PATCHES)


def test_unknown_patch_name_is_rejected():
    from megatron_tepo.megatron import apply_cpu_patches

    with pytest.raises(ValueError, match="unknown cpu patch"):
        apply_cpu_patches(exclude={"no_such_patch"})


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the patches are a no-op with CUDA")
def test_each_patch_is_necessary_and_all_suffice(tmp_path):
    """On the installed megatron-core (CI runs this on both ends of the range): every patch of
    its version range is needed where EXPECTED_FAILURE says, every patch outside it is not."""
    from megatron_tepo.megatron.cpu_patches import version_applies

    in_range = [name for name in PATCHES if version_applies(name)]
    results = torchrun(WORKER, 2, tmp_path=tmp_path, timeout=240)
    for rank, res in enumerate(results):
        assert res["applied"] == in_range, (rank, res["version"])
        for patch, probes in EXPECTED_FAILURE.items():
            got = res["without"][patch]
            for probe, where in probes.items():
                if patch not in in_range:  # dropped on this version: megatron no longer needs it
                    assert got[probe]["ok"], (rank, res["version"], patch, probe, got[probe])
                    continue
                assert not got[probe]["ok"], (rank, res["version"], patch, probe)
                assert got[probe]["where"] == where, (rank, patch, probe, got[probe])
            for probe, outcome in res["all"][patch].items():
                assert outcome["ok"], (rank, patch, probe, outcome)
        assert res["type_outside"] == "torch.FloatTensor"  # Tensor.type() is not faked globally
        assert res["cuda_outside_raises"]  # nor Tensor.cuda()
        assert res["reverted_current_device_raises"]


# ---------------------------------------------------------------- each patch on its own condition
def _applied_under(monkeypatch, cuda: bool, te: bool, fla: bool = True):
    from megatron_tepo.megatron import cpu_patches

    monkeypatch.setattr(cpu_patches, "cuda_available", lambda: cuda)
    monkeypatch.setattr(cpu_patches, "te_available", lambda: te)
    monkeypatch.setattr(cpu_patches, "fla_available", lambda: fla)
    cpu_patches.revert_cpu_patches()
    try:
        return cpu_patches.apply_cpu_patches()
    finally:
        cpu_patches.revert_cpu_patches()


ALL_CUDA_PATCHES = ["current_device", "rng_tracker", "cuda_synchronize", "cuda_tensor_factories",
                    "tensor_type_checks", "tied_embedding_setup", "grad_sync_stream"]


def _in_range(names):
    from megatron_tepo.megatron.cpu_patches import version_applies

    return [n for n in names if version_applies(n)]


CUDA_PATCHES = ALL_CUDA_PATCHES[:-1]  # the ones not bound to a version


def test_moe_router_patch_follows_te_not_cuda(monkeypatch):
    """Row 7 of #22: a GPU without Transformer Engine still needs the router work-around (its
    NameError is about TE), and none of the CUDA ones -- on the versions that have the bug."""
    assert _applied_under(monkeypatch, cuda=True, te=False) == _in_range(["moe_router_gemm"])


def test_gdn_kernels_patch_follows_flash_linear_attention_and_cuda(monkeypatch):
    """flash-linear-attention's kernels run where it is installed and there is CUDA; anywhere else
    (a CPU, or a GPU without ``fla``) megatron's Gated DeltaNet runs on the torch stand-in."""
    gdn = _in_range(["gdn_kernels"])
    assert _applied_under(monkeypatch, cuda=True, te=True, fla=True) == []
    assert _applied_under(monkeypatch, cuda=True, te=True, fla=False) == gdn
    assert "gdn_kernels" in _applied_under(monkeypatch, cuda=False, te=True, fla=True) or not gdn


def test_cuda_patches_follow_cuda(monkeypatch):
    cuda = _in_range(ALL_CUDA_PATCHES)
    gdn = _in_range(["gdn_kernels"])  # (no CUDA: no flash-linear-attention kernels either)
    assert set(CUDA_PATCHES) <= set(cuda)  # the version-free ones apply on every version
    order = list(PATCHES)
    assert _applied_under(monkeypatch, cuda=False, te=True) == cuda + gdn
    assert _applied_under(monkeypatch, cuda=False, te=False) == sorted(
        cuda + _in_range(["moe_router_gemm"]) + gdn, key=order.index)
    assert _applied_under(monkeypatch, cuda=True, te=True) == []


def test_every_patch_names_its_condition():
    from megatron_tepo.megatron import cpu_patches

    assert set(cpu_patches.CONDITIONS) == set(PATCHES)
    for name, condition in cpu_patches.CONDITIONS.items():
        assert condition in cpu_patches.CONDITION_PROBES, name
    assert {n for n, c in cpu_patches.CONDITIONS.items() if c == "no_cuda"} == set(ALL_CUDA_PATCHES)
    assert cpu_patches.CONDITIONS["moe_router_gemm"] == "no_te"
    assert cpu_patches.CONDITIONS["gdn_kernels"] == "no_gdn_kernels"


def test_moe_router_patch_is_a_no_op_when_megatron_bound_the_name(monkeypatch):
    """With TE megatron binds te_general_gemm itself: the patch must never overwrite it."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_tepo.megatron import cpu_patches

    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel, raising=False)
    cpu_patches.revert_cpu_patches()
    try:
        cpu_patches.PATCHES["moe_router_gemm"]()  # the function itself, whatever the version
        assert moe_utils.te_general_gemm is sentinel
    finally:
        cpu_patches.revert_cpu_patches()
    assert moe_utils.te_general_gemm is sentinel


# ---------------------------------------------------------------- each patch on its versions
def test_every_patch_names_its_versions_and_targets():
    from packaging.specifiers import SpecifierSet

    from megatron_tepo.megatron import cpu_patches

    assert set(cpu_patches.VERSIONS) == set(PATCHES) == set(cpu_patches.TARGETS)
    for name, (spec, why) in cpu_patches.VERSIONS.items():
        SpecifierSet(spec)  # a valid PEP 440 specifier
        assert len(why) > 20, name
        assert cpu_patches.TARGETS[name], name


@pytest.mark.parametrize("version, dropped", [
    ("0.16.1", {"grad_sync_stream", "gdn_kernels"}),
    ("0.17.0", {"grad_sync_stream", "moe_router_gemm", "gdn_kernels"}),
    ("0.19.2", {"moe_router_gemm"}),
])
def test_version_ranges_at_both_ends(version, dropped):
    """The patches in effect on each end of the range, and where the two version-bound ones switch
    (read from the 0.17.0 and 0.19.0 wheels)."""
    from packaging.version import Version

    from megatron_tepo.megatron.cpu_patches import version_applies

    assert {n for n in PATCHES if not version_applies(n, Version(version))} == dropped


def _source_of(module: str, qualname: str) -> str:
    import importlib
    import inspect

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    obj = getattr(obj, "__func__", obj)
    return inspect.getsource(inspect.unwrap(obj))


@pytest.mark.parametrize("patch", list(PATCHES))
def test_patch_targets_still_have_the_expected_shape(patch):
    """Each patch in the installed megatron-core's range: the functions it serves still exist and
    still contain the CUDA construct it replaces. A megatron-core that changed one of them fails
    here (follow the change in cpu_patches.py, or narrow VERSIONS) instead of at run time."""
    from megatron_tepo.megatron import cpu_patches
    from megatron_tepo.megatron.compat import mcore_version

    if not cpu_patches.version_applies(patch):
        pytest.skip(f"{patch} does not apply to megatron-core {mcore_version()}")
    before = cpu_patches.applied_patches()
    cpu_patches.revert_cpu_patches()  # read megatron's own functions, not the wrappers
    try:
        for module, qualname, construct in cpu_patches.TARGETS[patch]:
            src = _source_of(module, qualname)
            assert construct in src, (f"megatron-core {mcore_version()}: {module}.{qualname} no longer "
                                      f"contains {construct!r}: patch {patch!r} would do nothing")
    finally:
        if before:  # leave the process as it was (other tests of this process may rely on them)
            cpu_patches.apply_cpu_patches(exclude=set(PATCHES) - set(before), force=True)


def test_unsupported_megatron_core_is_refused_in_one_line(monkeypatch):
    from packaging.version import Version

    from megatron_tepo.megatron import compat

    monkeypatch.delenv("MTEPO_ALLOW_UNTESTED_MCORE", raising=False)
    for bad in ("0.15.0", "0.20.0"):
        with pytest.raises(RuntimeError, match=r"megatron-core .* is not supported \(tested: ") as err:
            compat.check_supported(Version(bad))
        assert "\n" not in str(err.value)
    assert compat.check_supported(Version("0.16.1")) == Version("0.16.1")
    assert compat.check_supported(Version("0.19.2")) == Version("0.19.2")
    monkeypatch.setenv("MTEPO_ALLOW_UNTESTED_MCORE", "1")
    assert compat.check_supported(Version("0.20.0")) == Version("0.20.0")
    assert compat.mcore_version() in compat.SUPPORTED  # what this suite runs on


def test_the_actors_transformer_config_says_whole_layer_without_the_deprecation_warning():
    """megatron-core's default CUDA-graph scope "full" warns that it is deprecated on every actor
    build; the actor passes the empty list that means the same (compat picks the field's name)."""
    import warnings

    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tepo.megatron.compat import whole_layer_cuda_graph_kwargs

    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4)
    for kwargs, expect in ((whole_layer_cuda_graph_kwargs(TransformerConfig), []), ({}, ["full scope is deprecated"])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            TransformerConfig(**base, **kwargs)
        said = [str(w.message) for w in caught if "scope" in str(w.message)]
        assert [m for m in said if any(e in m for e in expect)] == said and len(said) == len(expect), said
