"""Build this rank's megatron-core ``GPTModel`` stage for a model family: the one place that
turns a :class:`~megatron_tepo.models.GPTFamilyConfig`, a parallel layout and the run's
:class:`~megatron_tepo.config.ActorConfig` into a ``TransformerConfig`` and a model chunk. The
actor and the checkpoint converter both use it.

* :func:`~megatron_tepo.megatron.resolve.resolve_actor_config` (:mod:`.resolve`, the steps both builders share) turns ``auto`` into what runs here: ``attention: auto`` -> ``te``
  when Transformer Engine imports, else ``sdpa``; ``fusions: auto`` -> on with CUDA, off on CPU;
  ``gradient_accumulation_fusion: auto`` -> on with TE and apex's ``fused_weight_gradient_mlp_cuda``;
  ``moe_grouped_gemm: auto`` -> on with TE; ``packed_attention: auto`` -> ``varlen`` on CUDA in
  bf16 (``flex`` in fp32; ``loop`` where torch has neither), ``loop`` on CPU;
  ``model_builder: auto`` -> ``hybrid`` (megatron's ``HybridModel``, :mod:`.hybrid`) where this
  megatron-core has it (:func:`~megatron_tepo.megatron.compat.hybrid_model_available`), else
  ``gpt`` (``GPTModel``: megatron-core 0.16.1).
* :func:`transformer_config`: precision (``bf16``: ``bf16=True`` with bf16 parameters and
  pipeline tensors), activation recompute (``full``: megatron's ``uniform`` method over blocks of
  ``recompute_num_layers`` layers; ``selective``: the core attention), sequence parallelism and
  the fusions, all as megatron's own ``TransformerConfig`` fields; for an MoE family (its
  :class:`~megatron_tepo.models.MoEConfig`) also the runtime MoE settings: the token dispatcher
  of this machine (:func:`~megatron_tepo.megatron.resolve.moe_token_dispatcher`), grouped GEMM, no permute fusion, and
  ``moe_enable_routing_replay`` when ``actor.routing_replay`` is on (a dense family refuses it:
  :func:`~megatron_tepo.megatron.resolve.routing_replay_problem`).
* :func:`build_chunk`: the one construction function -- a stage of the model the resolved
  ``actor.model_builder`` names: :func:`build_gpt_chunk`, a ``GPTModel`` on the layer spec of
  :mod:`.spec` for the resolved attention (te: Transformer Engine's spec; sdpa: the local spec
  whose backend answers :class:`~megatron_tepo.megatron.attention.SDPACoreAttention` for the core
  attention; unfused: the local spec as megatron ships it), or
  :func:`~megatron_tepo.megatron.hybrid.build_hybrid_chunk`, a ``HybridModel`` on the same layer
  spec cut into its attention and MLP halves. For the hybrid stack ``TransformerConfig.num_layers``
  counts the stack's layers (two per HF layer) and ``recompute_num_layers`` is scaled with it, so
  ``actor.recompute_num_layers`` counts HF layers on either builder.

``auto`` is decided once, by :func:`~megatron_tepo.megatron.resolve.resolve_actor_config` (the actor's plan); the builders here
refuse a config that still holds one.

``actor.fusions`` turns on the fusions that need neither Transformer Engine nor apex, megatron's
``torch.compile``-d functions: SwiGLU (``bias_activation_fusion``; compiled once for every packed
length and both passes, :mod:`megatron_tepo.megatron.fast_paths`) and bias-dropout-add
(``bias_dropout_fusion``) only for a family that has a bias or dropout there -- without them it
fuses nothing (a compiled plain add) and cost recompiles. Transformer Engine's fused RoPE
(``apply_rope_fusion``, THD included) follows the attention: on whenever ``attention`` is ``te``,
whatever ``fusions`` says. ``gradient_accumulation_fusion`` needs both TE
(its linears take ``fuse_wgrad_accumulation`` from the config and accumulate into ``main_grad``
with their own GEMM) and apex's ``fused_weight_gradient_mlp_cuda`` (megatron-core 0.16.1's
``ColumnParallelLinear``, which is the output layer in every spec, raises at construction without
it): it cannot run on a CPU torch, and a unit test checks only that the setting reaches
``TransformerConfig``. ``moe_grouped_gemm`` with TE selects ``TEGroupedMLP`` (one grouped GEMM
for all local experts); its ``linear_fc*.weight{i}`` parameters are named as
``local_experts.{i}.linear_fc*.weight`` for the HF mapping (:mod:`megatron_tepo.megatron.sharding`).
Left out: ``persist_layer_norm`` and the masked-softmax kernels of the unfused attention (apex),
virtual pipeline stages, context parallelism.

Where the parameters are made: a random init runs on the CPU (``use_cpu_initialization``: the
same init for every TP size). With weights to load the init is off
(``transformer_config(initialize=False)``): nothing is drawn; on a CPU the parameters' pages stay
untouched until the loader writes this rank's slices into them, and the actor on a GPU makes the
parameters there (``on_gpu``: ``use_cpu_initialization=False``): megatron-core's Transformer Engine wrappers
run ``_initialize_affine_weight_cpu`` whenever CPU initialisation is on, init or not, which built
a full fp32 master of every TE linear on the host (about 50 GB per rank for a 14B model).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_tepo.config import ActorConfig
from megatron_tepo.megatron.compat import whole_layer_cuda_graph_kwargs
from megatron_tepo.megatron.family_kwargs import gpt_model_kwargs, transformer_config_kwargs
from megatron_tepo.models import GPTFamilyConfig
from megatron_tepo.megatron.resolve import (FP32_ACTOR, builder_problem, moe_token_dispatcher, require_resolved,
                                            routing_replay_problem)
from megatron_tepo.megatron.spec import block_spec, layer_spec

__all__ = ["transformer_config", "build_chunk", "build_gpt_chunk"]


def transformer_config(family_cfg: GPTFamilyConfig, *, tp: int, pp: int, ep: int = 1, cp: int = 1,
                       actor: ActorConfig = FP32_ACTOR, params_dtype: Optional[torch.dtype] = None,
                       initialize: bool = True, variable_seq_lengths: bool = False,
                       calculate_per_token_loss: bool = False, on_gpu: bool = False):
    """megatron ``TransformerConfig`` for ``family_cfg`` at this layout with ``actor``'s settings
    (resolved already: :func:`~megatron_tepo.megatron.resolve.resolve_actor_config`). ``params_dtype`` overrides the parameters'
    dtype only (the checkpoint converter stores bf16 checkpoints in bf16 without bf16 compute).

    ``initialize=False`` skips megatron's weight init (no random numbers; the parameters are
    ``torch.empty``, untouched until loaded): what the actor does when weights are given.
    :func:`build_gpt_chunk` then sets the ``tensor_model_parallel`` / ``partition_dim`` /
    ``partition_stride`` attributes that megatron's own layers get only from their init
    (:func:`megatron_tepo.megatron.sharding.mark_tensor_parallel_attributes`).
    ``variable_seq_lengths`` is needed with PP and micro-batches of varying shapes. ``on_gpu``
    (with ``initialize=False``): the parameters are made on the current CUDA device
    (``use_cpu_initialization=False``), not on the host (the module docstring says why); the
    actor's choice on a GPU, never the converter's (its skeleton may live on the meta device).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    require_resolved(actor)
    kw = transformer_config_kwargs(family_cfg)  # with the MoE sizes and router settings
    per = 1
    if actor.model_builder == "hybrid":  # each HF layer is two layers of the stack (megatron/hybrid.py)
        from megatron_tepo.megatron.hybrid import SUBLAYERS

        per = SUBLAYERS
        kw["num_layers"] = family_cfg.num_layers * per
    if actor.routing_replay != "off":
        if family_cfg.moe is None:
            raise ValueError(routing_replay_problem(family_cfg, actor))
        kw["moe_enable_routing_replay"] = True  # megatron's RouterReplay in every router (routing_replay.py)
    if family_cfg.moe is not None:
        kw.update(moe_token_dispatcher_type=moe_token_dispatcher(), moe_permute_fusion=False,
                  moe_grouped_gemm=actor.moe_grouped_gemm == "on")
    else:
        # Unused by dense layers, but the default "allgather" dispatcher makes TransformerConfig
        # refuse variable_seq_lengths.
        kw["moe_token_dispatcher_type"] = "alltoall"
    bf16 = actor.precision == "bf16"
    dtype = params_dtype or (torch.bfloat16 if bf16 else torch.float32)
    fused = actor.fusions == "on"
    if actor.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=actor.recompute_num_layers * per)  # (counted in HF layers)
    elif actor.recompute == "selective":
        kw.update(recompute_granularity="selective")
    return TransformerConfig(
        **kw,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
        sequence_parallel=actor.sequence_parallel,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # weights to load on a GPU: made there, never as a full fp32 host copy (module docstring)
        use_cpu_initialization=not (on_gpu and not initialize),
        perform_initialization=initialize,
        gradient_accumulation_fusion=actor.gradient_accumulation_fusion == "on",
        apply_rope_fusion=actor.attention == "te",  # TE's fused RoPE (THD included): follows TE
        persist_layer_norm=False,
        bias_activation_fusion=fused,
        # without a bias or dropout, megatron's fused bias-dropout-add is a compiled plain add
        bias_dropout_fusion=fused and (kw["add_bias_linear"] or kw["hidden_dropout"] > 0),
        masked_softmax_fusion=False,
        variable_seq_lengths=variable_seq_lengths,
        calculate_per_token_loss=calculate_per_token_loss,
        **whole_layer_cuda_graph_kwargs(TransformerConfig),
    )


