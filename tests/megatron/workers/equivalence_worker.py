"""torchrun worker: the Megatron actor against a single-process Hugging Face reference.

argv[1]: JSON list of cases ``{"family", "tie", "tp", "pp", "dist_opt", "loss", "mb_tokens",
"mb_invariance", "actor", "pack_check", "recompute_check"}``. ``actor``: the actor's settings
(default: fp32, sdpa attention, packed sequences). Every rank builds the same HF model (random
weights, randomised norms/biases) and the same mini-batch; the actor gets its DP share; the HF
reference runs the WHOLE mini-batch in this process. Each rank writes, per case, the max errors it
measured on its own stage. ``pack_check``: the same actor with packing switched off gives the same
log-probs, entropy, loss and gradients; ``recompute_check``: a second actor with full recompute
(one layer at a time) gives the same gradients; ``head_check``: ``actor.lm_head`` fused against
materialized on the same actor (``head_only``: nothing else is compared). ``cp``: the context-parallel
size; ``cp_check``: the same start at ``cp: 1`` (its ranks then data-parallel) gives the same
log-probs, entropy, loss and gradients as the context-parallel actor. ``short``: two rows shorter
than 4 tokens (1 and 3: fewer than 2 x cp chunks at cp 2, some chunks all padding). ``from_dir``: the
actor loads a saved folder; ``stacked``: its MoE experts stored stacked (transformers' in-memory
state dict, the published Qwen3.5-MoE layout); ``export_check``: after the step, ``export_hf`` of
that folder (rank 0 reports: :func:`_export_check`).
"""
import atexit
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import (
    checkpoint_names,
    hf_log_probs,
    hf_param_names,
    hf_reference_step,
    hf_state,
    make_batch,
    make_hf_model,
    max_rel_err,
    stacked_experts,
    tiny_hf_config,
)

OPT = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.1, clip_grad=0.5)
ACTOR = dict(precision="fp32", attention="sdpa", pack_sequences=True)


def _rel_l2(a, b):
    """||a - b|| / ||b|| over every gradient of the stage at once (b: the reference)."""
    diff = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    return (diff / sum(float(b[n].double().pow(2).sum()) for n in b)) ** 0.5


def _outputs(actor, local, loss_cfg):
    """(log-probs, entropy, loss, full gradients by Megatron name) of one forward/backward."""
    from megatron_tepo.megatron.sharding import gather_full_tensors

    lp, ent = actor.compute_log_probs(local)
    m = actor.forward_backward(local, loss_cfg)
    return lp, ent, m["loss"], dict(gather_full_tensors(actor.model, "grad"))


def _pack_check(actor, local, loss_cfg):
    """Packed vs unpacked on the same actor: max |difference| of every output."""
    import dataclasses

    before = actor.settings
    packed = _outputs(actor, local, loss_cfg)
    actor.settings = dataclasses.replace(actor.settings, pack_sequences=False)
    padded = _outputs(actor, local, loss_cfg)
    actor.settings = before
    return {"lp": float((packed[0] - padded[0]).abs().max()), "ent": float((packed[1] - padded[1]).abs().max()),
            "loss_rel": abs(packed[2] - padded[2]) / abs(padded[2]), "grad_rel": _rel_l2(packed[3], padded[3])}


def _head_check(actor, local, loss_cfg):
    """``actor.lm_head``: fused against materialized on the same actor, at temperature 0.7: max
    |difference| of the log-probs and entropy, the loss's relative difference, and every gradient
    of the stage (the output weight's, and through the rest of the model the hidden states'): the
    relative L2 error over all of them and the largest per-tensor relative error."""
    import dataclasses

    from megatron_tepo.ops import lm_head

    before, min_block = actor.settings, lm_head._MIN_BLOCK
    lm_head._MIN_BLOCK = 32  # blocks of 32 columns: several per shard of the tiny vocabulary
    hot = dataclasses.replace(local, temperature=0.7)
    got = {}
    for head in ("fused", "materialized"):
        actor.settings = dataclasses.replace(before, lm_head=head)
        got[head] = _outputs(actor, hot, loss_cfg)
    actor.settings, lm_head._MIN_BLOCK = before, min_block
    fused, mat = got["fused"], got["materialized"]
    return {"lp": float((fused[0] - mat[0]).abs().max()), "ent": float((fused[1] - mat[1]).abs().max()),
            "loss_rel": abs(fused[2] - mat[2]) / abs(mat[2]), "grad_rel": _rel_l2(fused[3], mat[3]),
            "grad_max_rel": max(max_rel_err(fused[3][n], mat[3][n]) for n in mat[3]),
            "output_grad_rel": max((max_rel_err(fused[3][n], mat[3][n]) for n in mat[3] if "output_layer" in n
                                    or "word_embeddings" in n), default=0.0),
            "names": sorted(mat[3])}


