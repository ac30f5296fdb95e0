"""torchrun worker: a NaN in one gradient never reaches the weights (issue #32 row 3).

argv[1]: JSON list of cases ``{"tp", "precision", "dist_opt"}``. Per case: an actor from HF weights
takes one step (so Adam's moments and step counts exist), runs forward-backward on a second batch,
then global rank 0 writes a NaN into one element of one parameter's ``main_grad`` (the reduced
gradient the optimizer reads). Recorded per rank: what ``optimizer_step`` returned, whether every
model parameter, every optimizer main parameter and every Adam state tensor is unchanged (bit for
bit) and finite, the LR scheduler's step count before and after; then a clean forward-backward and
step on a third batch, which must update the weights again.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import make_hf_model, state_case_actor, tiny_hf_config, update_batch

LOSS = PolicyLoss.of("grpo")


def _snapshot(actor):
    subs = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    tensors = [p.detach().clone() for p in actor.model[0].parameters()]
    for opt in subs:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                tensors.append(p.detach().clone())
                tensors += [v.detach().clone() for v in opt.optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return tensors


def case(spec):
    cfg = tiny_hf_config("qwen3")
    actor = state_case_actor(spec, cfg, make_hf_model(cfg, seed=0))
    actor.train_step(update_batch(10), LOSS)
    actor.forward_backward(update_batch(20), LOSS)
    if dist.get_rank() == 0:
        p = next(p for p in actor.model[0].parameters() if p.requires_grad)
        p.main_grad.view(-1)[3] = float("nan")
    before = _snapshot(actor)
    sched_before = actor.scheduler.num_steps
    result = actor.optimizer_step()
    after = _snapshot(actor)
    out = {"result": {k: (None if v != v else v) for k, v in result.items()},
           "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after),
           "finite": all(bool(torch.isfinite(t).all()) for t in after),
           "scheduler": [sched_before, actor.scheduler.num_steps]}
    # the next clean step updates again
    metrics = actor.train_step(update_batch(30), LOSS)
    later = _snapshot(actor)
    out["next"] = {"skipped_update": metrics.get("skipped_update"), "grad_norm": metrics["grad_norm"],
                   "changed": any(not torch.equal(a, b) for a, b in zip(after, later)),
                   "finite": all(bool(torch.isfinite(t).all()) for t in later)}
    return out


def main():
    cases = json.loads(sys.argv[1])
    write_result({"cases": [case(c) for c in cases]})


if __name__ == "__main__":
    main()
