"""torchrun worker: the bf16 actor against the fp32 actor and the fp32 Hugging Face model.

argv[1]: JSON list of cases ``{"family", "tie", "tp", "pp", "dist_opt"}``. Every rank builds the same
HF model (random weights, randomised norms) and batch. Per case and rank it records:

* the dtypes the bf16 actor holds: model parameters, and the optimizer's own copies (fp32 main
  parameters; shards of them with the distributed optimizer);
* log-probs and entropy of the bf16 actor against the fp32 HF model (max and mean |error|), and the
  same errors of the HF model itself run in bf16 (the size of bf16 rounding on this model);
* one Adam step from the same weights and batch in bf16 and in fp32: each parameter's update
  (the bf16 actor's fp32 main parameter after the step minus the fp32 start, against the fp32
  actor's), as a relative L2 error and a cosine over the stage, and whether the bf16 parameters
  are the main parameters rounded to bf16.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.megatron.sharding import unwrap_model
from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import hf_log_probs, hf_state, make_batch, make_hf_model, tiny_hf_config

OPT = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.0, clip_grad=0.0)
LOSS = PolicyLoss.of("grpo")


def _main_params(actor):
    """Megatron name -> the optimizer's fp32 copy (plain optimizer: whole local tensors)."""
    names = {id(p): n for n, p in unwrap_model(actor.model[0]).named_parameters()}
    out = {}
    for opt in actor.optimizer.chained_optimizers:
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for p, main in zip(model_group, main_group):
                out[names[id(p)]] = main.detach().clone()
    return out


def run_case(case):
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.layout import ParallelLayout

    hf_cfg = tiny_hf_config(case["family"], tie=case.get("tie", False))
    model = make_hf_model(hf_cfg, seed=0)
    weights = hf_state(model)
    batch = make_batch(seed=1)
    with torch.no_grad():
        ref_lp, ref_ent = hf_log_probs(model, batch)
        hf16_lp, hf16_ent = hf_log_probs(make_hf_model(hf_cfg, seed=0).to(torch.bfloat16), batch)
    mask = batch.response_mask != 0
    g = torch.Generator().manual_seed(7)
    batch.old_log_probs = (ref_lp + 0.05 * torch.randn(ref_lp.shape, generator=g)) * batch.response_mask
    layout = ParallelLayout(tp=case["tp"], pp=case.get("pp", 1))
    optim = OptimConfig(**OPT, use_distributed_optimizer=case.get("dist_opt", False))
    out = {"case": case, "hf_bf16_lp_max": float((hf16_lp - ref_lp)[mask].abs().max()),
           "hf_bf16_lp_mean": float((hf16_lp - ref_lp)[mask].abs().mean()),
           "hf_bf16_ent_max": float((hf16_ent - ref_ent)[mask].abs().max())}

    deltas = {}
    for precision in ("fp32", "bf16"):
        actor = MegatronActor(hf_cfg, hf_weights=weights, layout=layout, optim=optim, precision=precision,
                              max_tokens_per_micro_batch=64)
        rows = slice(ps.get_data_parallel_rank(), None, ps.get_data_parallel_world_size())  # this rank's share
        local = batch.split_for_data_parallel(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        start = {n: p.detach().float().clone() for n, p in unwrap_model(actor.model[0]).named_parameters()}
        lp, ent = actor.compute_log_probs(local)
        m = mask[rows]
        out[f"{precision}_lp_max"] = float((lp - ref_lp[rows])[m].abs().max())
        out[f"{precision}_lp_mean"] = float((lp - ref_lp[rows])[m].abs().mean())
        out[f"{precision}_ent_max"] = float((ent - ref_ent[rows])[m].abs().max())
        out[f"{precision}_lp_dtype"] = str(lp.dtype)
        out[f"{precision}_param_dtypes"] = sorted({str(p.dtype) for p in actor.model[0].parameters()})
        subs = actor.optimizer.chained_optimizers
        out[f"{precision}_main_dtypes"] = sorted({str(p.dtype) for o in subs for grp in o.optimizer.param_groups
                                                  for p in grp["params"]})
        out[f"{precision}_optimizer"] = sorted({type(o).__name__ for o in subs})
        metrics = actor.train_step(local, LOSS)
        out[f"{precision}_loss"] = metrics["loss"]
        if precision == "fp32":
            after = {n: p.detach().clone() for n, p in unwrap_model(actor.model[0]).named_parameters()}
        elif not case.get("dist_opt"):
            after = _main_params(actor)
            model_params = dict(unwrap_model(actor.model[0]).named_parameters())
            out["bf16_params_are_rounded_main"] = all(
                torch.equal(model_params[n].detach(), after[n].to(torch.bfloat16)) for n in after)
        else:
            after = None
        if after is not None:
            deltas[precision] = {n: after[n].float() - start[n] for n in after}
    if "bf16" in deltas:
        d16, d32 = deltas["bf16"], deltas["fp32"]
        num = sum(float((d16[n] - d32[n]).double().pow(2).sum()) for n in d32)
        den = sum(float(d32[n].double().pow(2).sum()) for n in d32)
        dot = sum(float((d16[n].double() * d32[n].double()).sum()) for n in d32)
        n16 = sum(float(d16[n].double().pow(2).sum()) for n in d32)
        out["update_rel_l2"] = (num / den) ** 0.5
        out["update_cosine"] = dot / (den * n16) ** 0.5
        out["update_names"] = len(d32)
    return out


def main():
    cases = json.loads(sys.argv[1])
    write_result({"cases": [run_case(c) for c in cases]})


if __name__ == "__main__":
    main()