def _cp_check(case, mine, source_cfg, source_weights, optim, settings, batch, loss_cfg):
    """The same start at ``cp: 1`` (same TP / PP / EP, its ranks data-parallel) against the
    context-parallel actor's outputs ``mine``: max |difference| of the log-probs and entropy of
    the rows both hold, the loss's relative difference, the gradients' relative L2 error."""
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor.actor import MegatronActor
    from megatron_tepo.layout import ParallelLayout

    layout = ParallelLayout(tp=case["tp"], pp=case["pp"], ep=case.get("ep", 1))
    other = MegatronActor(source_cfg, hf_weights=source_weights, layout=layout, optim=optim, **settings)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    theirs = _outputs(other, batch.split_for_data_parallel(dp_rank, dp), loss_cfg)
    rows = slice(dp_rank, None, dp)
    return {"dp": dp, "lp": float((mine[0][rows] - theirs[0]).abs().max()),
            "ent": float((mine[1][rows] - theirs[1]).abs().max()),
            "loss_rel": abs(mine[2] - theirs[2]) / abs(theirs[2]), "grad_rel": _rel_l2(mine[3], theirs[3]),
            "grad_names": sorted(theirs[3])}


def _load_dir(path) -> dict:
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _export_check(actor, source, params):
    """``export_hf`` of the actor that loaded ``source`` (collective; rank 0 reports, None elsewhere):
    whether the export has the source's stored names, the trained parameters (``params``, per expert)
    stacked as the source stacked them bit for bit, and transformers' reload of it the same tensors."""
    import transformers

    path = tempfile.mkdtemp(prefix="mtepo_export_")
    atexit.register(shutil.rmtree, path, True)
    if actor.export_hf(os.path.join(path, "export"), source) is None:
        return None
    got, want = _load_dir(os.path.join(path, "export")), stacked_experts(params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(path, "export"), dtype=torch.float32)
    state = reloaded.state_dict()
    return {"same_names_as_source": sorted(got) == sorted(_load_dir(source)),
            "stacked": sorted(n for n in got if n.endswith(("experts.gate_up_proj", "experts.down_proj"))),
            "not_trained_params": sorted(n for n in want if not (n in got and torch.equal(got[n], want[n]))),
            "reload_differs": sorted(n for n in got if not torch.equal(state[n], got[n]))}


def _short_rows(batch):
    """Row 1: one prompt and two response tokens (3 in all); the last row (no response): one token."""
    batch.prompt_lens[1], batch.prompt_lens[-1] = 1, 1
    batch.response_mask[1] = 0
    batch.response_mask[1, :2] = 1
    batch.input_ids[1, 3:] = 0
    batch.input_ids[-1, 1:] = 0
    if batch.advantages is not None:
        batch.advantages[1, 2:] = 0
        batch.old_entropy[1, 2:] = 0
    return batch


