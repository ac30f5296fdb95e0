"""A tiny Qwen3 (2 layers, hidden 64) for the rollout tests; token ids only, no tokenizer."""
from __future__ import annotations

import json
import os

import torch

VOCAB = 256


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_qwen3(seed: int = 0, scale: float = 0.2, **overrides):
    """Random weights large enough that the next-token distribution is far from uniform."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(**overrides)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def save_tiny_qwen3(path, seed: int = 0, **overrides):
    """config.json + model.safetensors + generation_config (what an SGLang server needs)."""
    model = tiny_qwen3(seed, **overrides)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, f)
    return model


def hf_response_log_probs(model, seq, prompt_len, temperature=1.0):
    with torch.no_grad():
        ids = torch.tensor([seq])
        logits = model(input_ids=ids).logits[0, prompt_len - 1:-1].float()
        return torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, prompt_len:, None]).squeeze(-1)
