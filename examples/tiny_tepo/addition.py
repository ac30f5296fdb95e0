"""The tiny task shared by the main job (run.py) and tools/make_tiny_model.py: two-digit addition
("37+45=" -> "82") with a character vocabulary, a tiny Qwen3 (or, ``model="qwen3_5"``, a tiny
Qwen3.5: three Gated DeltaNet layers and one gated-attention layer), and its cached supervised warm-up.

``save_hf_model`` writes the warmed-up model as a self-contained Hugging Face directory (weights,
config, generation config and a ``PreTrainedTokenizerFast`` whose ids equal :func:`encode`), which
SGLang servers and ``tools/train.py`` load like any other checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch

from megatron_tepo.cache_dir import build_once

PAD, EOS = 0, 1
CHARS = "0123456789+="
VOCAB = 16  # PAD, EOS, 12 characters, 2 spare (divisible by TP=2 and 4)


def encode(text):
    return [2 + CHARS.index(c) for c in text]


def decode(ids):
    out = []
    for t in ids:
        if t == EOS:
            break
        if 2 <= t < 2 + len(CHARS):
            out.append(CHARS[t - 2])
    return "".join(out)


def problems(n, seed):
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        items.append((encode(f"{a}+{b}="), str(a + b)))
    return items


def reward_fn(responses, answers):
    return [1.0 if decode(r) == a else 0.0 for r, a in zip(responses, answers)]


def tiny_qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                       tie_word_embeddings=False, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)


def tiny_qwen3_5_config():
    """The same sizes as :func:`tiny_qwen3_config` in Qwen3.5's hybrid shape: 4 layers, every fourth
    gated attention (RoPE on a quarter of each head), the others Gated DeltaNet (2 key heads, 4 value
    heads of 32)."""
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                            linear_value_head_dim=32, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
                            bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


#: the tiny models the warm-up can make (``run.py --model``)
MODELS = {"qwen3": tiny_qwen3_config, "qwen3_5": tiny_qwen3_5_config}
#: their warm-up steps: the 4-layer Qwen3.5 learns addition faster than the 2-layer Qwen3 (held-out
#: greedy accuracy after 100 / 150 steps: 0.15 / 0.68 on one machine); fewer steps leave RL as much to do
WARM_UP_STEPS = {"qwen3": 300, "qwen3_5": 130}


def warm_up(cache_dir: Path, steps=None, batch=64, lr=3e-3, seed=0, model: str = "qwen3") -> Path:
    """Supervised warm-up on addition (cached by its settings; ``steps``: the model's
    :data:`WARM_UP_STEPS` unless given)."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: choose from {sorted(MODELS)}")
    steps = WARM_UP_STEPS[model] if steps is None else steps
    key = hashlib.sha1(json.dumps([steps, batch, lr, seed, VOCAB, CHARS, "v1"] + ([model] if model != "qwen3" else []))
                       .encode()).hexdigest()[:10]
    out = cache_dir / f"sft-{key}"
    arch = model

    def train(tmp: Path) -> None:  # (once per cache entry, whichever process comes first)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(MODELS[arch]())
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        rng = random.Random(seed)
        t = time.time()
        for step in range(steps):
            rows = []
            for _ in range(batch):
                a, b = rng.randrange(10, 100), rng.randrange(10, 100)
                rows.append(encode(f"{a}+{b}=") + encode(str(a + b)) + [EOS])
            width = max(map(len, rows))
            ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
            labels = ids.clone()
            labels[:, :6] = -100  # learn the answer only
            labels[ids == PAD] = -100
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[warm-up] {steps} supervised steps in {time.time() - t:.0f}s, final loss {loss.item():.3f}")
        model.save_pretrained(tmp)

    return build_once(out, train)


def hf_tokenizer():
    """A ``PreTrainedTokenizerFast`` with the ids of :func:`encode` (one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{c: 2 + i for i, c in enumerate(CHARS)}}
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   model_max_length=64)


def save_hf_model(src: Path, out: Path) -> Path:
    """Copy the warmed-up model ``src`` into ``out`` with the tokenizer and generation config
    (written to a temporary directory, renamed when complete)."""
    from transformers import AutoModelForCausalLM

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(tmp)
    hf_tokenizer().save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": EOS, "eos_token_id": EOS, "pad_token_id": PAD}))
    tmp.replace(out)
    return out


def write_prompt_file(path: Path, n: int, seed: int) -> Path:
    """``n`` problems as JSONL rows ``{"prompt": "37+45=", "answer": "82"}`` (data/ plain form)."""
    rows = [json.dumps({"prompt": decode(p), "answer": a}) for p, a in problems(n, seed)]
    path.write_text("\n".join(rows) + "\n")
    return path
