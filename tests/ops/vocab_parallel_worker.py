"""torchrun worker for tests/ops/test_vocab_parallel.py: TP=2 vocab-parallel log-probs/entropy.

Every rank builds the same full-vocabulary logits (same seed), keeps its vocabulary half, runs
the vocab-parallel op over the gloo group and compares outputs and shard gradients with the
full-vocabulary float64 reference. Findings go to write_result; the test asserts on them.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_tepo.ops import vocab_parallel_log_probs_and_entropy  # noqa: E402
from tests.dist_utils import write_result  # noqa: E402


def reference(logits64, labels, temperature):
    lp = (logits64 / temperature).log_softmax(-1)
    return lp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)


def run_case(name, *, dtype, temperature, chunk_size, shape, vocab, use, group, rank, tp,
             spread=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * spread
    labels = torch.randint(0, vocab, shape, generator=gen)
    flat = labels.view(-1)
    # labels owned by either rank: force both halves to appear
    flat[0] = 0
    flat[1] = vocab - 1
    if tp > 1:
        flat[2] = vocab // tp - 1
        flat[3] = vocab // tp
    g1 = torch.randn(shape, generator=gen, dtype=torch.float64)
    g2 = torch.randn(shape, generator=gen, dtype=torch.float64)
    v_local = vocab // tp
    shard = full[..., rank * v_local:(rank + 1) * v_local].to(dtype).contiguous().requires_grad_()
    before = shard.detach().clone()

    logp, ent = vocab_parallel_log_probs_and_entropy(
        shard, labels, tp_group=group, temperature=temperature, chunk_size=chunk_size)
    loss = 0
    if "logp" in use:
        loss = loss + (logp.double() * g1).sum()
    if "ent" in use:
        loss = loss + (ent.double() * g2).sum()
    loss.backward()

    ref_in = full.to(dtype).double().requires_grad_()
    r_logp, r_ent = reference(ref_in, labels, temperature)
    r_loss = 0
    if "logp" in use:
        r_loss = r_loss + (r_logp * g1).sum()
    if "ent" in use:
        r_loss = r_loss + (r_ent * g2).sum()
    r_loss.backward()
    r_grad = ref_in.grad[..., rank * v_local:(rank + 1) * v_local]

    return name, {
        "out_dtype": str(logp.dtype),
        "grad_dtype": str(shard.grad.dtype),
        "logp_err": (logp.double() - r_logp).abs().max().item(),
        "ent_err": (ent.double() - r_ent).abs().max().item(),
        "grad_err": (shard.grad.double() - r_grad).abs().max().item(),
        "grad_scale": r_grad.abs().max().item(),
        "finite": bool(torch.isfinite(logp).all() and torch.isfinite(ent).all()
                       and torch.isfinite(shard.grad).all()),
        "input_unchanged": bool(torch.equal(shard.detach(), before)),
    }


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    singles = [dist.new_group([r]) for r in range(world)]
    out = {"rank": rank, "world": world}
    common = dict(group=group, rank=rank, tp=world)
    cases = [
        run_case("f64_t1", dtype=torch.float64, temperature=1.0, chunk_size=None,
                 shape=(3, 4), vocab=10, use=("logp", "ent"), **common),
        run_case("f64_temp_chunk5", dtype=torch.float64, temperature=0.6, chunk_size=5,
                 shape=(3, 4), vocab=10, use=("logp", "ent"), seed=1, **common),
        run_case("f64_logp_only", dtype=torch.float64, temperature=1.3, chunk_size=3,
                 shape=(13,), vocab=14, use=("logp",), seed=2, **common),
        run_case("f64_ent_only", dtype=torch.float64, temperature=0.8, chunk_size=4,
                 shape=(2, 5), vocab=12, use=("ent",), seed=3, **common),
        run_case("f64_extreme", dtype=torch.float64, temperature=1.0, chunk_size=3,
                 shape=(7,), vocab=16, use=("logp", "ent"), spread=1e4, seed=4, **common),
        run_case("f32_temp_chunk7", dtype=torch.float32, temperature=0.7, chunk_size=7,
                 shape=(5, 4), vocab=64, use=("logp", "ent"), seed=5, **common),
    ]
    # a process group of size 1 means "not sharded": full vocabulary on each rank
    cases.append(run_case("f64_group_of_one", dtype=torch.float64, temperature=0.9,
                          chunk_size=2, shape=(5,), vocab=9, use=("logp", "ent"), seed=6,
                          group=singles[rank], rank=0, tp=1))
    out["cases"] = dict(cases)
    write_result(out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
