"""torchrun worker: LoRA adapters on the Megatron actor against the merged weights.

argv[1]: a scratch root (shared by the ranks); argv[2]: JSON list of cases ``{"tp", "pp", "cp", "ep",
"family", "checkpoint", "engine", "actor"}`` (``family``: qwen3 unless given -- qwen3_moe, qwen3_5;
``actor``: settings over the defaults, e.g. sequence parallelism; ``engine``: the embedded-engine
check, on unless false). Per case (fp32, sdpa, packed): a LoRA actor (rank 4, alpha 8, every target)
on a tiny model reports ``linears`` (the adapted linears of this rank's stage, by kind) and

* ``trainable``: whether every parameter that trains is an adapter, and the optimizer holds exactly
  the adapters (``optimizer_params``, ``adapters``);
* ``step0_lp_err``: its log-probs at B = 0 against the HF base model;
* with random nonzero B: ``export_err`` -- the weight export (what every sync sends) against
  ``W + s*B*A`` computed here in fp32 from the gathered full tensors; then a plain actor built from
  that export (the merged weights) at the same layout: ``lp_err`` / ``ent_err`` / ``loss_err`` and
  ``grad_rel`` (the adapters' gradients against ``s*G*A^T`` and ``s*B^T*G`` from the merged
  model's weight gradients ``G``: the largest per-tensor relative error);
* after one step: ``base_changed`` (base parameters that moved: none), ``adapters_moved``;
  ``engine_lp_err``: an embedded engine updated from the export scores the batch as the actor does;
* ``checkpoint``: the actor saves after that step and trains one more; a fresh LoRA actor (random
  base, other seed) loads the checkpoint and trains the same step: ``resume_equal`` (every
  parameter, base and adapters, bit for bit) and ``resume_loss_equal``; ``base_file``: the
  checkpoint's ``lora_base.json`` (a base from a state dict: saved in full).

``{"resume": true}``: :func:`run_resume_case` (a base from an HF folder, referenced; resumes at
other layouts).
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import hf_log_probs, hf_state, make_batch, make_hf_model, tiny_hf_config

OPT = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.1, clip_grad=0.5)
ACTOR = dict(precision="fp32", attention="sdpa", pack_sequences=True, max_tokens_per_micro_batch=64)
LOSS = PolicyLoss.of("grpo")


def _set_random_b(actor, seed=5):
    """Every adapter's B: a random full tensor drawn from its global name (the same on every rank
    that holds it), this rank's rows of it."""
    import zlib

    from megatron_tepo.megatron.lora import is_adapter
    from megatron_tepo.megatron.sharding import global_named_parameters

    ps = actor.train_model._ps
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for name, p in global_named_parameters(actor.model[0]):
        if not (is_adapter(p) and name.endswith(".lora_B")):
            continue
        split = getattr(p, "tensor_model_parallel", False)
        rows = p.shape[0] * (tp if split else 1)
        gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
        full = 0.05 * torch.randn(rows, p.shape[1], generator=gen)
        with torch.no_grad():
            p.copy_(full.chunk(tp, 0)[tp_rank] if split else full)


