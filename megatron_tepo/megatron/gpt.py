"""Build this rank's megatron-core ``GPTModel`` stage for a model family: the one place that
turns a :class:`~megatron_tepo.models.GPTFamilyConfig` plus a parallel layout into a
``TransformerConfig`` and a model chunk. The actor and the checkpoint converter both use it.

Runtime flags are CPU-safe and harmless on GPU: CPU initialisation (identical init for every TP
size), no gradient-accumulation / rope / layer-norm / softmax / bias fusions. Left out: mixed
precision (bf16/fp16 master weights), virtual pipeline stages, context parallelism.
"""
from __future__ import annotations

import torch

from megatron_tepo.models import GPTFamilyConfig
from megatron_tepo.models.spec import get_layer_spec

__all__ = ["transformer_config", "build_gpt_chunk"]


def transformer_config(family_cfg: GPTFamilyConfig, *, tp: int, pp: int, ep: int = 1,
                       sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                       initialize: bool = True, variable_seq_lengths: bool = False,
                       calculate_per_token_loss: bool = False):
    """megatron ``TransformerConfig`` for ``family_cfg`` at this layout.

    ``initialize=False`` skips megatron's weight init -- and with it the ``tensor_model_parallel``
    / ``partition_dim`` / ``partition_stride`` attributes that :mod:`megatron_tepo.models.sharding`
    places tensors by: only right at TP=1 or when loading through ``sharded_state_dict``.
    ``variable_seq_lengths`` is needed with PP and micro-batches of varying shapes.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = family_cfg.transformer_config_kwargs()
    if family_cfg.extra.get("num_experts"):
        kw.update(family_cfg.extra["moe_transformer_kwargs"])
    else:
        # Unused by dense layers, but the default "allgather" dispatcher makes TransformerConfig
        # refuse variable_seq_lengths.
        kw["moe_token_dispatcher_type"] = "alltoall"
    return TransformerConfig(
        **kw,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        variable_seq_lengths=variable_seq_lengths,
        calculate_per_token_loss=calculate_per_token_loss,
    )


def build_gpt_chunk(config, family_cfg: GPTFamilyConfig, pre_process: bool, post_process: bool):
    """The ``GPTModel`` of one pipeline stage (layer spec: Transformer Engine when importable)."""
    from megatron.core.models.gpt import GPTModel

    spec = get_layer_spec(family_cfg, num_experts=family_cfg.extra.get("num_experts"))
    return GPTModel(config=config, transformer_layer_spec=spec, pre_process=pre_process,
                    post_process=post_process, **family_cfg.gpt_model_kwargs())
