"""A tiny Qwen3 (2 layers, hidden 64) for the rollout tests (token ids only, no tokenizer), and the
fault steps the fleet tests share (a server killed mid-step, every server hung)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_tepo.rollout.engine import FINISH_LENGTH
from megatron_tepo.rollout.sglang.client import FleetError

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


def cut_mid_response(engine, req, params, first_wait: float = 0.5, timeout: float = 240.0):
    """Partial rollout: submit ``req`` to ``engine`` and interrupt it while it generates (its
    tokens marked version 1). One cut before it ran comes back empty and goes on; one that
    finished first starts afresh with a shorter wait (the machine's speed is not assumed). Every
    answer is ``req`` itself, with as many log-probs as tokens and no error."""
    from megatron_tepo.rollout.engine import FINISH_ABORT

    end, wait = time.monotonic() + timeout, first_wait
    while True:
        assert time.monotonic() < end, "no interrupt landed mid-response"
        engine.submit([req], params)
        time.sleep(wait)
        (got, seg), = engine.interrupt()
        assert got is req and len(seg.token_ids) == len(seg.log_probs) and not seg.meta.get("error"), seg.meta
        if seg.finish_reason != FINISH_ABORT:  # it finished: again, from nothing
            req.restart()
            wait /= 2
            continue
        req.extend(seg, version=1)
        if req.token_ids:
            return req
        wait *= 2


# ---------------------------------------------------------------- fault steps of the fleet tests
def kill_during_step(fleet, victim, wait_for_victim, join_timeout: float = 180.0) -> None:
    """Run one step (12 prompt groups of 2 samples x 160 tokens) in a thread, wait with
    ``wait_for_victim(thread)`` until ``victim`` should hold some of its requests, SIGKILL the
    victim by its pid, and check that the step still completed with nothing lost."""
    prompts = [[i + 3, i + 4, i + 5] for i in range(12)]
    result, errors = {}, []

    def step():
        try:
            result["groups"] = fleet.generate(prompts, n=2, temperature=1.0, max_new_tokens=160)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=step)
    t.start()
    wait_for_victim(t)
    os.kill(victim.pid, signal.SIGKILL)
    t.join(timeout=join_timeout)
    assert not t.is_alive() and not errors, errors
    groups = result["groups"]
    assert len(groups) == len(prompts)
    for g in groups:  # nothing lost: every request answered in full
        assert len(g) == 2 and all(len(s.token_ids) == 160 and s.finish_reason == FINISH_LENGTH for s in g)


def error_with_all_servers_hung(fleet, **timeouts) -> str:
    """SIGSTOP every live server (hung, not dead: only the time-outs can tell), with the fleet's
    ``timeouts`` (``step_timeout`` 15 s and ``request_timeout`` 5 s unless given); one step must
    raise FleetError naming every server, bounded by its step time-out: the bound asserted is 3 x
    that, wide enough for a loaded machine and far below what waiting on the hung servers' requests
    would take (they never answer). The hung servers are killed afterwards. Returns the error's
    message."""
    timeouts = {"step_timeout": 15.0, "request_timeout": 5.0, **timeouts}
    for k, v in timeouts.items():
        setattr(fleet.cfg, k, v)
    hung = [s for s in fleet.servers if s.alive]
    for s in hung:
        os.kill(s.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(FleetError) as exc:
            fleet.generate([[1, 2, 3]], n=1, max_new_tokens=4)
        elapsed = time.monotonic() - t0
    finally:
        for s in hung:
            os.kill(s.pid, signal.SIGKILL)
            os.kill(s.pid, signal.SIGCONT)
    assert elapsed < 3 * timeouts["step_timeout"], elapsed
    msg = str(exc.value)
    for s in fleet.servers:
        assert s.url in msg
    return msg


def cmdlines(pid: int) -> dict:
    """``{pid: command line}`` of process ``pid`` and all its descendants, as ``ps`` shows them."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    out = {}
    for p in procs:
        try:
            out[p.pid] = Path(f"/proc/{p.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out