def build_chunk(config, family_cfg: GPTFamilyConfig, pre_process: bool, post_process: bool,
                actor: ActorConfig = FP32_ACTOR):
    """This stage's model from the builder ``actor.model_builder`` names (resolved): the one
    construction function the actor and the converters call."""
    require_resolved(actor)
    if actor.model_builder == "hybrid":
        from megatron_tepo.megatron.hybrid import build_hybrid_chunk

        return build_hybrid_chunk(config, family_cfg, pre_process, post_process, actor)
    return build_gpt_chunk(config, family_cfg, pre_process, post_process, actor)


def build_gpt_chunk(config, family_cfg: GPTFamilyConfig, pre_process: bool, post_process: bool,
                    actor: ActorConfig = FP32_ACTOR):
    """The ``GPTModel`` of one pipeline stage, its layers from :func:`~megatron_tepo.megatron.spec.layer_spec`
    for the resolved ``actor.attention`` (te / sdpa / unfused) and ``actor.packed_attention``."""
    from megatron.core.models.gpt import GPTModel

    require_resolved(actor)
    problem = builder_problem(family_cfg, dataclasses.replace(actor, model_builder="gpt"))
    if problem:
        raise ValueError(problem)
    spec = layer_spec(family_cfg, actor.attention, packed_attention=actor.packed_attention,
                      moe_grouped_gemm=bool(getattr(config, "moe_grouped_gemm", False)),
                      sequence_parallel=bool(config.sequence_parallel))
    model = GPTModel(config=config, transformer_layer_spec=block_spec(spec, config), pre_process=pre_process,
                     post_process=post_process, **gpt_model_kwargs(family_cfg))
    if not config.perform_initialization:
        # megatron sets its layers' TP attributes only inside the init it skipped
        from megatron_tepo.megatron.sharding import mark_tensor_parallel_attributes

        mark_tensor_parallel_attributes(model)
    return model
