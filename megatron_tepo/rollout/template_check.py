"""How an episode's trained ids compare with the chat template's rendering of the same conversation
(:func:`compare_with_template`): the multi-turn engine's check that it never wrote a turn boundary
other than the template's (its step metrics ``template_<kind>_rate``; docs/ROLLOUT.md, "Multi-turn
episodes"). Reads only the tokenizer and the sample.

Left out: rewriting the ids to the template's (the episode engine never re-tokenises: token in, token
out), templates whose prompt is not one user message.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

__all__ = ["compare_with_template"]


def compare_with_template(tokenizer, prompt_ids: Sequence[int], sample, stop_token_id: int,
                          template_kwargs: Optional[Dict] = None) -> str:
    """How an episode's trained response ids differ from the chat template's rendering of the same
    conversation (the prompt's user message read back from its text; each model turn an assistant
    message, each environment answer a tool message): ``equal``; ``retokenized`` (the same text in
    other ids: a re-tokenisation of the conversation would have changed tokens the engine produced);
    ``thinking`` (the template's rewriting of ``<think>`` blocks: stripped from earlier turns, an
    empty one added, blank lines trimmed, the empty one a generation prompt closes with thinking off
    -- Qwen3's ``enable_thinking=False`` -- left out of the turns before the last: by design); or
    ``error`` (other text: a turn boundary not as the template writes it)."""
    ids = list(sample.token_ids)
    mask = list(getattr(sample, "loss_mask", None) or [1] * len(ids))
    messages = list(sample.meta.get("episode", {}).get("messages", []))
    conv, i, m = [], 0, 0
    while i < len(ids):  # alternating runs: a model turn (mask 1), an environment answer (mask 0)
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        if mask[i]:
            part = ids[i:j]
            text = tokenizer.decode(part[:-1] if part and part[-1] == stop_token_id else part, skip_special_tokens=False)
            conv.append({"role": "assistant", "content": text})
        else:
            conv.append({"role": "tool", "content": messages[m] if m < len(messages) else ""})
            m += 1
        i = j
    kw = dict(template_kwargs or {})  # (the template's arguments the prompts were rendered with)
    user = _messages_of(tokenizer, tokenizer.decode(list(prompt_ids), skip_special_tokens=False), kw)
    head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **kw)
    full = tokenizer.apply_chat_template(user + conv, tokenize=False,
                                         add_generation_prompt=bool(conv) and conv[-1]["role"] == "tool", **kw)
    trained, end = tokenizer.decode(ids, skip_special_tokens=False), tokenizer.decode([stop_token_id])
    if not full.startswith(head):
        # Qwen3 with enable_thinking false: the generation prompt closes an empty <think> block, which
        # the template leaves out of an earlier assistant turn when it renders the whole conversation
        same = _without_thinking(_trimmed(full, end)) == _without_thinking(_trimmed(head + trained, end))
        return "thinking" if same else "error"
    rendered = full[len(head):]
    if conv and conv[-1]["role"] == "assistant" and ids and ids[-1] == stop_token_id and end in rendered:
        rendered = rendered[:rendered.rindex(end) + len(end)]  # (what the template writes after the last stop: not generated)
    if list(tokenizer(rendered, add_special_tokens=False)["input_ids"]) == ids:
        return "equal"
    if _trimmed(rendered, end) == _trimmed(trained, end):
        return "retokenized"
    if _without_thinking(_trimmed(rendered, end)) == _without_thinking(_trimmed(trained, end)):
        return "thinking"
    return "error"


def _messages_of(tokenizer, prompt_text: str, template_kwargs: Optional[Dict] = None) -> List[Dict[str, str]]:
    """The prompt as the messages that rendered it: one user message (the data loader's form), read
    back from between the template's boundaries."""
    probe = "\u2063MTEPO-USER\u2063"
    shape = tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False,
                                          add_generation_prompt=True, **(template_kwargs or {}))
    before, after = shape.split(probe, 1)
    if prompt_text.startswith(before) and prompt_text.endswith(after):
        return [{"role": "user", "content": prompt_text[len(before):len(prompt_text) - len(after)]}]
    return [{"role": "user", "content": prompt_text}]


def _trimmed(text: str, end: str) -> str:
    """``text`` without the template's closing newline and end-of-turn token after the last turn."""
    text = text.rstrip("\n")
    return text[:-len(end)] if end and text.endswith(end) else text


def _without_thinking(text: str) -> str:
    return re.sub(r"<think>.*?</think>\s*", "", text, flags=re.S).strip()