def _union(local: dict) -> dict:
    """Every rank's ``{name: tensor}`` together (the stages of a pipeline, every EP rank's experts)."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out = {}
    for part in parts:
        out.update(part)
    return out


def _merged_expected(actor, scale):
    """Full megatron-named params with each adapted weight replaced by ``W + s*B*A`` (fp32), from
    the gathered full tensors."""
    from megatron_tepo.megatron.sharding import gather_full_tensors

    full = dict(gather_full_tensors(actor.model, "param"))
    out = {}
    for name, t in full.items():
        if name.endswith(".lora_A") or name.endswith(".lora_B"):
            continue
        base = name[: -len(".weight")]
        if f"{base}.lora_A" in full:
            t = t.double() + scale * (full[f"{base}.lora_B"].double() @ full[f"{base}.lora_A"].double())
            t = t.float()
        out[name] = t
    return full, out


def _all_params(actor):
    return {n: p.detach().clone() for n, p in actor.model[0].named_parameters()}


def run_case(case, root: Path):
    import torch.distributed as dist

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.config import LoraConfig
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.lora import adapter_full_tensors, is_adapter, lora_modules
    from megatron_tepo.megatron.sharding import gather_full_tensors, unwrap_model
    from megatron_tepo.models import megatron_to_hf

    lora = LoraConfig(rank=4, alpha=8.0)
    scale = lora.alpha / lora.rank
    hf_cfg = tiny_hf_config(case.get("family", "qwen3"), tie=False)
    model = make_hf_model(hf_cfg, seed=0)
    layout = ParallelLayout(tp=case["tp"], pp=case.get("pp", 1), cp=case.get("cp", 1), ep=case.get("ep", 1))
    settings = dict(ACTOR, **case.get("actor", {}))
    actor = MegatronActor(hf_cfg, hf_weights=hf_state(model), layout=layout, optim=OptimConfig(**OPT), lora=lora,
                          **settings)
    ps = actor.train_model._ps
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    batch = make_batch(seed=1)
    with torch.no_grad():
        ref_lp, _ = hf_log_probs(model, batch)
    batch.old_log_probs = (ref_lp + 0.05 * torch.randn(ref_lp.shape, generator=torch.Generator().manual_seed(7))) \
        * batch.response_mask
    local = batch.split_for_data_parallel(dp_rank, dp)
    rows = slice(dp_rank, None, dp)
    out = {"case": case, "dp": dp, "pp_rank": ps.get_pipeline_model_parallel_rank()}

    params = list(actor.model[0].named_parameters())
    adapters = [n for n, p in params if is_adapter(p)]
    out["trainable"] = all(is_adapter(p) for _, p in params if p.requires_grad) and all(
        p.requires_grad for _, p in params if is_adapter(p))
    subs = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    out["optimizer_params"] = sum(len(g["params"]) for o in subs for g in o.optimizer.param_groups)
    out["adapters"] = len(adapters)
    kinds = {}
    for name, _ in lora_modules(unwrap_model(actor.model[0])):
        kind = ("expert." if ".experts." in name else "") + name.rsplit(".", 1)[-1]
        kinds[kind] = kinds.get(kind, 0) + 1
    out["linears"] = kinds

    lp0, _ = actor.compute_log_probs(local)
    out["step0_lp_err"] = float((lp0 - ref_lp[rows]).abs().max())

    # --- nonzero B: the export is the merged weights; a plain actor on them computes the same
    _set_random_b(actor)
    full, merged = _merged_expected(actor, scale)
    # every stage's (and EP rank's) export and expected merged weights, together
    want = _union(dict(megatron_to_hf(merged.items(), actor.family_cfg)))
    stream = _union({n: t.clone() for n, t in actor.export_hf_state()})
    out["export_names_equal"] = sorted(stream) == sorted(want)
    out["export_err"] = max(float((stream[n] - want[n]).abs().max()) for n in want)

    # the adapters in PEFT's names, gathered to rank 0 (the adapters sync's and the PEFT export's input):
    # every adapted HF module once, an MoE model's experts from every EP rank
    peft = actor.export_adapters()
    adapted = [f"{n[:-len('.lora_A')]}.weight" for n in full if n.endswith(".lora_A")]
    hf_adapted = _union({h: 0 for m in adapted for h, _ in megatron_to_hf([(m, merged[m])], actor.family_cfg)})
    if dist.get_rank() == 0:
        out["peft_modules"] = sorted({n.split(".lora_")[0] for n, _ in peft})
        out["peft_want"] = sorted(f"base_model.model.{h[:-len('.weight')]}" for h in hf_adapted)

    lp, ent = actor.compute_log_probs(local)
    m = actor.forward_backward(local, LOSS)
    grads = dict(adapter_full_tensors(actor.model, "grad"))

    plain = MegatronActor(hf_cfg, hf_weights=stream, layout=layout, optim=OptimConfig(**OPT), **settings)
    plp, pent = plain.compute_log_probs(local)
    pm = plain.forward_backward(local, LOSS)
    g_full = dict(gather_full_tensors(plain.model, "grad"))
    out["lp_err"] = float((lp - plp).abs().max())
    out["lp_scale"] = float(plp.abs().max())
    out["ent_err"] = float((ent - pent).abs().max())
    out["loss_err"] = abs(m["loss"] - pm["loss"])
    rel, sq_err, sq_ref = {}, 0.0, 0.0
    for name, g in grads.items():
        base = name.rsplit(".", 1)[0]
        G = g_full[f"{base}.weight"].double()
        a, b = full[f"{base}.lora_A"].double(), full[f"{base}.lora_B"].double()
        expect = scale * (G @ a.T) if name.endswith("lora_B") else scale * (b.T @ G)
        rel[name] = float((g.double() - expect).abs().max() / expect.abs().max().clamp_min(1e-30))
        sq_err, sq_ref = sq_err + float((g.double() - expect).pow(2).sum()), sq_ref + float(expect.pow(2).sum())
    out["grad_rel"] = max(rel.values())
    out["grad_rel_worst"] = max(rel, key=rel.get)
    out["grad_rel_l2"] = (sq_err / sq_ref) ** 0.5
    out["grad_names"] = len(rel)
    del plain

    # --- one step: the base stays, the adapters move; the engine updated from the export agrees
    before = _all_params(actor)
    actor.optimizer_step()
    after = _all_params(actor)
    out["base_changed"] = [n for n in before if not n.endswith(("lora_A", "lora_B"))
                           and not torch.equal(before[n], after[n])]
    out["adapters_moved"] = min(float((after[n] - before[n]).abs().max()) for n in before
                                if n.endswith(("lora_A", "lora_B")))
    stream = _union({n: t.clone() for n, t in actor.export_hf_state()})
    lp1, _ = actor.compute_log_probs(batch)
    out["engine_lp_err"] = None
    if case.get("engine", True):
        out["engine_lp_err"] = _engine_err(hf_cfg, stream, batch, lp1)
    return _resume(case, root, actor, hf_cfg, layout, settings, lora, local, out)


def _engine_err(hf_cfg, stream, batch, lp1):
    """An embedded engine updated from ``stream`` scores ``batch``: max |difference| from ``lp1``."""
    from megatron_tepo.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(make_hf_model(hf_cfg, seed=3), seed=0)  # other weights until the update
    engine.update_weights(iter(stream.items()))
    lens, prompts = batch.seq_lens().tolist(), [int(p) for p in batch.prompt_lens]
    seqs = [batch.input_ids[i, : lens[i]].tolist() for i in range(batch.batch_size)]
    err = 0.0
    for i, got in enumerate(engine.score(seqs, prompts)):
        mask = batch.response_mask[i, : len(got)] != 0
        if mask.any():
            err = max(err, float((torch.tensor(got)[mask] - lp1[i, : len(got)][mask]).abs().max()))
    return err


def _resume(case, root, actor, hf_cfg, layout, settings, lora, local, out):
    import torch.distributed as dist

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig

    if case.get("checkpoint"):
        ckpt = root / f"ckpt_tp{case['tp']}"
        actor.save_checkpoint(ckpt, extra_state={"step": 1})
        m2 = actor.train_step(local, LOSS)
        want_params = _all_params(actor)
        del actor
        fresh = MegatronActor(hf_cfg, hf_weights=None, layout=layout, optim=OptimConfig(**OPT), lora=lora, seed=99,
                              **settings)
        out["base_file"] = json.loads((ckpt / "lora_base.json").read_text())
        extra = fresh.load_checkpoint(ckpt)
        m3 = fresh.train_step(local, LOSS)
        got_params = _all_params(fresh)
        out["resume_extra"] = extra
        out["resume_equal"] = sorted(got_params) == sorted(want_params) and all(
            torch.equal(got_params[k], want_params[k]) for k in want_params)
        out["resume_loss_equal"] = m2["loss"] == m3["loss"] and m2["grad_norm"] == m3["grad_norm"]
        dist.barrier()
    return out


def _lora_actor(hf_cfg, weights, layout, **kw):
    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.config import LoraConfig

    return MegatronActor(hf_cfg, hf_weights=weights, layout=layout, optim=OptimConfig(**OPT),
                         lora=LoraConfig(rank=4, alpha=8.0), **ACTOR, **kw)


def _local(actor, batch):
    ps = actor.train_model._ps
    return batch.split_for_data_parallel(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())


def _base_keys(ckpt: Path):
    """The model tensors other than adapters a checkpoint stores (its DCP metadata's keys)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return sorted(k for k in keys if not k.startswith("optimizer") and k.rsplit(".", 1)[-1] not in ("lora_A", "lora_B")
                  and k.endswith((".weight", ".bias")))


