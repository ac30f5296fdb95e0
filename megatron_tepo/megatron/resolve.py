"""The actor's settings made concrete for this machine and checked against a model family: the
steps both model builders share (:mod:`.gpt` and :mod:`.hybrid` import them; neither imports the
other's checks).

* :func:`resolve_actor_config` turns ``auto`` into what runs here (once: the actor's plan; what each
  ``auto`` becomes is in :mod:`.gpt`'s docstring); :func:`require_resolved` is the builders' guard
  that none is left.
* :func:`builder_problem` and :func:`routing_replay_problem`: why a resolved config cannot build or
  replay a family ("" when it can).
* :data:`FP32_ACTOR`: the settings of the checkpoint converter and other non-training builders.

Left out: the ``TransformerConfig`` and the model itself (:mod:`.gpt`, :mod:`.hybrid`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_tepo.config import ActorConfig
from megatron_tepo.models import GPTFamilyConfig
from megatron_tepo.megatron.spec import family_spec_name, te_available

__all__ = ["AUTO_FIELDS", "FP32_ACTOR", "resolve_model_builder", "resolve_actor_config", "family_spec",
           "moe_token_dispatcher", "routing_replay_problem", "builder_problem", "require_resolved",
           "grad_accum_fusion_available", "varlen_available", "flex_available"]

#: Settings whose ``auto`` values :func:`resolve_actor_config` decides (once: the actor's plan).
AUTO_FIELDS = ("attention", "fusions", "gradient_accumulation_fusion", "moe_grouped_gemm", "packed_attention",
               "model_builder")
#: What the checkpoint converter and other non-training builders use: fp32, no recompute, nothing
#: that needs Transformer Engine or CUDA.
FP32_ACTOR = ActorConfig(precision="fp32", attention="unfused", pack_sequences=False, fusions="off",
                         gradient_accumulation_fusion="off", moe_grouped_gemm="off", packed_attention="loop",
                         model_builder="gpt")


def resolve_model_builder(builder: str = "auto") -> str:
    """``actor.model_builder`` made concrete: ``auto`` -> ``hybrid`` where megatron-core has
    ``HybridModel``, else ``gpt``; ``hybrid`` where it has none is a ValueError naming the setting."""
    from megatron_tepo.megatron.compat import hybrid_model_available, mcore_version

    if builder == "auto":
        return "hybrid" if hybrid_model_available() else "gpt"
    if builder == "hybrid" and not hybrid_model_available():
        raise ValueError(f"actor.model_builder: hybrid needs megatron-core's HybridModel (megatron-core >= 0.18), "
                         f"and this is megatron-core {mcore_version()}; use gpt or auto")
    if builder not in ("hybrid", "gpt"):
        raise ValueError(f"actor.model_builder: {builder!r} must be auto, hybrid or gpt")
    return builder


def resolve_actor_config(actor: ActorConfig, cuda: Optional[bool] = None,
                         te: Optional[bool] = None) -> ActorConfig:
    """``actor`` with ``auto`` settings made concrete for this machine; refuses ``te`` without
    Transformer Engine (a ValueError naming the setting)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    te = te_available() if te is None else te
    attention = actor.attention
    if attention == "auto":
        attention = "te" if te else "sdpa"
    if attention == "te" and not te:
        raise ValueError("actor.attention: te needs Transformer Engine, which does not import here "
                         "(use sdpa, the default without it)")
    fusions = actor.fusions
    if fusions == "auto":
        fusions = "on" if cuda else "off"
    apex = grad_accum_fusion_available() if te else False
    gaf = actor.gradient_accumulation_fusion
    if gaf == "auto":
        gaf = "on" if te and apex else "off"
    if gaf == "on" and not (te and apex):
        raise ValueError("actor.gradient_accumulation_fusion: on needs Transformer Engine and apex's "
                         "fused_weight_gradient_mlp_cuda (megatron's output layer refuses it without them); "
                         "use auto or off")
    grouped = actor.moe_grouped_gemm
    if grouped == "auto":
        grouped = "on" if te else "off"
    if grouped == "on" and not te:
        raise ValueError("actor.moe_grouped_gemm: on needs Transformer Engine (TEGroupedMLP); use auto or off")
    packed = actor.packed_attention
    if packed == "auto":
        packed = "loop"
        if cuda and actor.precision == "bf16" and varlen_available():
            packed = "varlen"
        elif cuda and flex_available():
            packed = "flex"
    if packed == "varlen" and not varlen_available():
        raise ValueError("actor.packed_attention: varlen needs torch.nn.attention.varlen (torch >= 2.10); "
                         "use flex, loop or auto")
    if packed == "flex" and not flex_available():
        raise ValueError("actor.packed_attention: flex needs torch.nn.attention.flex_attention; use loop or auto")
    return dataclasses.replace(actor, attention=attention, fusions=fusions, gradient_accumulation_fusion=gaf,
                               moe_grouped_gemm=grouped, packed_attention=packed,
                               model_builder=resolve_model_builder(actor.model_builder))


