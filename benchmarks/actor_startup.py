"""Benchmark: host memory and time to build the Megatron actor from HF weights at TP=2 on CPU.

Writes (once, cached under ``.cache/actor_startup``) a Qwen3-shaped HF checkpoint with random
weights in fp32 safetensors (``--shape``: ``bench`` -- 10 layers, hidden 1024, FFN 3072, 16
heads, 8 KV groups, head_dim 128, vocabulary 30720, untied: 0.88 GB; ``tiny`` for a smoke run),
split into shards of ``--shard-mb``. Then runs itself under torchrun (``--nproc`` ranks, gloo,
one thread each, TP = ``--tp``), and each rank reports:

* ``peak_x``: the peak host memory during ``MegatronActor(config_dir, hf_weights=dir, ...)``
  above what the process held just before it (resident set: ``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``; the process group is already up before the reset), in units of the
  model's fp32 bytes. A TP=2 rank must keep 1.0x: half of the weights and their fp32 gradient
  buffer (megatron DDP, ``grad_reduce_in_fp32``);
* ``kept_x``: what it still holds after the build (``VmRSS`` growth), same unit;
* ``build_s``: the wall time of the build;
* ``read_mb``: bytes this rank read from the checkpoint files (where the loader counts them).

Target (issue #22): ``peak_x`` <= 1.35 at TP=2. JSON lines go to stdout.

    python benchmarks/actor_startup.py                  # bench shape, TP=2 on 2 ranks
    python benchmarks/actor_startup.py --shape tiny     # smoke run

Left out: GPU memory (the build on GPU allocates parameters on the device), bf16, the
distributed optimizer, PP > 1 (each stage reads only its layers; the per-rank figure is the
same kind), and the optimizer's Adam states (allocated at the first step, not at the build).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "bench": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=10, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=30720, tie_word_embeddings=False,
                  max_position_embeddings=4096, rope_theta=1e6),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1024, tie_word_embeddings=False,
                 max_position_embeddings=512, rope_theta=1e6),
}


def make_checkpoint(shape: str, out: Path, shard_mb: int) -> Path:
    """An HF Qwen3 directory with random fp32 weights (norms around 1), written tensor by tensor."""
    import torch
    import transformers

    from megatron_tepo.checkpoint.hf_io import ShardedSafetensorsWriter, expected_hf_tensors

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = transformers.Qwen3Config(**SHAPES[shape], rms_norm_eps=1e-6)
    cfg.architectures = ["Qwen3ForCausalLM"]
    g = torch.Generator().manual_seed(0)
    writer = ShardedSafetensorsWriter(tmp, max_shard_bytes=shard_mb * 2 ** 20)
    for name, shp in expected_hf_tensors(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shp, generator=g)
        else:
            t = 0.02 * torch.randn(shp, generator=g)
        writer.add(name, t)
    writer.close()
    cfg.to_json_file(str(tmp / "config.json"))
    tmp.rename(out)
    return out


def _status(field: str) -> int:
    """A ``kB`` field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(args) -> None:
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.checkpoint import hf_io

    model_dir = Path(args.model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    ckpt = hf_io.LazyHFCheckpoint(model_dir)
    model_bytes = sum(4 * torch.Size(ckpt.shape(n)).numel() for n in ckpt.names())
    ckpt.close()
    del ckpt
    dist.init_process_group("gloo")
    # what the build imports lazily is imported first: only the build's own memory is measured
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.optimizer_param_scheduler  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.transformer.transformer_config  # noqa: F401
    import megatron_tepo.megatron.attention  # noqa: F401
    counter = getattr(hf_io, "BYTES_READ", None)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    read_before = counter.value if counter is not None else None
    t0 = time.perf_counter()
    actor = MegatronActor(config, hf_weights=str(model_dir), layout=ParallelLayout(tp=args.tp),
                          optim=OptimConfig(lr=1e-5), precision="fp32", attention="sdpa")
    build_s = time.perf_counter() - t0
    peak, kept = _status("VmHWM"), _status("VmRSS")
    out = {"rank": dist.get_rank(), "tp": args.tp, "model_gb": round(model_bytes / 1e9, 3),
           "peak_x": round((peak - before) / model_bytes, 3), "kept_x": round((kept - before) / model_bytes, 3),
           "build_s": round(build_s, 2)}
    if counter is not None:
        out["read_mb"] = round((counter.value - read_before) / 2 ** 20, 1)
    del actor
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            print(json.dumps(out), flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: --tp)")
    ap.add_argument("--shard-mb", type=int, default=256, help="safetensors shard size of the written model")
    ap.add_argument("--model-dir", default=None, help="an existing HF directory instead of the written one")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    model_dir = Path(args.model_dir) if args.model_dir else make_checkpoint(
        args.shape, REPO / ".cache" / "actor_startup" / f"{args.shape}-{args.shard_mb}mb", args.shard_mb)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    from megatron_tepo.net import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc or args.tp}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, "--worker",
           "--tp", str(args.tp), "--model-dir", str(model_dir)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    for ln in lines:
        print(ln)
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-6000:])
        raise SystemExit(proc.returncode or 1)


if __name__ == "__main__":
    main()