def run_resume_case(case, root: Path):
    """A TP 2 LoRA actor built from the HF folder ``root/base`` trains a step and saves; its
    checkpoint references the base (``base_file``; ``base_keys``: the base tensors it stores).
    Then, each a fresh actor on a random base (other seed) that loads it fully (optimizer too) and
    trains the next step: ``same`` at TP 2 (bit for bit: ``*_equal``), ``tp1`` (DP 2) and ``pp2``
    (resharded: ``*_err``, the log-probs before and after the step against the uninterrupted
    actor's); ``model_only``: the same TP 1 load without the optimizer, whose step differs
    (``model_only_after_err``). Last, the base folder changed: the load's one-line error
    (``changed_base_error``)."""
    import torch.distributed as dist

    from megatron_tepo.checkpoint.store import CheckpointError
    from megatron_tepo.layout import ParallelLayout

    base = root / "base"
    hf_cfg = tiny_hf_config("qwen3", tie=False)
    batch = make_batch(seed=1)
    with torch.no_grad():
        ref_lp, _ = hf_log_probs(make_hf_model(hf_cfg, seed=0), batch)  # (the folder's weights)
    batch.old_log_probs = (ref_lp + 0.05 * torch.randn(ref_lp.shape, generator=torch.Generator().manual_seed(7))) \
        * batch.response_mask
    out = {"case": case}
    actor = _lora_actor(hf_cfg, str(base), ParallelLayout(tp=2))
    _set_random_b(actor)
    actor.train_step(_local(actor, batch), LOSS)
    ckpt = root / "ckpt_lora"
    actor.save_checkpoint(ckpt, extra_state={"step": 1})
    out["base_file"] = json.loads((ckpt / "lora_base.json").read_text())
    out["base_keys"] = _base_keys(ckpt)
    want_lp, _ = actor.compute_log_probs(batch)
    want_m = actor.train_step(_local(actor, batch), LOSS)
    want_after, _ = actor.compute_log_probs(batch)
    del actor

    for name, layout, model_only in (("same", ParallelLayout(tp=2), False), ("tp1", ParallelLayout(tp=1), False),
                                     ("pp2", ParallelLayout(pp=2), False), ("model_only", ParallelLayout(tp=1), True)):
        fresh = _lora_actor(hf_cfg, None, layout, seed=99)
        extra = fresh.load_checkpoint(ckpt, model_only=model_only)
        lp, _ = fresh.compute_log_probs(batch)
        m = fresh.train_step(_local(fresh, batch), LOSS)
        after, _ = fresh.compute_log_probs(batch)
        out[name] = {"extra": extra, "lp_err": float((lp - want_lp).abs().max()),
                     "after_err": float((after - want_after).abs().max()),
                     "loss_err": abs(m["loss"] - want_m["loss"]),
                     "grad_norm_err": abs(m["grad_norm"] - want_m["grad_norm"]),
                     "lp_equal": torch.equal(lp, want_lp), "after_equal": torch.equal(after, want_after),
                     "loss_equal": m["loss"] == want_m["loss"] and m["grad_norm"] == want_m["grad_norm"]}
        del fresh
    out["lp_scale"] = float(want_lp.abs().max())

    # the base changed since the save: refused, one line
    if dist.get_rank() == 0:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(base / "model.safetensors"))
        tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0
        save_file(tensors, str(base / "model.safetensors"))
    dist.barrier()
    fresh = _lora_actor(hf_cfg, None, ParallelLayout(tp=2), seed=99)
    try:
        fresh.load_checkpoint(ckpt)
        out["changed_base_error"] = None
    except CheckpointError as e:
        out["changed_base_error"] = str(e)
    return out


def main():
    root = Path(sys.argv[1])
    cases = json.loads(sys.argv[2])
    write_result({"cases": [run_resume_case(c, root) if c.get("resume") else run_case(c, root) for c in cases]})


if __name__ == "__main__":
    main()
