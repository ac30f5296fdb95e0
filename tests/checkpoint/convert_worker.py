"""torchrun worker for tests/checkpoint: convert / load / compare, results via write_result.

    convert_worker.py import  ROOT TP PP VARIANT[,VARIANT..] [--logits] [--ep N] [--reference]
        ROOT/hf-<v> -> ROOT/mg-<v>-tp{TP}pp{PP}[ep{N}] (streaming; reports the rank's import stats);
        with --logits also build the model at TP/PP/EP, load the checkpoint and compare logits with
        the HF model; with --reference also write ROOT/mg-<v>-...-ref by the whole-model path.
    convert_worker.py logits  CKPT HFDIR TP PP [EP]  load CKPT at TP/PP/EP, compare logits with HFDIR
    convert_worker.py roundtrip ROOT VARIANT[,..]  (1 process) hf -> megatron (TP=1) -> hf, torch.equal
    convert_worker.py export  ROOT SUFFIX VARIANT[,..] (1 process) ROOT/mg-<v>-SUFFIX -> hf, torch.equal
    convert_worker.py ep1 ROOT SUFFIX VARIANT[,..]   (1 process) MoE at EP=1: the TP=1 round trip,
        plus ROOT/mg-<v>-SUFFIX (saved at EP=2) exported (bitwise) and loaded at EP=1 (logits)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.checkpoint.fixtures import causal_lm, load_hf_tensors  # noqa: E402
from tests.dist_utils import write_result  # noqa: E402


def input_ids(vocab: int, b: int = 2, s: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(7))


def megatron_logits(model, ids: torch.Tensor):
    """Full-vocab fp32 logits [b, s, V] on the last pipeline stage (None elsewhere)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    pos = torch.arange(s).expand(b, s)
    model.eval()
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, b, model.config.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor([hidden])
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out.float()


def compare_logits(ckpt, hf_dir, tp: int, pp: int, ep: int = 1) -> dict:
    import json

    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.parallel import initialize_parallel
    from megatron_tepo.checkpoint import build_model, load_checkpoint_into
    from megatron_tepo.models import family_config_from_hf

    fc = family_config_from_hf(json.loads((Path(hf_dir) / "config.json").read_text()), spec="local")
    initialize_parallel(ParallelLayout(tp=tp, pp=pp, ep=ep), fc, backend="gloo", sequence_parallel=tp > 1)  # (as the converter)
    model = build_model(fc, torch.float32)
    load_checkpoint_into(model, ckpt)
    ids = input_ids(fc.vocab_size)
    got = megatron_logits(model, ids)
    if got is None:
        return {"has_logits": False}
    with torch.no_grad():
        ref = causal_lm(hf_dir)(input_ids=ids).logits.float()
    out_path = Path(ckpt).parent / f"logits-{Path(ckpt).name}-tp{tp}pp{pp}ep{ep}-r{dist_rank()}.pt"
    torch.save(got, out_path)
    return {"has_logits": True, "max_abs_diff": float((got - ref).abs().max()),
            "ref_max": float(ref.abs().max()), "saved": str(out_path)}


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def roundtrip_equal(a_dir, b_dir) -> dict:
    a, b = load_hf_tensors(a_dir), load_hf_tensors(b_dir)
    return {"same_names": sorted(a) == sorted(b), "n": len(a),
            "not_equal": [k for k in a if k in b and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))],
            "files": sorted(p.name for p in Path(b_dir).iterdir())}


def main():
    mode, rest = sys.argv[1], sys.argv[2:]
    from megatron_tepo.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf

    res = {}
    if mode == "import":
        root, tp, pp, variants = Path(rest[0]), int(rest[1]), int(rest[2]), rest[3].split(",")
        ep = int(rest[rest.index("--ep") + 1]) if "--ep" in rest else 1
        for v in variants:
            ckpt = root / (f"mg-{v}-tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else ""))
            convert_hf_to_megatron(root / f"hf-{v}", ckpt, tp=tp, pp=pp, ep=ep, progress=False)
            from megatron_tepo.checkpoint import hf_to_megatron as import_module

            res[v] = {"import_stats": dict(import_module.last_import_stats)}
            if "--reference" in rest:
                convert_hf_to_megatron(root / f"hf-{v}", ckpt.with_name(ckpt.name + "-ref"), tp=tp, pp=pp,
                                       ep=ep, progress=False, streaming=False)
            if "--logits" in rest:
                res[v].update(compare_logits(ckpt, root / f"hf-{v}", tp, pp, ep))
    elif mode == "logits":
        res = compare_logits(rest[0], rest[1], int(rest[2]), int(rest[3]),
                             int(rest[4]) if len(rest) > 4 else 1)
    elif mode == "roundtrip":
        root, variants = Path(rest[0]), rest[1].split(",")
        for v in variants:
            convert_hf_to_megatron(root / f"hf-{v}", root / f"mg-{v}-tp1pp1", progress=False)
            convert_megatron_to_hf(root / f"mg-{v}-tp1pp1", root / f"back-{v}-tp1pp1", progress=False)
            res[v] = roundtrip_equal(root / f"hf-{v}", root / f"back-{v}-tp1pp1")
    elif mode == "export":
        root, suffix, variants = Path(rest[0]), rest[1], rest[2].split(",")
        for v in variants:
            convert_megatron_to_hf(root / f"mg-{v}-{suffix}", root / f"back-{v}-{suffix}", progress=False,
                                   max_shard_bytes=int(os.environ.get("MTEPO_MAX_SHARD_BYTES", 2 * 1024 ** 3)))
            res[v] = roundtrip_equal(root / f"hf-{v}", root / f"back-{v}-{suffix}")
    elif mode == "ep1":
        root, suffix, variants = Path(rest[0]), rest[1], rest[2].split(",")
        for v in variants:
            hf, ckpt = root / f"hf-{v}", root / f"mg-{v}-{suffix}"
            convert_hf_to_megatron(hf, root / f"mg-{v}-tp1pp1", progress=False)
            convert_megatron_to_hf(root / f"mg-{v}-tp1pp1", root / f"back-{v}-tp1pp1", progress=False)
            convert_megatron_to_hf(ckpt, root / f"back-{v}-{suffix}", progress=False)
            res[v] = {"roundtrip_ep1": roundtrip_equal(hf, root / f"back-{v}-tp1pp1"),
                      "export_of_ep2": roundtrip_equal(hf, root / f"back-{v}-{suffix}"),
                      "logits_ep1": compare_logits(root / f"mg-{v}-tp1pp1", hf, 1, 1),
                      "logits_ep2_ckpt_at_ep1": compare_logits(ckpt, hf, 1, 1)}
    else:
        raise SystemExit(f"unknown mode {mode}")
    write_result(res)
    from megatron_tepo.megatron.parallel import destroy_parallel

    destroy_parallel()


if __name__ == "__main__":
    main()
