"""The tiny tool-integrated task: two-digit multiplication ("37*45" -> "1665") that a 2-layer model
cannot do by itself but can with a Python tool, in a chat template, with a tiny Qwen3 and its cached
supervised warm-up on traces. Shared by ``run.py --task tir`` (examples/tiny_tepo) and the tests.

A solved episode (ChatML, one token per character but for the template's and the code's words)::

    <|im_start|>user\\n37*45<|im_end|>\\n<|im_start|>assistant\\n          (the prompt)
    ```python\\nprint(37*45)\\n```<|im_end|>                            (turn 1: a tool call)
    \\n<|im_start|>user\\n<tool_response>\\n1665\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
                                                                      (the tool's answer: not trained)
    1665<|im_end|>                                                    (turn 2: the final answer)

The warm-up (:func:`warm_up`) trains on a mix: :data:`P_TOOL` of its traces call the tool (and copy
its answer), the rest answer directly; a direct answer is right only by chance, so the warmed-up model
calls the tool about that often and answers directly, mostly wrong, otherwise: RL has room to learn
when to call it. The reward (:func:`reward_fn`) is exact match of the final turn's text.

Left out: arithmetic beyond one multiplication, any tool but Python.
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

#: the template's and the code's words, one token each (then one token per character)
WORDS = ["<pad>", "<|im_end|>", "<|im_start|>", "user", "assistant", "<tool_response>", "</tool_response>",
         "```python", "```", "print("]
CHARS = "0123456789*=()\n"
PAD, EOS = 0, 1
VOCAB = 32  # the words, the characters, spare ids (divisible by TP=2 and 4)
P_TOOL = 0.15  # the warm-up's share of traces that call the tool

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def hf_tokenizer(extra_words=()):
    """A ``PreTrainedTokenizerFast`` with :data:`WORDS` and :data:`CHARS` and the ChatML template
    (``extra_words``: more words, one token each, after them: a test's ``<think>``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({c: len(WORDS) + i for i, c in enumerate(CHARS)})
    vocab.update({w: len(vocab) + i for i, w in enumerate(extra_words)})
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), VOCAB)})
    every = list(WORDS) + list(extra_words)
    words = "|".join(w.replace("|", "\\|").replace("(", "\\(") for w in sorted(every, key=len, reverse=True))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(words + "|[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", model_max_length=128)
    t.chat_template = CHAT_TEMPLATE
    return t


def render_ids(tok, conv, add_generation_prompt: bool = False):
    """The ids of the template's rendering of ``conv``."""
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tok(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tok, question: str):
    return render_ids(tok, [{"role": "user", "content": question}], add_generation_prompt=True)


def questions(n: int, seed: int):
    """``n`` (question, answer) pairs: ``("37*45", "1665")``, both factors in 10..99."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        out.append((f"{a}*{b}", str(a * b)))
    return out


def tool_trace(tok, question: str, answer: str):
    """A solved episode's ids (prompt + response) and the mask of the tokens the model writes."""
    p = prompt_ids(tok, question)
    conv = [{"role": "user", "content": question},
            {"role": "assistant", "content": f"```python\nprint({question})\n```"},
            {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]
    ids = render_ids(tok, conv)[:-1]  # (the template's closing newline is not generated)
    # the model writes its two turns (each ending with <|im_end|>); the tool's turn is the environment's
    text = render_ids(tok, conv[:2])[:-1]
    env_end = len(render_ids(tok, conv[:3], add_generation_prompt=True))
    mask = [0] * len(p) + [1] * (len(text) - len(p)) + [0] * (env_end - len(text)) + [1] * (len(ids) - env_end)
    return ids, mask


def direct_trace(tok, question: str, answer: str):
    p = prompt_ids(tok, question)
    ids = p + tok(answer, add_special_tokens=False)["input_ids"] + [EOS]
    return ids, [0] * len(p) + [1] * (len(ids) - len(p))


def problems(n: int, seed: int):
    """``n`` (prompt ids, answer) pairs: the question in the chat template, ready to generate."""
    tok = hf_tokenizer()
    return [(prompt_ids(tok, q), a) for q, a in questions(n, seed)]


def reward_fn(responses, answers):
    """Exact match of the final turn's text (the trainer hands the reward each episode's final turn:
    ``megatron_tepo.rollout.episode.final_turn``): its characters up to the end of the turn."""
    out = []
    for r, a in zip(responses, answers):
        r = list(r)
        text = "".join(CHARS[t - len(WORDS)] if len(WORDS) <= t < len(WORDS) + len(CHARS) else "\0"
                       for t in (r[:r.index(EOS)] if EOS in r else r))
        out.append(1.0 if text == a else 0.0)
    return out


def tiny_qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                       tie_word_embeddings=False, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)


def warm_up(cache_dir: Path, steps=600, batch=64, lr=3e-3, seed=0) -> Path:
    """Supervised warm-up on a mix of traces (:data:`P_TOOL` call the tool), cached by its settings;
    the folder holds the model, its tokenizer (with the chat template) and its generation config."""
    key = hashlib.sha1(json.dumps([steps, batch, lr, seed, VOCAB, CHARS, WORDS, P_TOOL, CHAT_TEMPLATE, "v1"])
                       .encode()).hexdigest()[:10]
    out = cache_dir / f"sft-{key}"

    def train(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        tok = hf_tokenizer()
        model = AutoModelForCausalLM.from_config(tiny_qwen3_config())
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        rng = random.Random(seed)
        t = time.time()
        for _ in range(steps):
            rows = []
            for q, a in questions(batch, rng.randrange(1 << 30)):
                rows.append(tool_trace(tok, q, a) if rng.random() < P_TOOL else direct_trace(tok, q, a))
            width = max(len(ids) for ids, _ in rows)
            ids = torch.tensor([r + [PAD] * (width - len(r)) for r, _ in rows])
            labels = torch.tensor([[t if m else -100 for t, m in zip(r, mk)] + [-100] * (width - len(r)) for r, mk in rows])
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[warm-up] {steps} supervised steps on tool traces in {time.time() - t:.0f}s, final loss {loss.item():.3f}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": EOS, "eos_token_id": EOS, "pad_token_id": PAD}))

    return build_once(out, train)


def write_prompt_file(path: Path, n: int, seed: int) -> Path:
    """``n`` problems as JSONL rows ``{"prompt": "37*45", "answer": "1665"}`` (read through the chat template)."""
    path.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in questions(n, seed)))
    return path


if __name__ == "__main__":  # (a quick look at the tokenizer and a trace)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t = hf_tokenizer()
    ids, mask = tool_trace(t, "37*45", "1665")
    print(len(ids), repr(t.decode(ids)))
    print("".join("^" if m else "." for m in mask))
