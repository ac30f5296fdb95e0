"""Bytes of one weight sync of a LoRA run: the adapters alone (``actor.lora.sync: adapters``) against
the merged model (``merged``, every weight), by arithmetic from a model's shape.

    .venv/bin/python benchmarks/lora_sync_bytes.py [--rank 32] [--wire-bytes 2] [--json]

What it counts. The merged sync sends every tensor of the HF model (embeddings, every layer's
linears and norms, the final norm, an untied ``lm_head``); the adapters' sync sends PEFT's tensors of
every target (q/k/v/o, gate/up/down): per HF linear ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``
(q/k/v each carry a copy of the fused ``linear_qkv``'s one A, gate/up of ``linear_fc1``'s: what
``megatron/lora_peft.py`` sends and SGLang loads). Floating tensors at ``--wire-bytes`` each
(``rollout.sync_dtype``: 2 for bf16, the default). Shapes: the tiny Qwen3 of
``tests/rollout/test_sglang_lora.py`` (whose real-server run measures the same two numbers at fp32:
the sync's ``SyncStats.bytes``) and Qwen3-14B / Qwen3-32B (their HF configs' shapes).
"""
from __future__ import annotations

import argparse
import json

#: hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied embeddings
SHAPES = {
    "tiny-qwen3 (test_sglang_lora)": (64, 2, 4, 2, 16, 128, 256, False),
    "Qwen3-14B": (5120, 40, 40, 8, 128, 17408, 151936, False),
    "Qwen3-32B": (5120, 64, 64, 8, 128, 25600, 151936, False),
}


def linears(hidden, heads, kv, head_dim, inter):
    """``(out, in)`` of each HF linear of one layer, by name."""
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden), "v_proj": (kv * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def merged_elements(hidden, layers, heads, kv, head_dim, inter, vocab, tied) -> int:
    per_layer = sum(o * i for o, i in linears(hidden, heads, kv, head_dim, inter).values())
    per_layer += 2 * hidden + 2 * head_dim  # input / post-attention norms, q / k norms
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


def adapter_elements(rank, hidden, layers, heads, kv, head_dim, inter, vocab, tied) -> int:
    return layers * sum(rank * i + o * rank for o, i in linears(hidden, heads, kv, head_dim, inter).values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--wire-bytes", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        for rank, wire in ((4, 4), (a.rank, a.wire_bytes)) if name.startswith("tiny") else ((a.rank, a.wire_bytes),):
            full, lora = merged_elements(*shape) * wire, adapter_elements(rank, *shape) * wire
            rows.append({"model": name, "rank": rank, "wire_bytes": wire, "merged_sync_bytes": full,
                         "adapters_sync_bytes": lora, "adapters_share": lora / full})
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'model':32} {'rank':>4} {'B/elt':>5} {'merged sync':>16} {'adapters sync':>16} {'share':>8}")
    for r in rows:
        print(f"{r['model']:32} {r['rank']:>4} {r['wire_bytes']:>5} {r['merged_sync_bytes']:>16,} "
              f"{r['adapters_sync_bytes']:>16,} {100 * r['adapters_share']:>7.2f}%")


if __name__ == "__main__":
    main()
