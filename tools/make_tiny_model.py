#!/usr/bin/env python
"""Write the tiny task as files: a Hugging Face model directory and prompt files.

    python tools/make_tiny_model.py --out DIR

DIR/model is the main job's warmed-up tiny Qwen3 (2 layers, hidden 128, 16-token character
vocabulary) with a Hugging Face tokenizer and generation config, so SGLang servers and
``tools/train.py`` load it like any checkpoint; DIR/train.jsonl and DIR/eval.jsonl hold two-digit
addition problems (``{"prompt": "37+45=", "answer": "82"}``; score them with
``reward.kind: exact_match``). Used by slurm/local_cpu_tepo.sh and the multi-process trainer tests.
``--moe`` adds DIR/moe, a random tiny Qwen3-MoE with the same tokenizer (routing replay's fixture);
``--qwen3-5`` adds DIR/qwen3_5, a random tiny Qwen3.5 (three Gated DeltaNet layers and one gated
attention layer) with it.
Idempotent: existing complete outputs are kept (the warm-up is cached in .cache/tiny_tepo).

Left out: anything resembling real math data; this is a fixture for the launch path on CPU.
"""
import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples" / "tiny_tepo")]  # the package, the task


def make(out: Path, n_train: int = 5000, n_eval: int = 200) -> Path:
    from addition import save_hf_model, warm_up, write_prompt_file

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "model" / "tokenizer.json").exists():
        save_hf_model(warm_up(REPO / ".cache" / "tiny_tepo"), out / "model")
    for name, n, seed in (("train.jsonl", n_train, 1), ("eval.jsonl", n_eval, 2)):
        if not (out / name).exists():
            tmp = out / f".{name}.tmp{os.getpid()}"
            write_prompt_file(tmp, n, seed).replace(out / name)
    return out


def make_moe(tiny: Path, out: Path) -> Path:
    """A random tiny Qwen3-MoE (2 layers, 8 experts, top-2) with the tiny task's tokenizer (``tiny``:
    a :func:`make` folder): MoE routing replay's fixture (its routing tests, the GPU check)."""
    import json
    import shutil

    import torch
    import transformers

    dense = json.loads((tiny / "model" / "config.json").read_text())
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=dense["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        bos_token_id=dense.get("bos_token_id"), eos_token_id=dense.get("eos_token_id"),
        pad_token_id=dense.get("pad_token_id"))
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else None
    model.save_pretrained(out)
    for f in (tiny / "model").iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def make_qwen3_5(tiny: Path, out: Path) -> Path:
    """A random tiny Qwen3.5 (the sizes of the main job's ``--model qwen3_5``: 4 layers, every fourth
    gated attention, the others Gated DeltaNet) with the tiny task's tokenizer (``tiny``: a
    :func:`make` folder): the hybrid's fixture for the loop on HybridModel."""
    import shutil

    import torch
    import transformers
    from addition import tiny_qwen3_5_config

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(tiny_qwen3_5_config()).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):  # (zero-centred norms: 1 + w)
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    for f in (tiny / "model").iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def cli(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--train-size", type=int, default=5000)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--moe", action="store_true", help="also DIR/moe: a random tiny Qwen3-MoE with the task's tokenizer")
    ap.add_argument("--qwen3-5", action="store_true", help="also DIR/qwen3_5: a random tiny Qwen3.5 with the task's tokenizer")
    args = ap.parse_args(argv)
    out = make(args.out, args.train_size, args.eval_size)
    if args.moe and not (out / "moe" / "config.json").exists():
        make_moe(out, out / "moe")
    if args.qwen3_5 and not (out / "qwen3_5" / "config.json").exists():
        make_qwen3_5(out, out / "qwen3_5")
    print(out)


if __name__ == "__main__":
    cli()
