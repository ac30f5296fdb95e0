"""A Qwen3 chat template with tools and a small tokenizer for it (tests of the prompts' rendering and
the template comparator, #58: "the Qwen3 template with tools").

:data:`QWEN3_TOOLS_RULES` is written here to the rules of Qwen3's published template (the
``chat_template`` of the Qwen/Qwen3-* checkpoints' tokenizer_config.json; Qwen3 and Qwen3-MoE share
it), extending ``benchmarks/template_comparator.py``'s ``QWEN3_RULES`` with what tools and the
template's arguments change: with ``tools=``, a system turn lists each tool's JSON schema (``tojson``,
one a line) and asks for ``<tool_call>`` JSON calls; ``enable_thinking=false`` closes an empty
``<think>`` block after the generation prompt; the last query is the last user turn that is not a
tool's answer; an assistant turn after it keeps its ``<think>`` block when it has reasoning, the last
always gets one; a tool turn is a user turn wrapping ``<tool_response>``, consecutive ones in one
turn; an assistant's ``tool_calls`` are rendered as ``<tool_call>`` JSON. Its wording is this file's,
not Qwen's: the tests check behaviour, not the words of the system prompt.

The published template itself is not vendored (no model hub here, and it is not copied in from
elsewhere): set ``MTEPO_QWEN3_TEMPLATE`` to a Qwen3 ``tokenizer_config.json`` or a ``.jinja`` file
holding it, and the tests run with it as well (:func:`templates`).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

QWEN3_TOOLS_RULES = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nThe functions you may call, one JSON schema a line:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nCall one as JSON in <tool_call></tool_call> tags:\\n<tool_call>\\n"
    "{\"name\": <name>, \"arguments\": <arguments>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_query=messages|length - 1, searching=true) -%}"
    "{%- for m in messages[::-1] -%}"
    "{%- if ns.searching and m.role == 'user' and not (m.content.startswith('<tool_response>') and "
    "m.content.endswith('</tool_response>')) -%}"
    "{%- set ns.searching = false -%}{%- set ns.last_query = messages|length - 1 - loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}"
    "{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{{- content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set call = call.function if call.function else call -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' -}}"
    "{{- call.arguments if call.arguments is string else call.arguments | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}")

#: the words the template writes, one token each; every other character is a token of its own
WORDS = ["<pad>", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
         "<tool_response>", "</tool_response>"]
EOS = 1


def tokenizer(template: str = QWEN3_TOOLS_RULES):
    """A ``PreTrainedTokenizerFast`` with :data:`WORDS` and every printable ASCII character (and the
    newline), one token each, so that any text the template writes round-trips; ``template`` set."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {w: i for i, w in enumerate(WORDS + chars)}
    words = "|".join(re.escape(w) for w in sorted(WORDS, key=len, reverse=True))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(words + "|[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    t.chat_template = template
    return t


def templates():
    """``[(name, template)]``: :data:`QWEN3_TOOLS_RULES`, and the published one where
    ``MTEPO_QWEN3_TEMPLATE`` names a file holding it."""
    out = [("qwen3_rules", QWEN3_TOOLS_RULES)]
    path = os.environ.get("MTEPO_QWEN3_TEMPLATE")
    if path:
        text = Path(path).read_text()
        out.append(("qwen3_published", json.loads(text)["chat_template"] if path.endswith(".json") else text))
    return out
