"""Dtype names, in one place: torch dtypes as the safetensors format names them (the weight sync's
files, the HF checkpoint reader) and by torch's own name (sidecars, the wire, messages).

Pure torch: the megatron side (``checkpoint/``) and ``rollout/`` (which imports nothing of megatron)
both import it.
"""
from __future__ import annotations

import torch

__all__ = ["SAFETENSORS_DTYPES", "SAFETENSORS_NAMES", "dtype_name", "dtype_from_name"]

#: safetensors header name -> torch dtype (the types this package reads and writes)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
#: torch dtype -> safetensors header name
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of ``dtype`` without the module: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    """The inverse of :func:`dtype_name`; a ValueError for a name that is not a torch dtype."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt
