"""torchrun worker: the bucketed HF export (``MegatronActor.export_hf_state``) against the HF model.

argv[1]: JSON list of cases ``{"family", "tie", "tp", "pp", "ep", "precision"}`` (a bf16 actor
exports its bf16 parameters: the HF weights rounded to bf16, bit for bit). Every rank builds the same
tiny HF model (random weights, randomised norms/biases) and loads it into the actor. Per case and
rank it records, for several bucket sizes and both forms of the export (iterated on every rank:
its pipeline stage; ``flat_buckets`` gathered to global rank 0: the whole model), whether the
exported stream equals the HF state dict bit for bit (gathered: with TP ranks filling
shared-memory buckets and with the point-to-point gather, buffers kept across the exports; and
read late, by a consumer that sets each bucket's ``release`` and copies it only when released) (names, dtypes, shapes, values) -- with
every MoE expert under its global index -- and whether it equals the per-tensor reference
``megatron_to_hf(gather_full_tensors(...))`` (for the tensors the reference has). Also: the bf16
export (cast before the gather) equals the fp32 export cast afterwards, bit for bit.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from tests.dist_utils import write_result
from tests.megatron.helpers import hf_state, make_hf_model, tiny_hf_config


def diff(got: dict, want: dict) -> dict:
    """What differs: missing / extra names, and names whose dtype, shape or bits differ."""
    bad = sorted(n for n in set(got) & set(want)
                 if got[n].dtype != want[n].dtype or got[n].shape != want[n].shape
                 or not torch.equal(got[n], want[n]))
    return {"missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want)), "differ": bad}


def run_case(case):
    import torch.distributed as dist

    from megatron_tepo.actor.actor import MegatronActor
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.actor.export import export_hf_state
    from megatron_tepo.buckets import ExportBuffers
    from megatron_tepo.models import megatron_to_hf
    from megatron_tepo.megatron.sharding import gather_full_tensors

    hf_cfg = tiny_hf_config(case["family"], tie=case["tie"])
    model = make_hf_model(hf_cfg, seed=3)
    want = hf_state(model)
    precision = case.get("precision", "fp32")
    actor = MegatronActor(hf_cfg, hf_weights=hf_state(model), precision=precision,
                          layout=ParallelLayout(tp=case["tp"], pp=case.get("pp", 1), ep=case.get("ep", 1)))
    if precision == "bf16":
        want = {n: t.to(torch.bfloat16) for n, t in want.items()}
    rank = dist.get_rank()
    out = {"case": case, "checks": {}}
    ref = {n: t.clone() for n, t in megatron_to_hf(gather_full_tensors(actor.model), actor.family_cfg)}
    out["ref_vs_hf"] = diff(ref, {n: want[n] for n in ref})
    # what iterating gives each rank: its own pipeline stage (every expert of it)
    stage_want = want if case.get("pp", 1) == 1 else {n: want[n] for n in ref}
    out["ref_experts"] = sorted(n for n in ref if ".mlp.experts." in n)
    out["hf_experts"] = sorted(n for n in want if ".mlp.experts." in n)
    keep = {"1": ExportBuffers(), "0": ExportBuffers()}  # kept across the bucket sizes below
    for bb in (1 << 10, 40 << 10, 64 << 20):  # one tensor per bucket, a few per bucket, all in one
        it = {n: t.clone() for n, t in export_hf_state(actor.model, actor.family_cfg,
                                                        tp_group=actor.tp_group, bucket_bytes=bb)}
        out["checks"][f"iter_{bb}"] = diff(it, stage_want)
        out["checks"][f"iter_{bb}_vs_ref"] = diff({n: it[n] for n in ref if n in it}, ref)
        for shm in ("1", "0"):  # TP ranks filling shared-memory buckets / point-to-point gather
            os.environ["MTEPO_EXPORT_SHM"] = shm
            got, nbuckets = {}, 0
            for b in actor.export_hf_state().flat_buckets(bucket_bytes=bb, dst=0, reuse=True, buffers=keep[shm]):
                nbuckets += 1
                got.update({n: t.clone() for n, t in b.named_tensors()})
            if rank == 0:
                out["checks"][f"dst0_{bb}_shm{shm}"] = diff(got, want)
            else:
                out["dst0_nonroot_yielded"] = out.get("dst0_nonroot_yielded", 0) + len(got)
            out.setdefault("buckets", {})[bb] = nbuckets
            # a consumer still reading bucket k after asking for k+1 (an asynchronous send): it
            # sets ``release``, which the export must call before that buffer is written again
            late, released = {}, []

            def release_of(b):
                def release():
                    released.append(len(b.names))
                    late.update({n: t.clone() for n, t in b.named_tensors()})
                return release

            n = 0
            for b in actor.export_hf_state().flat_buckets(bucket_bytes=bb, dst=0, reuse=True, buffers=keep[shm]):
                b.release = release_of(b)
                n += 1
            if rank == 0:
                out["checks"][f"late_{bb}_shm{shm}"] = diff(late, want)
                out.setdefault("released", {})[f"{bb}_shm{shm}"] = [len(released), n]
    # the buffers kept across the exports above: which path ran
    out["shared_buffers"] = {shm: sum(k[0] == "shared" for k in keep[shm].held) for shm in keep}
    os.environ["MTEPO_EXPORT_SHM"] = "1"
    bf = {n: t.clone() for n, t in actor.export_hf_state(dtype=torch.bfloat16)}
    out["checks"]["bf16"] = diff(bf, {n: t.to(torch.bfloat16) for n, t in stage_want.items()})
    got = {}  # bf16 gathered to rank 0 (co-located TP ranks: cast straight into shared memory)
    for b in actor.export_hf_state(dtype=torch.bfloat16).flat_buckets(dst=0, reuse=True, buffers=keep["1"]):
        got.update({n: t.clone() for n, t in b.named_tensors()})
    if rank == 0:
        out["checks"]["bf16_dst0"] = diff(got, {n: t.to(torch.bfloat16) for n, t in want.items()})
    return out


def main():
    cases = json.loads(sys.argv[1])
    write_result({"cases": [run_case(c) for c in cases]})


if __name__ == "__main__":
    main()
