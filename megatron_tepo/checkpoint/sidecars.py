"""The sidecars that make a megatron checkpoint directory exportable to Hugging Face, written next
to the torch_dist files by the HF -> Megatron converter and by the trainer into each of its
checkpoints, read by the Megatron -> HF exporter.

* ``hf_source/`` -- the source HF directory's config, generation config, tokenizer and chat-template
  files (every file that is not a weight file: :func:`~.hf_io.copy_side_files`); and, for a source
  with tensors the actor does not train (a published Qwen3.5's vision tower ``model.visual.*`` and
  MTP layer ``mtp.*``: :class:`~megatron_tepo.models.CheckpointNaming`), ``carried.safetensors``:
  those tensors as the source stores them, bytes copied (:func:`write_carried`), so that the
  export writes them back bit for bit without the source directory. Its cost, in every checkpoint:
  the carried tensors' bytes -- for Qwen3.5-27B in bf16 its vision tower, 0.461e9 parameters
  (0.92 GB), and its MTP layer, 0.425e9 (0.85 GB): 1.77 GB, beside the ~54 GB of its text
  weights and the optimizer state (counted on transformers 5.24's default ``Qwen3_5VisionConfig``
  with the 27B's ``out_hidden_size`` 5120, and one gated-attention layer + ``fc`` + norms for the
  MTP). Carrying them in the checkpoint instead of pointing at the source keeps a checkpoint
  convertible when the source is gone or changed.
* ``megatron_tepo_checkpoint.json`` (format ``megatron_tepo/hf-dist-ckpt/1``) -- ``family``;
  ``family_config``: the whole :class:`~megatron_tepo.models.GPTFamilyConfig`
  (:meth:`~megatron_tepo.models.GPTFamilyConfig.as_dict`), its ``moe`` an object with the
  experts' sizes and router settings or null for a dense model; ``spec`` (the layer spec that
  names the norm tensors); ``model_builder`` (``hybrid`` / ``gpt``: the megatron model whose
  ``sharded_state_dict`` keys the torch_dist files use; absent in files written before it was
  recorded, which were all ``gpt``: :func:`model_builder_of`); ``params_dtype``; ``saved_layout`` (tp/pp/ep/cp);
  ``megatron_core_version``; ``hf_tensors``: the source's HF tensor names (as its files name them,
  carried ones included) with their dtype and shape (what the export must give back).

:func:`read_family_config` reads the family config back. Files written before the MoE config was
typed (the MoE sizes were then in an untyped ``extra`` that was left out, so their
``family_config`` has no ``moe``), and files without a ``family_config``, are read by rebuilding
the config from ``hf_source/config.json`` at the recorded ``spec``.

Left out: the trainer's own files in its checkpoints (loop state, RNG states, the ``complete``
marker: :mod:`.store` and :mod:`megatron_tepo.actor.checkpointing`); nothing here reads or writes
tensors.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

from megatron_tepo.dtypes import dtype_name
from megatron_tepo.layout import ParallelLayout
from megatron_tepo.models import GPTFamilyConfig, family_config_from_hf

from .common import read_config_json
from .hf_io import LazyHFCheckpoint, copy_side_files, open_hf_checkpoint

INFO_NAME = "megatron_tepo_checkpoint.json"
HF_SOURCE = "hf_source"
CARRIED = "carried.safetensors"  # in hf_source/: the source's tensors that are not the text model's
FORMAT = "megatron_tepo/hf-dist-ckpt/1"
BUILDERS = ("hybrid", "gpt")

__all__ = ["INFO_NAME", "HF_SOURCE", "CARRIED", "FORMAT", "hf_tensor_table", "write_carried", "write_conversion_sidecars",
           "read_checkpoint_info", "read_family_config", "model_builder_of"]


def hf_tensor_table(ckpt: LazyHFCheckpoint) -> Dict[str, dict]:
    """HF tensor name -> ``{"dtype": name, "shape": [..]}`` of every tensor of a checkpoint (the
    text model's and the carried ones), as its files store them (stacked experts stacked), from
    its headers."""
    return {n: {"dtype": dtype_name(dt), "shape": list(shape)} for n, (shape, dt) in ckpt.stored_tensors().items()}


def write_carried(ckpt: LazyHFCheckpoint, directory) -> int:
    """The source's carried tensors (:meth:`~.hf_io.LazyHFCheckpoint.carried_names`: a vision tower,
    MTP layers), bit for bit, as ``directory/hf_source/carried.safetensors`` (none: no file); the
    bytes copied."""
    carried = ckpt.carried_names()
    if not carried:
        return 0
    try:
        return ckpt.copy_to_safetensors(carried, Path(directory) / HF_SOURCE / CARRIED)
    finally:
        ckpt.close()


def write_conversion_sidecars(directory, hf_dir, family_cfg: GPTFamilyConfig, params_dtype,
                              layout: ParallelLayout, ckpt: Optional[LazyHFCheckpoint] = None, *,
                              model_builder: str) -> None:
    """Write ``hf_source/`` (from ``hf_dir``) and ``megatron_tepo_checkpoint.json`` (module
    docstring) into ``directory``: what makes it convertible back to HF by
    :func:`~.megatron_to_hf.convert_megatron_to_hf`. ``ckpt``: ``hf_dir`` already open;
    ``model_builder``: the (resolved) builder whose model wrote the torch_dist files."""
    if model_builder not in BUILDERS:
        raise ValueError(f"model_builder: {model_builder!r} must be one of {list(BUILDERS)} (resolved)")
    from megatron_tepo.megatron.compat import reported_version

    directory = Path(directory)
    ckpt = ckpt or open_hf_checkpoint(hf_dir)
    copy_side_files(hf_dir, directory / HF_SOURCE)
    write_carried(ckpt, directory)
    info = {
        "format": FORMAT,
        "family": family_cfg.family,
        "family_config": family_cfg.as_dict(),
        "spec": family_cfg.spec,
        "model_builder": model_builder,
        "params_dtype": dtype_name(params_dtype),
        "saved_layout": layout.as_dict(),
        "megatron_core_version": reported_version(),
        "hf_tensors": hf_tensor_table(ckpt),
    }
    (directory / INFO_NAME).write_text(json.dumps(info, indent=1))


def read_checkpoint_info(megatron_dir) -> dict:
    """``megatron_tepo_checkpoint.json`` of ``megatron_dir``; refuses a missing file or another format."""
    path = Path(megatron_dir) / INFO_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {megatron_dir} is not a checkpoint written by "
                                f"convert_hf_to_megatron (it needs {INFO_NAME} and {HF_SOURCE}/)")
    info = json.loads(path.read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {info.get('format')!r} (expected {FORMAT!r})")
    return info


def read_family_config(megatron_dir, info: Optional[dict] = None) -> GPTFamilyConfig:
    """The family config a checkpoint directory was written with (``info``: its
    :func:`read_checkpoint_info`, read when None): the recorded ``family_config``, or -- for a file
    without one or without its ``moe`` entry (written before the MoE config was typed) -- the
    config rebuilt from ``hf_source/config.json`` at the recorded layer spec, as the exporter
    always did. An unknown field is a ValueError naming it."""
    info = read_checkpoint_info(megatron_dir) if info is None else info
    stored = info.get("family_config")
    if isinstance(stored, dict) and "moe" in stored:
        return GPTFamilyConfig.from_dict(stored)
    return family_config_from_hf(read_config_json(Path(megatron_dir) / HF_SOURCE), spec=info.get("spec", "local"))


def model_builder_of(info: dict) -> str:
    """The builder whose model wrote a checkpoint (its :func:`read_checkpoint_info`): the recorded
    ``model_builder``, or ``gpt`` for a file written before it was recorded (every model then was
    a ``GPTModel``). An unknown value is a ValueError naming it."""
    builder = info.get("model_builder", "gpt")
    if builder not in BUILDERS:
        raise ValueError(f"{INFO_NAME}: model_builder {builder!r} is not one of {list(BUILDERS)}")
    return builder
