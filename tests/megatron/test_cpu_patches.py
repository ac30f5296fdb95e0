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
    results = torchrun(WORKER, 2, tmp_path=tmp_path, timeout=240)
    for rank, res in enumerate(results):
        assert res["applied"] == list(PATCHES), rank
        for patch, probes in EXPECTED_FAILURE.items():
            got = res["without"][patch]
            for probe, where in probes.items():
                assert not got[probe]["ok"], (rank, patch, probe)
                assert got[probe]["where"] == where, (rank, patch, probe, got[probe])
            for probe, outcome in res["all"][patch].items():
                assert outcome["ok"], (rank, patch, probe, outcome)
        assert res["type_outside"] == "torch.FloatTensor"  # Tensor.type() is not faked globally
        assert res["cuda_outside_raises"]  # nor Tensor.cuda()
        assert res["reverted_current_device_raises"]


# ---------------------------------------------------------------- each patch on its own condition
def _applied_under(monkeypatch, cuda: bool, te: bool):
    from megatron_tepo.megatron import cpu_patches

    monkeypatch.setattr(cpu_patches, "cuda_available", lambda: cuda)
    monkeypatch.setattr(cpu_patches, "te_available", lambda: te)
    cpu_patches.revert_cpu_patches()
    try:
        return cpu_patches.apply_cpu_patches()
    finally:
        cpu_patches.revert_cpu_patches()


CUDA_PATCHES = ["current_device", "rng_tracker", "cuda_synchronize", "cuda_tensor_factories",
                "tensor_type_checks", "tied_embedding_setup"]


def test_moe_router_patch_follows_te_not_cuda(monkeypatch):
    """Row 7 of #22: a GPU without Transformer Engine still needs the router work-around (its
    NameError is about TE), and none of the CUDA ones."""
    assert _applied_under(monkeypatch, cuda=True, te=False) == ["moe_router_gemm"]


def test_cuda_patches_follow_cuda(monkeypatch):
    assert _applied_under(monkeypatch, cuda=False, te=True) == CUDA_PATCHES
    assert _applied_under(monkeypatch, cuda=False, te=False) == CUDA_PATCHES + ["moe_router_gemm"]
    assert _applied_under(monkeypatch, cuda=True, te=True) == []


def test_every_patch_names_its_condition():
    from megatron_tepo.megatron import cpu_patches

    assert set(cpu_patches.CONDITIONS) == set(PATCHES)
    for name, condition in cpu_patches.CONDITIONS.items():
        assert condition in cpu_patches.CONDITION_PROBES, name
    assert {n for n, c in cpu_patches.CONDITIONS.items() if c == "no_cuda"} == set(CUDA_PATCHES)
    assert cpu_patches.CONDITIONS["moe_router_gemm"] == "no_te"


def test_moe_router_patch_is_a_no_op_when_megatron_bound_the_name(monkeypatch):
    """With TE megatron binds te_general_gemm itself: the patch must never overwrite it."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_tepo.megatron import cpu_patches

    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel, raising=False)
    assert "moe_router_gemm" in _applied_under(monkeypatch, cuda=True, te=False)
    assert moe_utils.te_general_gemm is sentinel
