"""torchrun worker for tests/ops/test_lm_head.py: the fused LM head at TP=2.

Every rank builds the same hidden states, full output weight and labels (same seed) and keeps its
half of the weight's rows; the head runs over the gloo group. The hidden states' gradient (each
rank's part) is summed over the group, as megatron's tensor-parallel region does, and compared
with float64 torch on the full vocabulary, as are the outputs and the rank's weight-shard gradient.
Findings go to write_result; the test asserts on them.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_tepo.ops.lm_head import lm_head_log_probs_and_entropy  # noqa: E402
from tests.dist_utils import write_result  # noqa: E402


def run_case(*, dtype, temperature, block, n, h, vocab, group, rank, tp, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(vocab, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (n,), generator=g)
    v_local = vocab // tp
    labels[0], labels[1], labels[2], labels[3] = 0, vocab - 1, v_local - 1, v_local  # both ranks' edges
    g1 = torch.randn(n, generator=g, dtype=torch.float64)
    g2 = torch.randn(n, generator=g, dtype=torch.float64)

    h_in = hidden.to(dtype).requires_grad_()
    w_in = weight[rank * v_local:(rank + 1) * v_local].to(dtype).contiguous().requires_grad_()
    lp, ent = lm_head_log_probs_and_entropy(h_in, w_in, labels, tp_group=group, temperature=temperature,
                                            block_size=block)
    ((lp.double() * g1).sum() + (ent.double() * g2).sum()).backward()
    grad_h = h_in.grad.double()
    dist.all_reduce(grad_h, group=group)

    rh = hidden.to(dtype).double().requires_grad_()
    rw = weight.to(dtype).double().requires_grad_()
    logp = ((rh @ rw.t()) / temperature).log_softmax(-1)
    r_lp, r_ent = logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    ((r_lp * g1).sum() + (r_ent * g2).sum()).backward()
    r_gw = rw.grad[rank * v_local:(rank + 1) * v_local]

    def err(a, b):
        return float((a.double() - b).abs().max()) / max(float(b.abs().max()), 1.0)

    return {"lp": err(lp, r_lp), "ent": err(ent, r_ent), "grad_hidden": err(grad_h, rh.grad),
            "grad_weight": err(w_in.grad, r_gw), "weight_grad_scale": float(r_gw.abs().max()),
            "owned_labels": int(((labels >= rank * v_local) & (labels < (rank + 1) * v_local)).sum())}


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    common = dict(group=group, rank=rank, tp=world)
    write_result({"rank": rank, "cases": {
        "f64_blocks": run_case(dtype=torch.float64, temperature=0.7, block=9, n=17, h=6, vocab=60, seed=0, **common),
        "f64_one_block": run_case(dtype=torch.float64, temperature=1.0, block=None, n=5, h=4, vocab=20, seed=1,
                                  **common),
        "f32_blocks": run_case(dtype=torch.float32, temperature=1.3, block=16, n=31, h=8, vocab=128, seed=2,
                               **common),
    }})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
