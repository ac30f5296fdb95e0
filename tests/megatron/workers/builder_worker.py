"""torchrun worker: the same actor built as megatron's ``GPTModel`` and as its ``HybridModel``
(``actor.model_builder``), bit for bit.

argv[1]: JSON list of cases ``{"family", "tie", "tp", "pp", "ep", "actor"}`` (``actor``: settings on
top of fp32 / sdpa / packed). For each case every rank builds the same HF model and batch, then one
actor per builder from the same weights; each runs the log-prob pass, one forward-backward and one
optimizer step. Per case and rank: the largest absolute difference between the two builders of the
log-probs, the entropy, the loss, every gradient and every parameter after the step (by the HF
layers' names, which both share: megatron/sharding.py), the names each holds, and the model classes.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import hf_log_probs, hf_state, make_batch, make_hf_model, tiny_hf_config

OPT = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.1, clip_grad=0.5)
ACTOR = dict(precision="fp32", attention="sdpa", pack_sequences=True, max_tokens_per_micro_batch=48)


def _run(builder, case, hf_cfg, weights, batch):
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.sharding import gather_full_tensors, unwrap_model

    layout = ParallelLayout(tp=case.get("tp", 1), pp=case.get("pp", 1), ep=case.get("ep", 1))
    actor = MegatronActor(hf_cfg, hf_weights=weights, layout=layout, optim=OptimConfig(**OPT),
                          **dict(ACTOR, model_builder=builder, **case.get("actor", {})))
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    local = batch.split_for_data_parallel(dp_rank, dp)
    lp, ent = actor.compute_log_probs(local)
    metrics = actor.forward_backward(local, PolicyLoss.of(name="grpo"))
    grads = dict(gather_full_tensors(actor.model, "grad"))
    actor.optimizer_step()
    params = dict(gather_full_tensors(actor.model, "param"))
    out = dict(lp=lp, ent=ent, loss=metrics["loss"], grads=grads, params=params,
               model=type(unwrap_model(actor.model[0])).__name__)
    if actor.train_model.replay is not None:
        out["routing"] = actor.train_model.routing_metrics
    ps.destroy_model_parallel()
    return out


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


def run_case(case):
    torch.manual_seed(0)
    hf_cfg = tiny_hf_config(case["family"], tie=case.get("tie", False))
    model = make_hf_model(hf_cfg, seed=0)
    batch = make_batch(seed=1)
    with torch.no_grad():
        ref_lp, _ = hf_log_probs(model, batch)
    g = torch.Generator().manual_seed(7)
    batch.old_log_probs = (ref_lp + 0.05 * torch.randn(ref_lp.shape, generator=g)) * batch.response_mask
    gpt = _run("gpt", case, hf_cfg, hf_state(model), batch)
    hybrid = _run("hybrid", case, hf_cfg, hf_state(model), batch)
    return {"case": case, "models": [gpt["model"], hybrid["model"]],
            "names": [sorted(gpt["grads"]), sorted(hybrid["grads"])],
            "lp": float((gpt["lp"] - hybrid["lp"]).abs().max()), "ent": float((gpt["ent"] - hybrid["ent"]).abs().max()),
            "loss": abs(gpt["loss"] - hybrid["loss"]), "loss_value": gpt["loss"],
            "grads": _max_diff(gpt["grads"], hybrid["grads"]) if gpt["grads"].keys() == hybrid["grads"].keys() else None,
            "grad_scale": max(float(t.abs().max()) for t in gpt["grads"].values()),
            "params": _max_diff(gpt["params"], hybrid["params"]) if gpt["params"].keys() == hybrid["params"].keys() else None,
            "routing": [gpt.get("routing"), hybrid.get("routing")]}


def main():
    cases = json.loads(sys.argv[1])
    write_result({"cases": [run_case(c) for c in cases]})


if __name__ == "__main__":
    main()
