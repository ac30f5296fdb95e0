"""Benchmark: the Megatron actor's old-log-prob pass and train step, tokens/s, TFLOP/s and peak memory.

For an HF config shape with random weights (megatron's init; ``--shape``: ``qwen3-0.6b`` -- the
shape of ``../shared/gpu/actor_gpu.py``: 28 layers, hidden 1024, 16 heads, 8 KV groups, head_dim
128, FFN 3072, vocabulary 151936, tied embeddings --, ``tiny`` for CPU, or a ``config.json``), one
process (TP=1), for each batch of ``--batches`` (``BxL``: B sequences of L tokens, a 256-token
prompt -- ``L // 8`` when shorter -- and the rest response) and each variant of ``--variant``
(repeatable ``key=value,...`` over the ``actor`` settings: precision, attention, recompute,
recompute_num_layers, pack_sequences, max_tokens_per_micro_batch, fusions -- or a preset name; a
variant may end with ``@BxL:BxL...``, its own batches instead of ``--batches``):

* ``compute_log_probs`` and ``train_step`` (TEPO loss, one Adam step): median wall time over
  ``--repeats`` after one warm-up (synchronised on GPU), tokens/s of the train step;
* model TFLOP/s: ``6 * P * T`` plus causal attention ``3 * 2 * s^2 * heads * head_dim`` per
  sequence and layer (``2 * P * T`` and one third of the attention for the log-prob pass), with
  ``P`` the parameters that multiply (the input embedding excluded unless tied), ``T`` the tokens.
  Recompute's extra forward is not counted (the usual model-FLOPs convention);
* peak memory: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the process's peak RSS growth
  (``ru_maxrss``; coarse, and it never goes down, so a later variant shows only what it adds).

A variant that runs out of memory reports ``"error": "OOM ..."`` and the next one runs. JSON lines
go to stdout and, with ``--json``, to a file.

``--anchor hf`` first measures a plain Hugging Face ``transformers`` model on the same batches, in the
same process: bf16, SDPA attention, one micro-batch per batch; its train step is forward, a token
log-prob loss, backward and ``torch.optim.AdamW(fused=True)``; its log-prob pass computes log-probs
and entropy with a float softmax. Every actor row then carries ``train_vs_hf`` and
``log_probs_vs_hf``: its time as a ratio to the anchor's (below 1: faster than plain HF).

``--offload ROUNDS`` adds, after the first variant's timed steps, the actor's memory round trip of
colocated mode (``MegatronActor.offload`` / ``onload`` of its optimizer states, gradients and
parameters; :mod:`megatron_tepo.megatron.offload`): one more forward-backward on a 2x256 batch puts
gradients in the buffers (the timed steps made Adam's states), every storage of the three parts
is copied aside, then ``ROUNDS`` offload + onload rounds run, each synchronised before and after
(the first allocates the host copies, pinned on GPU; GB/s is the median of the others, bytes moved
over seconds, 1 GB = 1e9 bytes). One row ``"kind": "offload"`` reports the bytes per part, each
round's seconds, ``offload_gbps`` / ``onload_gbps``, the device memory freed while offloaded (GPU),
the pinned host bytes the copies took (GPU, torch's host allocator statistics where it has them),
and ``bit_exact``: after every round each storage equals its copy byte for byte, and every one had
its memory freed while offloaded. On CPU the "device" is host memory: the copies are plain memcpy.

``--counts`` adds, per batch, what one step launches and syncs (:mod:`megatron_tepo.actor.costs`:
aten ops and host syncs of the log-prob pass, the forward-backward and the optimizer step, the
core attention left out) and the graphs dynamo compiled by then: what a launch-bound GPU pays for,
counted on a CPU.

    python benchmarks/actor_step.py                               # CPU: tiny shape, small batches
    python benchmarks/actor_step.py --device cuda                 # GPU: qwen3-0.6b, 8x2048, 1x8448, 1x32768
    python benchmarks/actor_step.py --counts --batches 2x256,16x32  # CPU: ops / syncs beside the timings
    python benchmarks/actor_step.py --offload 4 --variant gpu-fast   # + the actor's offload / onload round trip

Defaults on GPU: variants ``today`` (fp32, unfused attention, padded rows, no recompute: the
actor before bf16 / SDPA / packing / recompute existed) and ``bf16`` (bf16, sdpa, packed, full
recompute, 16384-token micro-batches); on CPU the tiny shape with ``fp32`` and ``bf16`` variants.
The GPU check (``benchmarks/gpu_check.sh``) runs, with ``--offload 4``, the presets ``gpu-fast`` (bf16, sdpa, packed, no
recompute, 16384-token micro-batches, ``fusions`` as resolved: the speed setting),
``gpu-fast-unfused`` (the same with ``fusions=off``: which of the two is faster decides the
default) and ``gpu-lean`` (the same with full recompute and 32768-token micro-batches: the
long-sequence setting), with ``--anchor hf``.

Left out: TP/PP/DP (one process; the collectives of a real layout are not in these numbers), the
rollout engine and the weight sync, the loss's own arithmetic beyond TEPO's defaults, and a
separate measurement of the optimizer step (it is inside ``train_step``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1e6),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=32, vocab_size=8192, tie_word_embeddings=True,
                 max_position_embeddings=4096, rope_theta=1e6),
}
PRESETS = {
    "today": "precision=fp32,attention=unfused,pack_sequences=false,recompute=none",
    "fp32": "precision=fp32",
    "bf16": "precision=bf16,recompute=full",
    "gpu-fast": "precision=bf16,attention=sdpa,pack_sequences=true,recompute=none,max_tokens_per_micro_batch=16384",
    "gpu-fast-unfused": "precision=bf16,attention=sdpa,pack_sequences=true,recompute=none,max_tokens_per_micro_batch=16384,"
                        "fusions=off",
    "gpu-lean": "precision=bf16,attention=sdpa,pack_sequences=true,recompute=full,max_tokens_per_micro_batch=32768",
}


def split_variant(text: str):
    """``(label, settings, batches or None)`` of a ``--variant`` argument (``SETTINGS[@BxL:BxL...]``)."""
    body, _, batches = text.partition("@")
    return body, parse_variant(body), parse_batches(batches.replace(":", ",")) if batches else None


def parse_batches(text: str) -> list:
    return [tuple(int(x) for x in item.lower().split("x")) for item in text.split(",") if item]


def parse_variant(text: str) -> dict:
    text = PRESETS.get(text, text)
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        value = value.strip()
        out[key.strip()] = (value == "true") if value in ("true", "false") else int(value) if value.isdigit() else value
    return out


def hf_config(shape: str) -> dict:
    if shape in SHAPES:
        return dict(SHAPES[shape], architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                    rms_norm_eps=1e-6)
    return json.loads(Path(shape).read_text())


def flops(cfg: dict, n_params: int, batch: tuple) -> tuple:
    """(train, log-prob pass) model FLOPs of a batch (see the module docstring)."""
    b, length = batch
    heads, d = cfg["num_attention_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attn_fwd = b * cfg["num_hidden_layers"] * 2 * length * length * heads * d  # causal: half of 4 s^2 h d
    tokens = b * length
    return 6 * n_params * tokens + 3 * attn_fwd, 2 * n_params * tokens + attn_fwd


def matmul_params(actor, cfg: dict) -> int:
    total = sum(p.numel() for p in actor.model[0].parameters())
    if not cfg.get("tie_word_embeddings"):
        total -= cfg["vocab_size"] * cfg["hidden_size"]  # the input embedding is a lookup
    return total


def make_batch(b: int, length: int, vocab: int, seed: int = 0):
    from megatron_tepo.actor import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt = 256 if length > 512 else max(1, length // 8)
    resp = length - prompt
    return RolloutBatch(input_ids=torch.randint(0, vocab, (b, length), generator=g),
                        prompt_lens=torch.full((b,), prompt), response_mask=torch.ones(b, resp),
                        advantages=torch.randn(b, resp, generator=g), old_log_probs=torch.zeros(b, resp))


def _sync(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


def _peak(cuda: bool, base_rss: int) -> float:
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss) / 2**30


def timed(log_probs, train, repeats: int, cuda: bool) -> tuple:
    """Median seconds of ``log_probs()`` and of ``train()`` (run one after the other) over ``repeats``
    runs after one warm-up (allocator, compilation), each from an emptied allocator on GPU."""
    lp_s, tr_s = [], []
    for it in range(repeats + 1):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        _sync(cuda)
        t = time.perf_counter()
        log_probs()
        _sync(cuda)
        t1 = time.perf_counter()
        train()
        _sync(cuda)
        t2 = time.perf_counter()
        if it:
            lp_s.append(t1 - t)
            tr_s.append(t2 - t1)
    return median(lp_s), median(tr_s)


def oom_error(exc: BaseException):
    """``"OOM: ..."`` for an out-of-memory error (the next variant runs), None for any other."""
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc):
        return f"OOM: {str(exc).splitlines()[0][:200]}"
    return None


def hf_anchor(cfg: dict, batches, repeats: int, cuda: bool) -> dict:
    """``{"BxL": row}``: the plain transformers model's train step and log-prob pass (see the module
    docstring), median of ``repeats`` after a warm-up, and its peak memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.bfloat16,
                                             attn_implementation="sdpa").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    out = {}
    for b, length in batches:
        batch = make_batch(b, length, cfg["vocab_size"])
        ids, adv = batch.input_ids.to(device), batch.advantages.to(device)
        p = int(batch.prompt_lens[0])
        row = {"label": "hf", "batch": f"{b}x{length}", "tokens": b * length}
        base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        got = {}

        def log_probs():
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[:, p - 1:-1].float(), -1)
                got["lp"] = logp.gather(-1, ids[:, p:, None]).squeeze(-1)
                got["ent"] = -(logp.exp() * logp).sum(-1)

        def train():
            logits = model(input_ids=ids).logits[:, p - 1:-1]
            tok = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, p:, None]).squeeze(-1)
            (-(tok * adv).mean()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        try:
            lp_s, tr_s = timed(log_probs, train, repeats, cuda)
            row.update(log_probs_s=round(lp_s, 4), train_step_s=round(tr_s, 4),
                       train_tokens_per_s=round(b * length / tr_s), peak_gib=round(_peak(cuda, base_rss), 2),
                       entropy_mean=round(float(got["ent"].mean()), 4), log_prob_mean=round(float(got["lp"].mean()), 4))
        except RuntimeError as exc:  # (torch.OutOfMemoryError is one)
            row["error"] = oom_error(exc)
            if row["error"] is None:
                raise
        print(json.dumps(row), flush=True)
        out[row["batch"]] = row
    model = opt = None  # (not del: the closures above name them)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def with_anchor(row: dict, anchor: dict) -> dict:
    """``row`` with its times as ratios to the anchor's on the same batch (where both exist)."""
    ref = anchor.get(row["batch"], {})
    for key, name in (("train_step_s", "train_vs_hf"), ("log_probs_s", "log_probs_vs_hf")):
        if key in row and key in ref and ref[key] > 0:
            row[name] = round(row[key] / ref[key], 3)
    return row


OFFLOAD_PARTS = ("optimizer", "grads", "params")


def _storages(actor) -> dict:
    """``{part: {key: storage}}``: the distinct storages (with memory) of each part that the offload moves."""
    out = {}
    for part, tensors in actor.train_model.memory_parts().items():
        out[part] = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes():
                out[part].setdefault(s._cdata, s)  # _cdata: the storage itself (as HostOffload keys them)
    return out


def _bytes_of(storage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _pinned_bytes(cuda: bool):
    """Bytes of pinned host blocks torch's host allocator holds (None on CPU or without the statistic)."""
    if not cuda:
        return None
    try:
        return int(torch.cuda.host_memory_stats()["allocated_bytes.current"])
    except (AttributeError, KeyError, RuntimeError, TypeError):
        return None


def offload_round_trip(actor, cfg: dict, rounds: int, cuda: bool, label: str = "") -> dict:
    """The actor's offload + onload of all three parts, ``rounds`` times (see the module docstring)."""
    from megatron_tepo.algorithms import PolicyLoss

    batch = make_batch(2, 256, cfg["vocab_size"], seed=1)
    batch.old_log_probs, batch.old_entropy = actor.compute_log_probs(batch)
    actor.forward_backward(batch, PolicyLoss.of("tepo", kl_coef=1e-3))  # gradients in the buffers
    _sync(cuda)
    before = _storages(actor)
    snapshot = {k: _bytes_of(s).clone() for part in before.values() for k, s in part.items()}
    part_bytes = {part: sum(s.nbytes() for s in st.values()) for part, st in before.items()}
    total = sum(part_bytes.values())
    grads_nonzero = any(bool(_bytes_of(s).any()) for s in before["grads"].values())
    pinned0 = _pinned_bytes(cuda)
    out_s, in_s, moved, freed, equal, device_freed = [], [], [], [], [], []
    for _ in range(rounds):
        if cuda:
            mem0 = torch.cuda.memory_allocated()
        _sync(cuda)
        t0 = time.perf_counter()
        n_out = actor.offload(OFFLOAD_PARTS)
        _sync(cuda)
        t1 = time.perf_counter()
        if cuda:
            device_freed.append(mem0 - torch.cuda.memory_allocated())
        freed.append(all(t.untyped_storage().nbytes() == 0
                         for ts in actor.train_model.memory_parts().values() for t in ts))
        n_in = actor.onload()
        _sync(cuda)
        t2 = time.perf_counter()
        out_s.append(t1 - t0)
        in_s.append(t2 - t1)
        moved.append((n_out, n_in))
        now = {k: s for part in _storages(actor).values() for k, s in part.items()}
        equal.append(now.keys() == snapshot.keys() and all(torch.equal(_bytes_of(now[k]), v) for k, v in snapshot.items()))
    pinned1 = _pinned_bytes(cuda)
    timed_out, timed_in = (out_s[1:], in_s[1:]) if rounds > 1 else (out_s, in_s)
    row = {"label": label, "kind": "offload", "parts": list(OFFLOAD_PARTS), "rounds": rounds,
           "part_gb": {k: round(v / 1e9, 6) for k, v in part_bytes.items()}, "gb": round(total / 1e9, 6),
           "storages": {k: len(v) for k, v in before.items()},
           "offload_s": [round(x, 5) for x in out_s], "onload_s": [round(x, 5) for x in in_s],
           "offload_gbps": round(total / median(timed_out) / 1e9, 3),
           "onload_gbps": round(total / median(timed_in) / 1e9, 3),
           "moved_every_round": all(a == b == total for a, b in moved),
           "device_freed_gb": round(min(device_freed) / 1e9, 3) if device_freed else None,
           "pinned_host_gb": None if pinned0 is None or pinned1 is None else round((pinned1 - pinned0) / 1e9, 3),
           # the offload's own host blocks, registered with the driver to the byte (issue #40 row 6):
           # what the fit check prices is what moves
           "pinned_registered_gb": round(sum(h.pinned_bytes for h in actor.train_model._host.values()) / 1e9, 6),
           "grads_nonzero": grads_nonzero, "all_freed": all(freed), "bit_exact": all(equal) and all(freed)}
    del snapshot
    return row


def run(cfg: dict, model_dir: str, variant: dict, batches, repeats: int, cuda: bool, label: str = "",
        anchor: dict | None = None, counts: bool = False, offload_rounds: int = 0) -> list:
    from megatron_tepo.actor import MegatronActor
    from megatron_tepo.algorithms import PolicyLoss

    out = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    actor = MegatronActor(model_dir, **variant)
    _sync(cuda)
    build_s = time.perf_counter() - t_build
    n_params = matmul_params(actor, cfg)
    for b, length in batches:
        row = {"label": label, "variant": variant, "batch": f"{b}x{length}", "tokens": b * length,
               "build_s": round(build_s, 2), "params": n_params,
               "settings": {k: getattr(actor.settings, k) for k in ("precision", "attention", "recompute",
                                                                    "pack_sequences", "max_tokens_per_micro_batch")}}
        batch = make_batch(b, length, cfg["vocab_size"])
        base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        got = {}

        def log_probs():
            batch.old_log_probs, batch.old_entropy = actor.compute_log_probs(batch)

        def train():
            got["m"] = actor.train_step(batch, PolicyLoss.of("tepo", kl_coef=1e-3))

        try:
            lp_s, tr_s = timed(log_probs, train, repeats, cuda)
            m = got["m"]
            f_train, f_lp = flops(cfg, n_params, (b, length))
            row.update(log_probs_s=round(lp_s, 4), train_step_s=round(tr_s, 4),
                       train_tokens_per_s=round(b * length / tr_s),
                       train_tflops=round(f_train / tr_s / 1e12, 2),
                       log_probs_tflops=round(f_lp / lp_s / 1e12, 2),
                       peak_gib=round(_peak(cuda, base_rss), 2), loss=m["loss"],
                       micro_batches=m["num_micro_batches"])
            if anchor is not None:
                with_anchor(row, anchor)
            if counts:
                from megatron_tepo.actor.costs import count_step
                from megatron_tepo.launch_costs import compiles

                costs = count_step(actor, batch, PolicyLoss.of("tepo", kl_coef=1e-3))
                row["counts"] = {phase: {"ops": c["ops"], "syncs": c["syncs"]} for phase, c in costs.items()}
                row["counts"]["compiled_graphs"] = compiles()
        except RuntimeError as exc:  # (torch.OutOfMemoryError is one)
            row["error"] = oom_error(exc)
            if row["error"] is None:
                raise
        print(json.dumps(row), flush=True)
        out.append(row)
        batch = None
        gc.collect()
    if offload_rounds:
        if cuda:
            torch.cuda.empty_cache()
        try:
            row = offload_round_trip(actor, cfg, offload_rounds, cuda, label)
        except RuntimeError as exc:  # (torch.OutOfMemoryError is one)
            row = {"label": label, "kind": "offload", "error": oom_error(exc)}
            if row["error"] is None:
                raise
        print(json.dumps(row), flush=True)
        out.append(row)
        gc.collect()
    actor = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", default=None, help="qwen3-0.6b | tiny | path to a config.json")
    ap.add_argument("--batches", default=None, help="comma list of BxL (default: cuda 8x2048,1x8448,1x32768; cpu 4x256,1x1024)")
    ap.add_argument("--variant", action="append", help="key=value,... of actor settings, or a preset "
                                                         f"({', '.join(PRESETS)}), optionally @BxL:BxL (its own "
                                                         "batches); repeatable")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--anchor", choices=["hf"], default=None,
                    help="hf: a plain transformers model on the same batches first; rows get their ratio to it")
    ap.add_argument("--counts", action="store_true",
                    help="add each step's aten ops, host syncs and compiled graphs (launch costs, any device)")
    ap.add_argument("--offload", type=int, default=0, metavar="ROUNDS",
                    help="after the first variant's steps: ROUNDS offload + onload round trips of the actor's "
                         "optimizer states, gradients and parameters (GB/s each way, bit-exact)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    shape = args.shape or ("qwen3-0.6b" if cuda else "tiny")
    batches = parse_batches(args.batches or ("8x2048,1x8448,1x32768" if cuda else "4x256,1x1024"))
    variants = [split_variant(v) for v in (args.variant or (["today", "bf16"] if cuda else ["fp32", "bf16"]))]
    cfg = hf_config(shape)
    from transformers import AutoConfig

    from megatron_tepo.megatron.parallel import single_process_env

    single_process_env()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        AutoConfig.for_model(**cfg).save_pretrained(tmp)
        print(json.dumps({"shape": shape, "config": cfg, "device": torch.cuda.get_device_name() if cuda else "cpu",
                          "torch": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
        anchor = None
        if args.anchor:
            every = sorted({bt for _, _, own in variants for bt in (own or batches)}, key=lambda x: (x[0] * x[1], x))
            anchor = hf_anchor(cfg, every, args.repeats, cuda)
            rows += list(anchor.values())
        for i, (label, v, own_batches) in enumerate(variants):
            rows += run(cfg, tmp, v, own_batches or batches, args.repeats, cuda, label=label, anchor=anchor,
                        counts=args.counts, offload_rounds=args.offload if i == 0 else 0)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
