"""Prompt data: JSONL / Parquet files of math problems with reference answers."""
from .prompts import DataError, PromptRecord, PromptSet, load_prompts

__all__ = ["DataError", "PromptRecord", "PromptSet", "load_prompts"]
