"""The chain task: multi-digit addition written out column by column, with a tiny Qwen3 and its
cached supervised warm-up. Long, variable-length responses where TEPO's mechanism can act.

A prompt is ``a+b=`` with ``a`` and ``b`` of ``D`` digits each, ``D`` uniform over
:data:`DIGITS` (3-7). A response works through the columns from the right, one segment per
column, in either of two forms, and ends with the sum after ``>``::

    prompt    4785+3917=
    response  5+7+0=12;=10;7+9+1=17;=8;>8702      (columns: full, terse, full, terse)

* full column ``x+y+c=s;``: the two digits, the carry in and the column sum (8-9 tokens);
* terse column ``=s;``: only the column sum, the digits and carry left implicit (3-4 tokens).

The warm-up writes each column in the full form with probability :data:`P_FULL`, independently,
so the same prompt has responses of many lengths: for ``D`` digits the length is between
``3.x D`` (all terse) and ``9 D`` (all full) plus the answer, 14 to 73 tokens over the task
(:func:`length_range`), and it varies within a group. The reward (:func:`reward_fn`) is exact
match of the text after the last ``>``: the form is free, only the answer counts.

Why it exercises what the paper's claim rests on:

* token-level credit assignment -- one wrong column sum or carry anywhere in a 20-70-token
  chain makes the answer wrong; the tokens that decide it are few and far from the reward;
* a choice of length inside each response -- the first token of a column (a digit: full;
  ``=``: terse) is a decision the policy can sharpen, so entropy can fall (collapse onto one
  form) or stay, and the tokens where it falls carry A>0 or A<0: the quadrants that TEPO's
  KL mask selects;
* variable length within a group, so token-mean and sequence-level aggregation differ, and a
  sequence-level geometric-mean ratio averages over many tokens instead of two or three.

What it leaves out: language, long-range reasoning, search and self-correction (a chain is
never revised); a model of 2-4 layers and a 16-token vocabulary; answers checked by exact match,
not math-verify. It is a controlled fixture for the loss's mechanism, not a reasoning benchmark.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path
from typing import List, Sequence, Tuple

import torch

from megatron_tepo.cache_dir import build_once

PAD, EOS = 0, 1
CHARS = "0123456789+=;>"
VOCAB = 16  # PAD, EOS and 14 characters (divisible by TP=2 and 4)
DIGITS = (3, 4, 5, 6, 7)  # operand length, uniform
P_FULL = 0.5  # warm-up: probability that a column is written in full
MAX_PROMPT = 2 * max(DIGITS) + 2  # "a+b="
MAX_RESPONSE = 9 * max(DIGITS) + 1 + max(DIGITS) + 1 + 1  # all full, '>', the sum, EOS


def encode(text: str) -> List[int]:
    return [2 + CHARS.index(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    out = []
    for t in ids:
        if t == EOS:
            break
        if 2 <= t < 2 + len(CHARS):
            out.append(CHARS[t - 2])
    return "".join(out)


def operands(rng: random.Random) -> Tuple[int, int]:
    d = rng.choice(DIGITS)
    lo, hi = 10 ** (d - 1), 10 ** d
    return rng.randrange(lo, hi), rng.randrange(lo, hi)


def chain(a: int, b: int, full: Sequence[bool]) -> str:
    """The response for ``a+b=`` with column ``i`` (from the right) in full form if ``full[i]``."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    assert len(xs) == len(ys) == len(full), (a, b, full)
    parts, carry = [], 0
    for x, y, f in zip(xs, ys, full):
        s = int(x) + int(y) + carry
        parts.append(f"{x}+{y}+{carry}={s};" if f else f"={s};")
        carry = s // 10
    return "".join(parts) + f">{a + b}"


def sample_response(a: int, b: int, rng: random.Random, p_full: float = P_FULL) -> str:
    return chain(a, b, [rng.random() < p_full for _ in str(a)])


def length_range(digits: int) -> Tuple[int, int]:
    """Fewest and most response tokens (EOS included) over sums and forms for ``digits``-digit
    operands: a full column is 8-9 tokens (sum below 10 or not), a terse one 3-4; the answer is
    ``'>'`` and ``digits`` or ``digits + 1`` digits."""
    return 3 * digits + 1 + digits + 1, 9 * digits + 1 + digits + 1 + 1


def problems(n: int, seed: int) -> List[Tuple[List[int], str]]:
    """``n`` prompts (token ids of ``a+b=``) with their answers (the sum as text)."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b = operands(rng)
        items.append((encode(f"{a}+{b}="), str(a + b)))
    return items


def final_answer(text: str) -> str:
    return text.rsplit(">", 1)[1] if ">" in text else ""


def reward_fn(responses: Sequence[Sequence[int]], answers: Sequence[str]) -> List[float]:
    """1 if the text after the response's last ``>`` is the sum, else 0 (the form is free)."""
    return [1.0 if final_answer(decode(r)) == a else 0.0 for r, a in zip(responses, answers)]


def tiny_qwen3_config(layers: int = 4, hidden: int = 128):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=hidden // 4, max_position_embeddings=128, tie_word_embeddings=False,
                       bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)


def warm_up(cache_dir: Path, steps: int = 1000, batch: int = 64, lr: float = 3e-3, seed: int = 0,
            layers: int = 4, hidden: int = 128) -> Path:
    """Supervised warm-up on sampled chains (both forms mixed by :data:`P_FULL`), cached by its
    settings. Short on purpose: the model ends it well below full accuracy, so RL has room."""
    key = hashlib.sha1(json.dumps([steps, batch, lr, seed, layers, hidden, VOCAB, CHARS, DIGITS, P_FULL,
                                   "chain-v1"]).encode()).hexdigest()[:10]
    out = Path(cache_dir) / f"sft-{key}"

    def train(tmp: Path) -> None:  # (once per cache entry, whichever process comes first)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_qwen3_config(layers, hidden))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
        rng = random.Random(seed)
        t = time.time()
        for step in range(steps):
            rows, starts = [], []
            for _ in range(batch):
                a, b = operands(rng)
                prompt = encode(f"{a}+{b}=")
                rows.append(prompt + encode(sample_response(a, b, rng)) + [EOS])
                starts.append(len(prompt))
            width = max(map(len, rows))
            ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
            labels = ids.clone()
            for i, s in enumerate(starts):
                labels[i, :s] = -100  # learn the response only
            labels[ids == PAD] = -100
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if (step + 1) % 250 == 0:
                print(f"[warm-up] step {step + 1}/{steps}: loss {loss.item():.3f} ({time.time() - t:.0f}s)", flush=True)
        print(f"[warm-up] {steps} supervised steps in {time.time() - t:.0f}s, final loss {loss.item():.3f}")
        model.save_pretrained(tmp)

    return build_once(out, train)