def grad_accum_fusion_available() -> bool:
    """apex's ``fused_weight_gradient_mlp_cuda`` imports (megatron's ColumnParallelLinear needs it
    for ``gradient_accumulation_fusion``)."""
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def varlen_available() -> bool:
    from megatron_tepo.megatron.attention import varlen_attn_fn

    return varlen_attn_fn() is not None


def flex_available() -> bool:
    from megatron_tepo.megatron.attention import flex_attention_fns

    return flex_attention_fns() is not None


def family_spec(actor: ActorConfig) -> str:
    """The layer spec name of a resolved actor config ("te" or "local"): it also names the HF
    mapping's norm tensors (:attr:`GPTFamilyConfig.spec`)."""
    return family_spec_name(actor.attention)


def moe_token_dispatcher(cuda: Optional[bool] = None) -> str:
    """megatron's MoE token dispatcher here: ``alltoall`` with CUDA, ``allgather`` on CPU (the
    alltoall dispatcher creates a ``torch.cuda.Stream``; see models/qwen3_moe/README.md)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "alltoall" if cuda else "allgather"


def routing_replay_problem(family_cfg: GPTFamilyConfig, actor: ActorConfig) -> str:
    """Why ``actor.routing_replay`` cannot run on ``family_cfg``, or ""."""
    if actor.routing_replay != "off" and family_cfg.moe is None:
        return (f"actor.routing_replay: {actor.routing_replay} replays MoE routing, and {family_cfg.family} is a "
                f"dense model (no routed experts); set routing_replay: off")
    return ""


def builder_problem(family_cfg: GPTFamilyConfig, actor: ActorConfig) -> str:
    """Why the resolved ``actor.model_builder`` cannot build ``family_cfg``, or "": a model with
    Gated DeltaNet layers, gated attention or zero-centred norms (Qwen3.5) is a ``HybridModel``
    only (the local GPT spec has none of them)."""
    needs = [what for what, has in (("Gated DeltaNet layers", family_cfg.linear_attention is not None),
                                    ("gated attention", family_cfg.attention_output_gate),
                                    ("zero-centred norms", family_cfg.zero_centered_norms)) if has]
    if needs and actor.model_builder != "hybrid":
        from megatron_tepo.megatron.compat import hybrid_model_available, mcore_version

        where = ("set actor.model_builder: hybrid (or auto)" if hybrid_model_available()
                 else f"megatron-core {mcore_version()} has no HybridModel: install megatron-core >= 0.19")
        return (f"actor.model_builder: {family_cfg.family} ({', '.join(needs)}) is built as megatron's HybridModel, "
                f"not a {actor.model_builder} model; {where}")
    return ""


def require_resolved(actor: ActorConfig) -> ActorConfig:
    """``actor`` itself when no setting is left ``auto``; a ValueError naming them otherwise."""
    left = [f"actor.{name}" for name in AUTO_FIELDS if getattr(actor, name) == "auto"]
    if left:
        raise ValueError(f"{', '.join(left)}: still 'auto'; resolve_actor_config decides auto settings "
                         f"once, for the machine the actor runs on, before anything is built")
    return actor
