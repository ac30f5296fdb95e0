"""Checkpoints: the trainer's checkpoint store and Hugging Face safetensors <-> megatron-core
``dist_checkpointing`` conversion.

The HF <-> Megatron mapping itself lives in :mod:`megatron_tepo.models` (shared with the rollout
weight sync); this package streams tensors between files and models:

* :mod:`.store` -- the trainer's ``step_<N>`` folders, the ``complete`` marker, find, check, prune.
* :mod:`.hf_to_megatron` -- HF -> Megatron import (``tools/convert_hf_to_megatron.py``), writing
  through :mod:`megatron_tepo.megatron.dist_writer` (the streaming torch_dist save).
* :mod:`.megatron_to_hf` -- Megatron -> HF export of a converted or trainer checkpoint
  (``tools/convert_megatron_to_hf.py``) and of the live actor, reading through :mod:`.dcp_reader`.
* :mod:`.sidecars` -- ``megatron_tepo_checkpoint.json`` and ``hf_source/``, what makes a checkpoint
  directory exportable.
* :mod:`.hf_io` -- HF files: lazy safetensors reads, sharded writes, side files, tensor checks.
* :mod:`.common` -- what both directions share (process group, output directory, model building).

It imports nothing from ``actor/`` or ``trainer/``, and nothing of megatron-core itself: its
saves, loads, sharded tensors and parallel state go through :mod:`megatron_tepo.megatron`
(tests/test_layers.py).
"""
from .common import build_gpt_model, build_model, ensure_process_group, load_checkpoint_into
from .hf_to_megatron import check_hf_input, convert_hf_to_megatron
from .megatron_to_hf import convert_megatron_to_hf, export_actor_to_hf
from .sidecars import read_checkpoint_info, read_family_config, write_conversion_sidecars

__all__ = ["convert_hf_to_megatron", "convert_megatron_to_hf", "build_model", "build_gpt_model",
           "load_checkpoint_into", "read_checkpoint_info", "read_family_config", "check_hf_input",
           "ensure_process_group", "export_actor_to_hf", "write_conversion_sidecars"]
