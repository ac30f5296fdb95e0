"""Dtype names live in ``megatron_tepo.dtypes`` alone: the weight sync writes safetensors headers
with the table the HF checkpoint reader reads them with, and both agree with safetensors itself."""
import ast
from pathlib import Path

import pytest
import torch

from megatron_tepo.checkpoint.hf_io import LazyHFCheckpoint
from megatron_tepo.dtypes import SAFETENSORS_DTYPES, SAFETENSORS_NAMES, dtype_from_name, dtype_name
from megatron_tepo.buckets import to_flat_bucket, write_safetensors

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_tepo"


def test_the_table_is_safetensors_own_and_names_round_trip():
    from safetensors.torch import _TYPES  # the library's name -> dtype table

    assert {name: _TYPES[name] for name in SAFETENSORS_DTYPES} == SAFETENSORS_DTYPES
    assert {SAFETENSORS_DTYPES[n]: n for n in SAFETENSORS_NAMES.values()} == SAFETENSORS_NAMES
    for dt in SAFETENSORS_DTYPES.values():
        assert dtype_from_name(dtype_name(dt)) is dt
    with pytest.raises(ValueError, match="unknown dtype name 'Tensor'"):
        dtype_from_name("Tensor")


def test_what_the_weight_sync_writes_the_checkpoint_reader_reads(tmp_path):
    tensors = [(f"t.{dtype_name(dt)}", (torch.arange(6) % 2).view(2, 3).to(dt)) for dt in SAFETENSORS_DTYPES.values()]
    write_safetensors(to_flat_bucket(tensors), str(tmp_path / "model.safetensors"))
    ckpt = LazyHFCheckpoint(tmp_path)
    for name, t in tensors:
        assert ckpt.dtype(name) == t.dtype and torch.equal(ckpt.get(name), t), name


def test_no_other_module_names_dtypes():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "dtypes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("dtype_name", "dtype_from_name"):
                offenders.append(f"{path.relative_to(PACKAGE)}: def {node.name}")
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "BF16" for k in
                                                  node.keys + node.values):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: a safetensors dtype table")
    assert offenders == []
