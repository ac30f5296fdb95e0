"""torchrun worker: what the built actor really allocates per rank, next to the fit check's numbers.

argv[1]: JSON list of cases ``{"family", "tie", "tp", "dist_opt", "precision"}`` (and ``"lora"``: a
rank, LoRA adapters on every target linear). Per case every
rank builds the actor, takes one optimizer step (Adam's states exist from the first step on) and
reports, in bytes: its parameters (unique storages), its DDP gradient buffers, and its optimizer's
own tensors (Adam's moments, and the main parameters that do not share storage with the model's:
fp32 copies with bf16; none in fp32, where megatron's main parameters are the model's own, or
views of them with the distributed optimizer). It also reports what ``launch.memory.actor_memory``
prices for the same model, layout and ``actor`` section.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import hf_state, make_batch, make_hf_model, tiny_hf_config


def _bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def run_case(case):
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.config import ActorConfig, LoraConfig, RunConfig
    from megatron_tepo.launch import LaunchLayout, model_shape
    from megatron_tepo.launch.memory import actor_memory
    from megatron_tepo.megatron.sharding import unwrap_model

    hf_cfg = tiny_hf_config(case["family"], tie=case["tie"])
    lora = LoraConfig(rank=case["lora"]) if case.get("lora") else None
    settings = ActorConfig(precision=case["precision"], max_tokens_per_micro_batch=64, lora=lora)
    optim = OptimConfig(lr=1e-3, use_distributed_optimizer=case["dist_opt"])
    layout = ParallelLayout(tp=case["tp"])
    actor = MegatronActor(hf_cfg, hf_weights=hf_state(make_hf_model(hf_cfg)), layout=layout, optim=optim,
                          actor_config=settings)
    batch = make_batch(seed=1)
    batch.old_log_probs = torch.zeros_like(batch.response_mask)
    actor.train_step(batch.split_for_data_parallel(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
                     PolicyLoss.of("grpo"))
    ddp = actor.model[0]
    params = list(unwrap_model(ddp).parameters())
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    state, mains = [], []
    for opt in actor.optimizer.chained_optimizers:
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_storages:
                    mains.append(p)
                state += [v for k, v in inner.state.get(p, {}).items() if torch.is_tensor(v) and k != "step"]
    measured = {"weights": _bytes(params),
                "grads": sum(b.grad_data.numel() * b.grad_data.element_size()
                             for b in ddp.buffers + ddp.expert_parallel_buffers),
                "optimizer": _bytes(state) + _bytes(mains),
                "trained": sum(p.numel() for p in params if p.requires_grad)}
    hf = hf_cfg.to_dict()
    cfg = RunConfig()
    cfg.parallel, cfg.actor, cfg.optim = layout, settings, optim  # (ParallelLayout is frozen)
    fit = actor_memory(model_shape(hf), cfg, LaunchLayout(gpus_per_node=dist.get_world_size(), actor_nodes=1))
    return {"case": case, "measured": measured,
            "fit": {"weights": fit.weights, "grads": fit.grads, "optimizer": fit.optimizer,
                    "lora_params": fit.lora_params},
            "dp": ps.get_data_parallel_world_size(), "tp": ps.get_tensor_model_parallel_world_size()}


def main():
    cases = json.loads(sys.argv[1])
    write_result({"cases": [run_case(c) for c in cases]})


if __name__ == "__main__":
    main()
