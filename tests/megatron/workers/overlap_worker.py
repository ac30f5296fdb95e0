"""torchrun worker (DP=2, gloo): megatron DDP with ``overlap_grad_reduce`` / ``overlap_param_gather``
on and off from the same weights and batch. Per optimizer (plain / distributed) it records, for
each setting: the gradients of a 4-micro-batch forward/backward (plain DDP: every full gradient;
distributed optimizer: the grad norm, as main_grad is only complete on the rank's own shard), the
parameters after one step (read through ``export_hf_state``, which must finish a deferred
all-gather), and the loss of a second forward/backward (run through the forward pre-hooks)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import hf_state, make_batch, make_hf_model, tiny_hf_config

OPT = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.1, clip_grad=0.5)
LOSS = PolicyLoss.of("grpo")


def _run(model, batch, dist_opt: bool, overlap: bool):
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.sharding import gather_full_tensors

    actor = MegatronActor(model.config, hf_weights=hf_state(model), layout=ParallelLayout(),
                          optim=OptimConfig(**OPT, use_distributed_optimizer=dist_opt),
                          precision="fp32", attention="sdpa", pack_sequences=True, max_tokens_per_micro_batch=24,
                          overlap_grad_reduce=overlap, overlap_param_gather=overlap)
    ddp = actor.model[0].ddp_config
    local = batch.split_for_data_parallel(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    m = actor.forward_backward(local, LOSS)
    grads = {n: g.tolist() for n, g in gather_full_tensors(actor.model, "grad")} if not dist_opt else {}
    step = actor.optimizer_step()
    params = {n: p.tolist() for n, p in actor.export_hf_state("param")}
    m2 = actor.forward_backward(local, LOSS)
    return {"ddp": [ddp.overlap_grad_reduce, ddp.overlap_param_gather], "mbs": m["num_micro_batches"],
            "loss": m["loss"], "grads": grads, "grad_norm": step["grad_norm"], "params": params,
            "loss2": m2["loss"]}


def main():
    torch.manual_seed(0)
    model = make_hf_model(tiny_hf_config("qwen3"), seed=0)
    batch = make_batch(seed=1)
    with torch.no_grad():
        from tests.megatron.helpers import hf_log_probs

        lp, _ = hf_log_probs(model, batch)
    batch.old_log_probs = (lp + 0.05) * batch.response_mask
    out = {}
    for dist_opt in (False, True):
        for overlap in (False, True):
            out[f"{'distopt' if dist_opt else 'plain'}_{'on' if overlap else 'off'}"] = _run(model, batch, dist_opt, overlap)
    write_result(out)


if __name__ == "__main__":
    main()
