"""torchrun worker (2 ranks): MoE experts with Transformer Engine's attributes load and export right
(issue #32 row 2).

megatron-core sets ``partition_stride = 1`` on every expert weight of TE's layers
(``_set_expert_parameter_attributes``), although each rank's expert ``linear_fc1`` holds
``[gate_r; up_r]`` as a dense layer's does. Here the model of a Qwen3-MoE actor at TP=2 (experts
split over the two ranks: expert TP 2) is built on the local spec (``_moe_tp2``), its experts'
``linear_fc1`` weights are given the attributes TE gives them (stride 1), then HF weights are
loaded (from a state dict and from a safetensors checkpoint read lazily) and exported. Recorded per rank: whether every expert's
``linear_fc1`` shard is ``[gate_r; up_r]`` (what megatron's expert MLP computes SwiGLU on) and the
export against the HF tensors.
"""
import atexit
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from tests.dist_utils import write_result
from tests.megatron.helpers import hf_state, make_hf_model, tiny_hf_config


def _te_attributes(actor) -> int:
    """Expert weights as megatron-core's TE wrappers leave them: split on dim 0, stride 1."""
    n = 0
    for name, p in actor.model[0].named_parameters():
        if ".experts." in name and "linear_fc1" in name and getattr(p, "tensor_model_parallel", False):
            p.partition_stride = 1
            n += 1
    return n


def _shards_ok(actor, want, rank, size) -> bool:
    from megatron_tepo.megatron.sharding import global_named_parameters

    ok = True
    for gname, p in global_named_parameters(actor.model[0]):
        if ".experts.local_experts." not in gname or not gname.endswith("linear_fc1.weight"):
            continue
        layer, expert = gname.split(".")[2], gname.split(".")[6]
        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        gate, up = want[prefix + "gate_proj.weight"], want[prefix + "up_proj.weight"]
        rows = gate.shape[0] // size
        expected = torch.cat([gate[rank * rows:(rank + 1) * rows], up[rank * rows:(rank + 1) * rows]])
        ok = ok and torch.equal(p.detach(), expected)
    return ok


def main():
    from megatron_tepo.checkpoint.hf_io import LazyHFCheckpoint
    from megatron_tepo.megatron.hf_load import load_hf_checkpoint_into, load_hf_weights_into

    size = 2
    cfg = tiny_hf_config("qwen3_moe")
    hf = make_hf_model(cfg, seed=5)
    want = hf_state(hf)
    actor = _moe_tp2(cfg)
    rank = dist.get_rank()
    out = {"marked": _te_attributes(actor)}
    load_hf_weights_into(actor.model, want, actor.family_cfg)
    out["state_dict_shards"] = _shards_ok(actor, want, rank, size)
    # the lazy per-rank read of a safetensors checkpoint, into the scrambled model
    with torch.no_grad():
        for p in actor.model[0].parameters():
            p.zero_()
    folder = tempfile.mkdtemp(prefix="mtepo-moe-") if rank == 0 else None
    if folder:
        atexit.register(shutil.rmtree, folder, True)
    box = [folder]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in want.items()}, os.path.join(box[0], "model.safetensors"))
    dist.barrier()
    ckpt = LazyHFCheckpoint(box[0])
    try:
        load_hf_checkpoint_into(actor.model, ckpt, actor.family_cfg)
    finally:
        ckpt.close()
    out["checkpoint_shards"] = _shards_ok(actor, want, rank, size)
    from megatron_tepo.actor.export import export_hf_state

    got = {n: t.clone() for n, t in export_hf_state(actor.model, actor.family_cfg, tp_group=actor.tp_group)}
    out["export_equal"] = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    write_result(out)


def _moe_tp2(cfg):
    """The model of a Qwen3-MoE actor at TP=2 (experts split over both ranks), built as the actor
    builds it but without its layout check: megatron's MoE layer trains at TP > 1 only with
    sequence parallelism; loading and exporting need no forward, so none is set up here."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from megatron_tepo.config import ActorConfig
    from megatron_tepo.megatron import apply_cpu_patches
    from megatron_tepo.megatron.gpt import build_chunk, transformer_config
    from megatron_tepo.megatron.resolve import family_spec, resolve_actor_config
    from megatron_tepo.models import family_config_from_hf
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_cpu_patches()
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    settings = resolve_actor_config(ActorConfig(precision="fp32", attention="sdpa"))
    family_cfg = family_config_from_hf(cfg, spec=family_spec(settings))
    config = transformer_config(family_cfg, tp=2, pp=1, actor=settings, initialize=False)
    chunk = build_chunk(config, family_cfg, True, True, actor=settings)
    return SimpleNamespace(model=[chunk], family_cfg=family_cfg, tp_group=ps.get_tensor_model_parallel_group())


if __name__ == "__main__":
    main()