def run_case(case):
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.sharding import gather_full_tensors

    torch.manual_seed(0)
    hf_cfg = tiny_hf_config(case["family"], tie=case["tie"])
    model = make_hf_model(hf_cfg, seed=case.get("seed", 0))
    batch = make_batch(seed=case.get("seed", 0) + 1)
    if case.get("short"):
        batch = _short_rows(batch)
    initial = hf_state(model)
    optim = OptimConfig(**OPT, use_distributed_optimizer=case.get("dist_opt", False))
    source_cfg, source_weights = hf_cfg, hf_state(model)
    if case.get("from_dir"):  # a saved HF model directory: config.json + *.safetensors
        from safetensors.torch import save_file

        # (save_pretrained writes on global rank 0 only once torch.distributed is up)
        path = tempfile.mkdtemp(prefix="mtepo_hf_")
        atexit.register(shutil.rmtree, path, True)
        hf_cfg.to_json_file(os.path.join(path, "config.json"))
        stored = source_weights
        if case.get("stacked"):  # the experts as transformers holds them (the published layout)
            stored = {n: t.detach().clone() for n, t in model.state_dict().items()
                      if not (case["tie"] and n == "lm_head.weight")}
            assert checkpoint_names(stored).keys() == source_weights.keys() and stored.keys() != source_weights.keys()
        save_file(stored, os.path.join(path, "model.safetensors"))
        source_cfg = source_weights = path
    layout = ParallelLayout(tp=case["tp"], pp=case["pp"], ep=case.get("ep", 1), cp=case.get("cp", 1))
    settings = dict(ACTOR, max_tokens_per_micro_batch=case.get("mb_tokens", 64), **case.get("actor", {}))
    actor = MegatronActor(source_cfg, hf_weights=source_weights, layout=layout, optim=optim, **settings)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    out = {"case": case, "dp": dp, "pp_rank": ps.get_pipeline_model_parallel_rank(),
           "hf_names": hf_param_names(model),
           "fusions": [actor.config.bias_activation_fusion, actor.config.bias_dropout_fusion]}

    # --- old-policy pass
    with torch.no_grad():
        ref_lp, ref_ent = hf_log_probs(model, batch)
    g = torch.Generator().manual_seed(7)
    batch.old_log_probs = (ref_lp + 0.05 * torch.randn(ref_lp.shape, generator=g)) * batch.response_mask
    if case["loss"].get("kl_coef"):
        batch.ref_log_probs = (ref_lp + 0.05 * torch.randn(ref_lp.shape, generator=g)) * batch.response_mask
    local = batch.split_for_data_parallel(dp_rank, dp)
    rows = slice(dp_rank, None, dp)  # this rank's share
    lp, ent = actor.compute_log_probs(local)
    out["logprob_abs_err"] = float((lp - ref_lp[rows]).abs().max())
    out["entropy_abs_err"] = float((ent - ref_ent[rows]).abs().max())

    # --- the same mini-batch as 1 and as 4 micro-batches
    if case.get("mb_invariance"):
        grads = {}
        for budget in (10**6, 1):
            actor.max_tokens_per_micro_batch = budget
            m = actor.forward_backward(local, PolicyLoss.of(**case["loss"]))
            grads[int(m["num_micro_batches"])] = dict(gather_full_tensors(actor.model, "grad"))
        out["mb_counts"] = sorted(grads)
        a, b = (grads[k] for k in sorted(grads))
        out["mb_invariance_rel_err"] = max(max_rel_err(a[n], b[n]) for n in a)
        actor.max_tokens_per_micro_batch = case.get("mb_tokens", 64)

    if case.get("cp_check"):
        cp_outputs = _outputs(actor, local, PolicyLoss.of(**case["loss"]))
    if case.get("pack_check"):
        out["pack_check"] = _pack_check(actor, local, PolicyLoss.of(**case["loss"]))
    if case.get("head_check"):
        out["head_check"] = _head_check(actor, local, PolicyLoss.of(**case["loss"]))
        if case.get("head_only"):  # (a bf16 actor: compared with itself, not with the fp32 HF reference)
            return out

    # --- one training step
    metrics = actor.forward_backward(local, PolicyLoss.of(**case["loss"]))
    grads = dict(actor.export_hf_state("grad"))
    mgrads = dict(gather_full_tensors(actor.model, "grad"))
    ref_loss, ref_metrics, ref_grads, ref_after, ref_norm = hf_reference_step(
        model, batch, case["loss"], lr=OPT["lr"], betas=(OPT["adam_beta1"], OPT["adam_beta2"]),
        eps=OPT["adam_eps"], weight_decay=OPT["weight_decay"], clip_grad=OPT["clip_grad"])
    out["loss"], out["ref_loss"] = metrics["loss"], ref_loss
    out["loss_rel_err"] = abs(metrics["loss"] - ref_loss) / abs(ref_loss)
    out["num_micro_batches"] = metrics["num_micro_batches"]
    out["metric_errs"] = {k: abs(metrics[k] - ref_metrics[k]) for k in ref_metrics if k in metrics}
    out["grad_names"] = sorted(grads)
    out["grad_rel_err"] = {n: max_rel_err(grads[n], ref_grads[n]) for n in grads}
    if case["tie"] and "output_layer.weight" in mgrads:  # the last stage's copy of the embedding
        out["tied_copy_grad_rel_err"] = max_rel_err(mgrads["output_layer.weight"],
                                                    ref_grads["model.embed_tokens.weight"])
    step = actor.optimizer_step()
    out["grad_norm"], out["ref_grad_norm"], out["lr"] = step["grad_norm"], ref_norm, step["lr"]
    params = dict(actor.export_hf_state("param"))
    out["param_abs_err"] = {n: float((params[n] - ref_after[n]).abs().max()) for n in params}
    out["param_rel_err"] = {n: max_rel_err(params[n], ref_after[n]) for n in params}
    out["min_param_update"] = min(float((ref_after[n] - initial[n]).abs().max()) for n in params)
    if case.get("export_check"):
        out["export"] = _export_check(actor, source_cfg, params)
    mparams = dict(gather_full_tensors(actor.model, "param"))
    if case["tie"] and "output_layer.weight" in mparams:
        out["tied_copy_param_abs_err"] = float((mparams["output_layer.weight"]
                                                - ref_after["model.embed_tokens.weight"]).abs().max())
    if case.get("recompute_check"):  # the same start, full recompute one layer at a time
        other = MegatronActor(source_cfg, hf_weights=source_weights, layout=layout, optim=optim,
                              **dict(settings, recompute="full", recompute_num_layers=1))
        assert other.config.recompute_granularity == "full" and other.config.recompute_method == "uniform"
        m2 = other.forward_backward(local, PolicyLoss.of(**case["loss"]))
        out["recompute_grad_rel_err"] = _rel_l2(dict(gather_full_tensors(other.model, "grad")), mgrads)
        out["recompute_loss_rel_err"] = abs(m2["loss"] - metrics["loss"]) / abs(metrics["loss"])
    if case.get("cp_check"):  # last: it starts the process groups again without CP
        out["cp_check"] = _cp_check(case, cp_outputs, source_cfg, source_weights, optim, settings, batch,
                                    PolicyLoss.of(**case["loss"]))
    if case.get("from_dir"):
        shutil.rmtree(source_cfg)
    return out


def main():
    cases = json.loads(sys.argv[1])
    write_result({"cases": [run_case(c) for c in cases]})


if __name__ == "__main__":
    main()
