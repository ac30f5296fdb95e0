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
