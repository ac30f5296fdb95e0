"""torchrun worker: MoE routing replay (``actor.routing_replay``) on a tiny Qwen3-MoE.

argv[1]: JSON list of cases ``{"mode": "r3"|"r2", "tp", "ep", "pack", "recompute", "family"}`` (TP > 1:
with sequence parallelism, as megatron's MoE layer needs; ``family``: ``qwen3_moe`` (default, 3
layers) or ``qwen3_5_moe`` (4 layers: 3 Gated DeltaNet + 1 gated attention, a shared expert)). Every
rank builds the same HF model (8 experts, top-2) and the same batch; the actor gets its DP
share. Forward hooks on the actor's megatron routers record the ``routing_map`` of every router
call (forward and recompute); the worker compares it, position by position, with the experts that
had to be replayed, placed in megatron's token order by its own arithmetic (not the actor's).

* ``r3``: the batch carries random ``routed_experts`` (not the routing the model would choose).
  The log-prob pass and the training pass must use exactly them; log-probs, the loss and every
  gradient must equal the HF model with its routers' top-k forced to the same experts (the
  router's weights included: their gradient must be nonzero).
* ``r2``: the log-prob pass records the actor's own routing into ``batch.routed_experts``; the
  routers' weights are then perturbed so that they would route differently, and the training
  pass must still use the recorded experts.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import (hf_log_probs, hf_reference_step, hf_state, make_batch, make_hf_model, max_rel_err,
                                    tiny_hf_config)

EXPERTS, TOPK, LAYERS = 8, 2, 3
OPT = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.0, clip_grad=0.0)
LOSS = {"name": "grpo"}


#: layers of each family's tiny model
FAMILY_LAYERS = {"qwen3_moe": LAYERS, "qwen3_5_moe": 4}


def random_routing(batch, seed, layers=LAYERS):
    """``[B, L, layers, TOPK]`` int8: distinct random experts at every real position, -1 beyond."""
    g = torch.Generator().manual_seed(seed)
    b, length = batch.input_ids.shape
    routed = torch.rand(b, length, layers, EXPERTS, generator=g).argsort(-1)[..., :TOPK].to(torch.int8)
    real = torch.arange(length)[None] < batch.seq_lens()[:, None]
    routed[~real] = -1
    return routed


def forced_hf_routers(model, routed):
    """Force every HF router's top-k to ``routed`` ([B, L, layers, k]; -1: the router's own)."""
    handles = []
    for layer, block in enumerate(model.model.layers):
        gate = block.mlp.gate

        def hook(module, args, output, layer=layer):
            logits, _, own = output
            n = logits.shape[0]
            s = n // routed.shape[0]  # the model ran [B, s], s <= L, flattened row-major
            forced = routed[:, :s, layer].reshape(-1, routed.shape[-1]).long()
            forced = torch.where(forced[:, :1] >= 0, forced, own)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, forced)
            probs = probs / probs.sum(-1, keepdim=True)  # norm_topk_prob
            return logits, probs.to(logits.dtype), forced

        handles.append(gate.register_forward_hook(hook))
    return handles


def megatron_routers(actor):
    """{MoE layer index: router module} of this rank's stage (the HF layer of the router's
    ``layer_number``: a HybridModel has two stack layers per HF layer)."""
    from megatron_tepo.megatron.sharding import hf_layer_of

    out = {}
    for chunk in actor.model:
        for m in chunk.modules():
            if getattr(m, "router_replay", None) is not None:
                out[hf_layer_of(chunk, m.layer_number)] = m
    return out


def hook_routers(actor, calls):
    for layer, router in megatron_routers(actor).items():
        def hook(module, args, output, layer=layer):
            calls.setdefault(layer, []).append((torch.is_grad_enabled(), output[1].detach().clone()))
        router.register_forward_hook(hook)


def expected_in_token_order(mb, routed, layer):
    """{token index n: set of experts} for every position of ``mb`` (rows of the DP-local batch
    whose ``routed`` is given) that has routing, in
    megatron's token order: packed -- the rows end to end; padded [b, S] -- n = s * b + r."""
    seq_lens = mb.data.seq_lens()
    out = {}
    if mb.packed:
        n = 0
        for i, row in enumerate(mb.rows):
            for p in range(int(seq_lens[i])):
                out[n] = set(routed[row, p, layer].tolist())
                n += 1
        if mb.cp_splits is not None:  # a context-parallel shard: this rank's tokens only, by local index
            from megatron.core import parallel_state as ps

            where = mb.cp_splits[ps.get_context_parallel_rank()].locate(torch.tensor(sorted(out)))
            out = {int(local): out[n] for n, local in zip(sorted(out), where.tolist()) if local >= 0}
        return out
    b = mb.shape[0]
    for r, row in enumerate(mb.rows):
        for p in range(int(seq_lens[r])):
            out[p * b + r] = set(routed[row, p, layer].tolist())
    return out


