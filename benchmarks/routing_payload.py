"""What r3's routing costs on the wire and on the driver: bytes a token and decode time, per wire dtype.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/routing_payload.py [--layers 48 --topk 8 --experts 128
        --moe-layers 48] [--tokens 10240] [--samples 512] [--repeats 5] [--decoders 4 --answers 48] [--json [PATH]]

What it measures. With ``actor.routing_replay: r3`` every ``/generate`` answer carries
``meta_info["routed_experts"]``: the base64 of ``[prompt + output - 1, num_hidden_layers, topk]``
expert ids. SGLang up to 0.5.23 sends them as int32; its newer source
(``srt/state_capturer/routed_experts_wire.py``) in the dtype ``SGLANG_ROUTED_EXPERTS_DTYPE`` names
(uint16, uint8), naming it in ``meta_info["routed_experts_dtype"]``, which the fleet's servers are
started with (the narrowest that holds the model's expert ids: ``options.py``). For each wire
dtype, one answer of ``--tokens`` positions is built the way the server builds it (random ids in
range, cast, base64, JSON), and the script reports:

* the bytes a token: raw ids, base64 in the JSON answer, and what the driver keeps after
  decoding (``Sample.routed_experts``: the MoE layers in int8 up to 128 experts, else int16);
* for a step of ``--samples`` answers of ``--tokens`` positions: the JSON bytes the driver
  receives and what it keeps;
* the CPU time to parse the JSON and decode one answer on the thread that read it (``json.loads``
  of the body's bytes + the routing decode, all under the GIL: what a request thread did before
  #56 row 10, and does with ``FleetConfig.routing_decoders: 0``), the median of ``--repeats``, per
  token and per step;
* the same answers through the fleet's decoder processes (``routing.RoutingDecoder`` of
  ``--decoders`` processes, ``--answers`` answers handed over from as many threads at once): the
  CPU time the driver's own process spends per token (all its threads, user and system: writing
  the bytes to a decoder's pipe and reading the ids back; the system part runs without the GIL)
  and the wall time per answer.

Defaults: Qwen3-30B-A3B (48 layers, all MoE, top-8 of 128 experts), 512 samples of 10,240
positions (the 30B-A3B example's step: 64 prompts x 8 samples, up to 10,240 tokens each). The
results: docs/BENCHMARKS.md ("MoE routing on the wire").
"""
import argparse
import base64
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from megatron_tepo.rollout.sglang.routing import WIRE_DTYPES, RoutingDecoder, routed_experts_of  # noqa: E402
from megatron_tepo.routing import RoutingShape  # noqa: E402


def answer(ids: np.ndarray, wire: str, legacy: bool) -> str:
    """A ``/generate`` answer's JSON as the server writes it (``legacy``: 0.5.23, no dtype key)."""
    meta = {"routed_experts": base64.b64encode(ids.astype(WIRE_DTYPES[wire]).tobytes()).decode("utf-8"),
            "prompt_tokens": ids.shape[0]}
    if not legacy:
        meta["routed_experts_dtype"] = wire
    return json.dumps({"output_ids": [0], "meta_info": meta})  # (prompt + output - 1 = the ids' positions)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--moe-layers", type=int, default=None, help="default: every layer")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=10240)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decoders", type=int, default=4, help="decoder processes (FleetConfig.routing_decoders)")
    ap.add_argument("--answers", type=int, default=48, help="answers through the decoder processes")
    ap.add_argument("--json", nargs="?", const="-", default=None, help="also write the rows as JSON (- : stdout)")
    a = ap.parse_args(argv)
    moe = a.layers if a.moe_layers is None else a.moe_layers
    shape = RoutingShape(a.layers, tuple(range(a.layers - moe, a.layers)), a.topk, a.experts)
    ids = np.random.default_rng(0).integers(0, a.experts, size=(a.tokens, a.layers, a.topk), dtype=np.int32)
    rows = []
    cases = [("int32", True, "int32 (SGLang <= 0.5.23)")]
    cases += [(w, False, f"{w} (routed_experts_dtype)") for w in ("uint16", "uint8")
              if a.experts <= np.iinfo(WIRE_DTYPES[w]).max + 1]
    for wire, legacy, label in cases:
        text = answer(ids, wire, legacy)
        body = text.encode()
        times = []
        for _ in range(a.repeats):
            t0 = time.thread_time()  # (CPU time: what the thread holds the GIL for; a loaded machine
            out = routed_experts_of(json.loads(body)["meta_info"], a.tokens, shape, "bench")
            times.append(time.thread_time() - t0)  # stretches the wall time, much less this)
        decoder = RoutingDecoder(shape, a.decoders)
        try:
            decoder.read(body, "bench")  # (the processes started)
            with ThreadPoolExecutor(a.decoders) as threads:
                cpu0, wall0 = os.times(), time.perf_counter()
                got = list(threads.map(lambda _: decoder.read(body, "bench"), range(a.answers)))
                cpu1, wall = os.times(), time.perf_counter() - wall0
        finally:
            decoder.close()
        assert all((g["meta_info"]["routed_experts"] == out.numpy()).all() for g in got)
        raw = a.layers * a.topk * WIRE_DTYPES[wire].itemsize
        kept = out.element_size() * out[0].numel()
        t = statistics.median(times)
        rows.append({"wire": label, "raw_bytes_per_token": raw, "json_bytes_per_token": len(text) / a.tokens,
                     "kept_bytes_per_token": kept, "step_json_gb": len(text) * a.samples / 1e9,
                     "step_kept_gb": kept * a.tokens * a.samples / 1e9, "decode_us_per_token": t / a.tokens * 1e6,
                     "decode_s_per_step": t * a.samples,
                     "pool_driver_user_us_per_token": (cpu1.user - cpu0.user) / (a.answers * a.tokens) * 1e6,
                     "pool_driver_sys_us_per_token": (cpu1.system - cpu0.system) / (a.answers * a.tokens) * 1e6,
                     "pool_wall_ms_per_answer": wall / a.answers * 1e3})
    print(f"{a.layers} layers ({moe} MoE) x top-{a.topk} of {a.experts} experts; a step: {a.samples} answers of "
          f"{a.tokens} positions; on the thread: median of {a.repeats}; {a.decoders} decoder processes: "
          f"{a.answers} answers")
    print("| wire | raw B/token | JSON B/token | kept B/token | step JSON (GB) | step kept (GB) "
          "| on the thread (us/token) | on the thread (s/step) | decoders: driver user + system CPU (us/token) "
          "| decoders: wall (ms/answer) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['wire']} | {r['raw_bytes_per_token']} | {r['json_bytes_per_token']:.0f} | "
              f"{r['kept_bytes_per_token']} | {r['step_json_gb']:.2f} | {r['step_kept_gb']:.2f} | "
              f"{r['decode_us_per_token']:.3f} | {r['decode_s_per_step']:.1f} | "
              f"{r['pool_driver_user_us_per_token']:.3f} + {r['pool_driver_sys_us_per_token']:.3f} | "
              f"{r['pool_wall_ms_per_answer']:.0f} |")
    if a.json:
        text = json.dumps(rows, indent=1)
        print(text) if a.json == "-" else Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
