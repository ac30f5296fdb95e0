"""torchrun worker (2 ranks, PP=2): each CPU patch is necessary, and all of them suffice.

For every patch P: revert everything, apply all patches but P, run P's probe operations (real
megatron-core calls the actor makes) and record how each fails (exception and the innermost
megatron frame) -- or that it passes, which the test expects of a patch outside its
``cpu_patches.VERSIONS`` on the installed megatron-core. Then apply all patches and run every
probe: all must pass. Probes either touch
no other rank or fail symmetrically on both ranks, so a failure never leaves a peer waiting.
"""
import os
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from tests.dist_utils import write_result


def tiny_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                use_cpu_initialization=True, gradient_accumulation_fusion=False, apply_rope_fusion=False,
                persist_layer_norm=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
                pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                moe_token_dispatcher_type="alltoall")
    base.update(kw)
    return TransformerConfig(**base)


def tiny_gpt(pre=True, post=True, tie=False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(tiny_config(), get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                    pre_process=pre, post_process=post, share_embeddings_and_output_weights=tie,
                    position_embedding_type="rope")


def gpt_inputs():
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)[None, None]
    return ids, torch.arange(8).expand(2, 8), mask


# ----------------------------------------------------------------------------- probes
def probe_gpt_forward():
    ids, pos, mask = gpt_inputs()
    tiny_gpt()(ids, pos, mask)


def probe_rng_seed():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123, force_reset_rng=True)


def probe_p2p_variable_shapes():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    cfg = ModelParallelConfig(variable_seq_lengths=True, pipeline_dtype=torch.float32)
    comm = P2PCommunicator(pp_group=dist.group.WORLD, config=cfg)
    if dist.get_rank() == 0:
        comm.send_forward(torch.ones(3, 2, 4), is_last_stage=False)
    else:
        got = comm.recv_forward([3, 2, 4], is_first_stage=False)
        assert got.shape == (3, 2, 4) and bool((got == 1).all())


def probe_schedule_forward_only():
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    model = tiny_gpt()
    ids, pos, mask = gpt_inputs()

    def step(it, m):
        next(it)
        return m(ids, pos, mask), lambda out: (out.sum() * 0, {})

    forward_backward_no_pipelining(forward_step_func=step, data_iterator=iter([0]), model=[model],
                                   num_microbatches=1, seq_length=8, micro_batch_size=2,
                                   forward_only=True)


def probe_grad_norm():
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    norm = get_grad_norm_fp32([torch.full((4,), 2.0)], grad_stats_parallel_group=ps.get_tensor_model_parallel_group())
    assert abs(norm - 4.0) < 1e-6


def probe_clip_grads():
    from megatron.core.optimizer import optimizer as moptimizer

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    moptimizer.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=6.0)
    assert abs(float(p.grad[0]) - 0.5) < 1e-5


def probe_distributed_optimizer():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = tiny_gpt()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])


def probe_tied_embeddings_pp2():
    from megatron.core import parallel_state as ps

    tiny_gpt(pre=ps.is_pipeline_first_stage(), post=ps.is_pipeline_last_stage(), tie=True)


def probe_moe_router():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    out = router_gating_linear(torch.randn(3, 4), torch.randn(2, 4), None, torch.float32)
    assert out.shape == (3, 2)


def probe_grad_sync():
    """A DDP backward and grad reduction over the data-parallel group (what every train step does)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = tiny_gpt()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    ids, pos, mask = gpt_inputs()
    ddp(ids, pos, mask).sum().backward()
    ddp.start_grad_sync()
    ddp.finish_grad_sync()


def probe_gdn_forward():
    """megatron's Gated DeltaNet on two packed sequences, forward and backward (what a Qwen3.5
    layer of the actor does); nothing to run on a megatron-core without its Gated DeltaNet package
    (0.16.1 - 0.18: the actor builds no Gated DeltaNet there)."""
    import importlib.util

    try:
        if importlib.util.find_spec("megatron.core.ssm.gated_delta_net.gdn") is None:
            return
    except ImportError:  # (0.16.1 - 0.18: gated_delta_net is a module, not the package)
        return
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_tepo.megatron.hybrid import GatedOutputNorm

    config = tiny_config(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                         linear_num_key_heads=2, linear_num_value_heads=4, activation_func=torch.nn.functional.silu)
    gdn = GatedDeltaNet(config, GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=GatedOutputNorm,
                                                        out_proj=RowParallelLinear),
                        layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    out, _ = gdn(torch.randn(8, 1, 32), attention_mask=None, packed_seq_params=params)
    out.sum().backward()


PROBES = {
    "current_device": [probe_gpt_forward],
    "rng_tracker": [probe_rng_seed],
    "cuda_synchronize": [probe_p2p_variable_shapes],
    "cuda_tensor_factories": [probe_schedule_forward_only, probe_grad_norm, probe_distributed_optimizer],
    "tensor_type_checks": [probe_clip_grads, probe_distributed_optimizer],
    "tied_embedding_setup": [probe_tied_embeddings_pp2],
    "moe_router_gemm": [probe_moe_router],
    "grad_sync_stream": [probe_grad_sync],
    "gdn_kernels": [probe_gdn_forward],
}


def run(probe):
    try:
        probe()
        return {"ok": True}
    except BaseException as exc:  # noqa: BLE001 - we record whatever megatron raised
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "megatron/core" in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].name}" if frames else "?"
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}", "where": where}


def reset_rng():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123, force_reset_rng=True)


def main():
    from megatron_tepo.megatron import cpu_patches

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    from megatron_tepo.megatron.compat import mcore_version

    result = {"without": {}, "all": {}, "version": str(mcore_version()),
              "in_range": {name: cpu_patches.version_applies(name) for name in PROBES}}
    for name, probes in PROBES.items():
        cpu_patches.revert_cpu_patches()
        cpu_patches.apply_cpu_patches(exclude={name})
        if name != "rng_tracker":
            reset_rng()
        result["without"][name] = {p.__name__: run(p) for p in probes}
        dist.barrier()
    cpu_patches.revert_cpu_patches()
    result["applied"] = cpu_patches.apply_cpu_patches()
    reset_rng()
    for name, probes in PROBES.items():
        result["all"][name] = {p.__name__: run(p) for p in probes}
    # scoping: outside the two patched optimizer functions Tensor.type() tells the truth,
    # outside the tied-embedding set-up Tensor.cuda() still raises
    result["type_outside"] = torch.zeros(1).type()
    result["cuda_outside_raises"] = not run(lambda: torch.zeros(1).cuda())["ok"]
    cpu_patches.revert_cpu_patches()
    result["reverted_current_device_raises"] = not run(torch.cuda.current_device)["ok"]
    write_result(result)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