def compare_calls(calls, mbs, routed, per_mb, sp=(0, 1)):
    """Max number of positions whose experts differ from ``routed`` over every router call (each
    micro-batch has ``per_mb`` calls per layer: forward, and recompute); and the call count.
    ``sp``: (this rank, ranks) of sequence parallelism: each rank's routers see its contiguous
    share of the micro-batch's tokens."""
    bad, count = 0, 0
    rank, size = sp
    for layer, seen in calls.items():
        assert len(seen) == per_mb * len(mbs), (layer, len(seen), per_mb, len(mbs))
        for k, (_, routing_map) in enumerate(seen):
            mb = mbs[k // per_mb]
            share = mb.input_ids.numel() // size
            assert routing_map.shape[0] == share, (routing_map.shape, share)
            for n, experts in expected_in_token_order(mb, routed, layer).items():
                if -1 in experts or not rank * share <= n < (rank + 1) * share:
                    continue
                got = set(routing_map[n - rank * share].nonzero().flatten().tolist())
                bad += got != experts
                count += 1
    return bad, count


def check_gates(actor, local):
    """The errors the gates raise: a scored position without routing (before any forward), and a
    router that does not replay (coverage under 1.0 after the pass)."""
    import dataclasses

    found = {}
    holes = local.routed_experts.clone()
    holes[:, 0] = -1  # every row's first position (it scores the second token)
    try:
        actor.compute_log_probs(dataclasses.replace(local, routed_experts=holes))
    except ValueError as exc:
        found["missing"] = str(exc)
    router = megatron_routers(actor)[1]
    slot, router.router_replay = router.router_replay, None  # layer 1 routes on its own
    try:
        actor.compute_log_probs(local)
    except RuntimeError as exc:
        found["coverage"] = str(exc)
    router.router_replay = slot
    actor.compute_log_probs(local)  # and all is well again
    found["after"] = actor.routing_metrics["routing_coverage"]
    return found


def run_case(case):
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.sharding import gather_full_tensors

    torch.manual_seed(0)
    family = case.get("family", "qwen3_moe")
    layers = FAMILY_LAYERS[family]
    hf_cfg = tiny_hf_config(family, num_experts=EXPERTS, num_experts_per_tok=TOPK, num_hidden_layers=layers)
    model = make_hf_model(hf_cfg, seed=0)
    batch = make_batch(seed=1)
    layout = ParallelLayout(tp=case["tp"], ep=case.get("ep", 1), cp=case.get("cp", 1))
    actor = MegatronActor(hf_cfg, hf_state(model), layout=layout,
                          optim=OptimConfig(**OPT), precision="fp32", attention="sdpa",
                          pack_sequences=case["pack"], recompute=case["recompute"], routing_replay=case["mode"],
                          max_tokens_per_micro_batch=48, sequence_parallel=case["tp"] > 1)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    sp = (ps.get_tensor_model_parallel_rank(), case["tp"])
    rows = slice(dp_rank, None, dp)
    out = {"case": case, "dp": dp, "cp_rank": ps.get_context_parallel_rank(), "layers": layers}

    seen_mbs = []
    build = actor._micro_batches

    def keep(b):
        mbs = build(b)
        seen_mbs[:] = mbs
        return mbs

    actor._micro_batches = keep
    calls = {}
    hook_routers(actor, calls)

    if case["mode"] == "r3":
        batch.routed_experts = random_routing(batch, seed=2, layers=layers)
    local = batch.split_for_data_parallel(dp_rank, dp)

    # --- the old-log-prob pass
    lp, _ = actor.compute_log_probs(local)
    out["logprob_metrics"] = actor.routing_metrics
    out["mbs_logprob"] = len(seen_mbs)
    if case["mode"] == "r3":
        out["logprob_bad"], out["logprob_checked"] = compare_calls(calls, seen_mbs, local.routed_experts, 1, sp)
        with torch.no_grad():
            free_lp, _ = hf_log_probs(model, batch)
            handles = forced_hf_routers(model, batch.routed_experts)
            ref_lp, _ = hf_log_probs(model, batch)
            for h in handles:
                h.remove()
        out["logprob_abs_err"] = float((lp - ref_lp[rows]).abs().max())
        out["forcing_moves_logprobs"] = float((free_lp - ref_lp).abs().max())
    else:  # r2: the routers' own choice, recorded into the batch
        recorded = local.routed_experts
        out["recorded_dtype"] = str(recorded.dtype)
        out["record_bad"], out["record_checked"] = compare_calls(calls, seen_mbs, recorded, 1, sp)
        with torch.no_grad():
            ref_lp, _ = hf_log_probs(model, batch)
        out["logprob_abs_err"] = float((lp - ref_lp[rows]).abs().max())
        # the routers now prefer other experts: only replay keeps the recorded ones
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for layer, router in sorted(megatron_routers(actor).items()):
                router.weight.add_(2.0 * torch.randn(router.weight.shape, generator=g))
    calls.clear()

    # --- a training pass
    g = torch.Generator().manual_seed(7)
    batch.old_log_probs = (ref_lp + 0.05 * torch.randn(ref_lp.shape, generator=g)) * batch.response_mask
    local.old_log_probs = batch.old_log_probs[rows]
    metrics = actor.forward_backward(local, PolicyLoss.of(**LOSS))
    per_mb = 2 if case["recompute"] == "full" else 1
    out["train_metrics"] = {k: v for k, v in metrics.items() if k.startswith("routing_")}
    out["train_calls_per_layer"] = sorted(len(c) for c in calls.values())
    out["train_mbs"] = len(seen_mbs)
    if case["mode"] == "r3":
        out["train_bad"], out["train_checked"] = compare_calls(calls, seen_mbs, local.routed_experts, per_mb, sp)
        grads = dict(actor.export_hf_state("grad"))
        handles = forced_hf_routers(model, batch.routed_experts)
        ref_loss, _, ref_grads, _, _ = hf_reference_step(
            model, batch, LOSS, lr=OPT["lr"], betas=(OPT["adam_beta1"], OPT["adam_beta2"]), eps=OPT["adam_eps"],
            weight_decay=OPT["weight_decay"], clip_grad=OPT["clip_grad"])
        for h in handles:
            h.remove()
        out["loss_rel_err"] = abs(metrics["loss"] - ref_loss) / abs(ref_loss)
        out["grad_rel_err"] = {n: max_rel_err(grads[n], ref_grads[n]) for n in grads}
        out["router_grad_norm"] = {n: float(grads[n].norm()) for n in grads if n.endswith("mlp.gate.weight")}
        if case.get("gates"):
            out["gates"] = check_gates(actor, local)
    else:
        out["train_bad"], out["train_checked"] = compare_calls(calls, seen_mbs, recorded, per_mb, sp)
        mgrads = dict(gather_full_tensors(actor.model, "grad"))
        out["router_grad_norm"] = {n: float(t.norm()) for n, t in mgrads.items() if n.endswith("router.weight")}
    return out


def main():
    cases = json.loads(sys.argv[1])
    write_result({"cases": [run_case(c) for c in cases]})


if __name__ == "__main__":
    main()
