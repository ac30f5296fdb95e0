"""Checkpoint conversion: Hugging Face safetensors <-> megatron-core ``dist_checkpointing``.

The HF <-> Megatron mapping itself lives in :mod:`megatron_tepo.models` (shared with the rollout
weight sync); this package streams tensors between files and models. See :mod:`.convert` and
:mod:`.hf_io`; the command-line tools are ``tools/convert_hf_to_megatron.py`` and
``tools/convert_megatron_to_hf.py``.
"""
from .convert import (
    build_gpt_model,
    check_hf_input,
    convert_hf_to_megatron,
    convert_megatron_to_hf,
    ensure_process_group,
    export_actor_to_hf,
    write_conversion_sidecars,
    load_checkpoint_into,
    read_checkpoint_info,
    read_family_config,
)

__all__ = ["convert_hf_to_megatron", "convert_megatron_to_hf", "build_gpt_model",
           "load_checkpoint_into", "read_checkpoint_info", "read_family_config", "check_hf_input", "ensure_process_group",
           "export_actor_to_hf", "write_conversion_sidecars"]
