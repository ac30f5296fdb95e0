"""torchrun worker for tests/megatron/test_context_parallel.py: context-parallel attention (CP = the
world) against one rank's attention of the whole packed sequences.

Every rank builds the same packed query / key / value / upstream gradient (float64, grouped-query
heads, sequences some shorter than 2 x CP tokens), takes its own tokens with ``context_split``,
runs ``context_parallel_attention`` and backward, and compares its real tokens' outputs and the
gradients of its queries, keys and values with ``packed_attention`` of the whole sequences. Findings
go to write_result; the test asserts on them.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from megatron_tepo.megatron.attention import context_parallel_attention, packed_attention  # noqa: E402
from megatron_tepo.token_layout import context_split  # noqa: E402
from tests.dist_utils import write_result  # noqa: E402


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    lens = torch.tensor([7, 1, 12, 3, 9])
    total, heads, kv_heads, d = int(lens.sum()), 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q, grad_out = (torch.randn(total, heads, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, kv_heads, d, generator=g, dtype=torch.float64) for _ in range(2))
    scale = d ** -0.5
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = packed_attention(*ref_in, cu, scale, mode="loop")
    (ref * grad_out).sum().backward()

    splits = [context_split(lens, size, r) for r in range(size)]
    mine = splits[rank]
    local = [mine.take(x).requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*local, splits, scale, group)
    (out * mine.take(grad_out)).sum().backward()

    real = mine.take(torch.ones(total, dtype=torch.bool), fill=False)

    def err(a, b):
        return float((a[real] - b[real]).abs().max())

    write_result({"rank": rank, "size": size, "tokens": int(real.sum()), "local_tokens": int(out.shape[0]),
                  "out": err(out.detach(), mine.take(ref.detach())),
                  "grad_q": err(local[0].grad, mine.take(ref_in[0].grad)),
                  "grad_k": err(local[1].grad, mine.take(ref_in[1].grad)),
                  "grad_v": err(local[2].grad, mine.take(ref_in[2].grad)),
                  "pad_key_grad": float(local[1].grad[~real].abs().max()) if bool((~real).any()) else 0.0,
                  "scale": float(ref.detach().abs().max())})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
