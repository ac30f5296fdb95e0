"""Load math prompt files (JSONL or Parquet) into tokenized prompts with reference answers.

Two row forms are accepted, per row:

- plain: ``{"prompt": "What is 2+3?", "answer": "5"}`` (``prompt`` a string);
- DAPO-Math / verl: ``{"prompt": [{"role": "user", "content": "..."}], "reward_model":
  {"ground_truth": "5"}}`` (``prompt`` a list of chat messages).

Every row keeps all its fields: :attr:`PromptRecord.row` is the row itself as read (the test
cases, the secret, the document id ... besides ``prompt``; ``answer`` holds the reference answer as
a string, read from ``reward_model.ground_truth`` in the DAPO form). The trainer hands it to a
``reward.function`` and to an environment's episodes (docs/TASKS.md). With
``require_answer=False`` (a task whose reward reads other fields) a row without an answer is kept,
its ``answer`` "".

With a tokenizer, the prompt is rendered with its chat template (a plain string becomes one user
message) when ``apply_chat_template`` and the tokenizer has one, with ``template_kwargs`` (the
config's ``data.tools`` as ``tools=`` and ``data.chat_template_kwargs``), else taken as raw text; prompts
longer than ``max_prompt_len`` tokens are dropped and counted. A malformed row is a
:class:`DataError` naming the file and line (row number for Parquet), or, with
``on_bad_row="skip"``, skipped and counted.

Left out: streaming of files larger than memory, shuffling (the trainer owns the order and its
position), and any download: files come from the user's disk.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = ["DataError", "PromptRecord", "PromptSet", "load_prompts"]


class DataError(ValueError):
    """A problem with a data file; the message names the file and line."""


@dataclass
class PromptRecord:
    prompt: Union[str, List[dict]]
    answer: str
    input_ids: Optional[List[int]] = None
    source: str = ""  # "file:line"
    row: Dict[str, Any] = field(default_factory=dict)  # the row as read, every field (``answer`` a string)


@dataclass
class PromptSet:
    records: List[PromptRecord] = field(default_factory=list)
    num_too_long: int = 0
    num_bad_rows: int = 0
    bad_rows: List[str] = field(default_factory=list)  # "file:line: reason" of skipped rows

    def __len__(self) -> int:
        return len(self.records)


def _rows(path: Path) -> Iterator[Tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield line_no, DataError(f"invalid JSON ({exc.msg} at column {exc.colno})")
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - pyarrow is a dependency
            raise DataError(f"{path}: reading Parquet needs pyarrow ({exc})") from None
        table = pq.read_table(path)
        for row_no, row in enumerate(table.to_pylist(), 1):
            yield row_no, row
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r} (use .jsonl or .parquet)")


def _parse_row(row: Any, require_answer: bool = True) -> Tuple[Union[str, List[dict]], str]:
    if isinstance(row, DataError):
        raise row
    if not isinstance(row, dict):
        raise DataError(f"row is a {type(row).__name__}, expected an object")
    if "prompt" not in row:
        raise DataError("missing field 'prompt'")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError("field 'prompt' is empty")
    elif isinstance(prompt, list):
        for k, msg in enumerate(prompt):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str)
                    and isinstance(msg.get("content"), str)):
                raise DataError(f"field 'prompt[{k}]' must be a message {{role, content}}")
        if not prompt:
            raise DataError("field 'prompt' is an empty message list")
    else:
        raise DataError(f"field 'prompt' must be a string or a list of messages, got {type(prompt).__name__}")
    if "answer" in row:
        answer = row["answer"]
    elif isinstance(row.get("reward_model"), dict) and "ground_truth" in row["reward_model"]:
        answer = row["reward_model"]["ground_truth"]
    elif not require_answer:
        return prompt, ""
    else:
        raise DataError("missing field 'answer' (or 'reward_model.ground_truth')")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise DataError(f"answer must be a non-empty string, got {answer!r}")
    return prompt, answer


def _tokenize(prompt, tokenizer, apply_chat_template: bool, template_kwargs: Optional[Dict[str, Any]] = None) -> List[int]:
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(template_kwargs or {}))
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 returns an encoding
            ids = ids["input_ids"]
        return list(ids)
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_prompts(paths: Union[str, Path, Sequence[Union[str, Path]]], tokenizer=None, *,
                 max_prompt_len: Optional[int] = None, apply_chat_template: bool = True,
                 on_bad_row: str = "error", require_answer: bool = True,
                 template_kwargs: Optional[Dict[str, Any]] = None) -> PromptSet:
    """Read prompt files into a :class:`PromptSet` (see the module docstring)."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if max_prompt_len is not None and tokenizer is None:
        raise ValueError("max_prompt_len needs a tokenizer")
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out = PromptSet()
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        for line_no, row in _rows(path):
            where = f"{path}:{line_no}"
            try:
                prompt, answer = _parse_row(row, require_answer)
            except DataError as exc:
                if on_bad_row == "error":
                    raise DataError(f"{where}: {exc}") from None
                out.num_bad_rows += 1
                out.bad_rows.append(f"{where}: {exc}")
                continue
            ids = _tokenize(prompt, tokenizer, apply_chat_template, template_kwargs) if tokenizer is not None else None
            if ids is not None and max_prompt_len is not None and len(ids) > max_prompt_len:
                out.num_too_long += 1
                continue
            out.records.append(PromptRecord(prompt, answer, ids, where, {**row, "answer": answer}))
    return out
