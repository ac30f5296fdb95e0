"""Build this rank's megatron-core ``HybridModel`` stage: the model stack's second builder, beside
:func:`megatron_tepo.megatron.gpt.build_gpt_chunk`, chosen by ``actor.model_builder``
(:func:`~megatron_tepo.megatron.resolve.resolve_actor_config`: ``hybrid`` wherever megatron-core has
``HybridModel``, 0.18 on; ``gpt`` on 0.16.1 / 0.17).

A ``HybridStack`` is a list of single-purpose layers named by a pattern of symbols; every decoder
layer of a Hugging Face model is two of them here, its token mixer then its MLP
(:data:`SUBLAYERS`): ``*`` attention or ``G`` Gated DeltaNet (each token mixer's symbol is its row's in the
layer-kind table, :mod:`megatron_tepo.layer_kinds`; its sublayer spec a row of :data:`MIXER_SPECS`), then ``-`` a dense MLP or ``E`` an
MoE layer (:func:`layer_pattern`; ``|`` between pipeline stages, which never split a decoder
layer). HF layer ``i`` is stack layers ``2i`` and ``2i + 1``.

The layer specs (:func:`hybrid_stack_spec`) are the GPT layer spec of :mod:`.spec` for the same
settings, cut in two: the attention sublayer keeps its input norm and self-attention (the sdpa
core attention, Qwen3's QK norms, the sequence-parallel torch norms, Transformer Engine's fused
norm-and-linear with ``te``), the MLP sublayer its pre-MLP norm and MLP or MoE. The same modules
run the same arithmetic in the same order: a dense Qwen3 or Qwen3-MoE through ``HybridModel``
equals ``GPTModel`` bit for bit (tests/megatron/test_hybrid_builder.py). The Gated DeltaNet
sublayer is megatron's ``GatedDeltaNet`` (its input norm fused into ``in_proj`` with ``te``, as
megatron's own ``hybrid_stack_spec``), its output norm :class:`GatedOutputNorm`. Without
Transformer Engine the stack's final norm is the local torch norm (
megatron's ``HybridStack`` hard-codes ``TENorm``: :func:`local_hybrid_stack`).

Names: megatron's parameters are ``decoder.layers.{2i + j}.*`` and ``decoder.final_norm``; the
mapping of :mod:`megatron_tepo.models` knows every model by the GPT names of its HF layers
(``decoder.layers.{i}.*``, ``decoder.final_layernorm``), and :mod:`.sharding` translates
(:func:`~megatron_tepo.megatron.sharding.layer_offsets`, ``to_global_name``), so loading, export,
the converters and routing replay see the same names on either builder. Megatron's own
``sharded_state_dict`` keys (the torch_dist checkpoints) are the stack's: a checkpoint is loaded
by the builder that wrote it (its marker and sidecar record it).

Gated DeltaNet kernels: where flash-linear-attention would refuse its backward
(``megatron_tepo/gdn_kernels.py``, the rule the launch checks too) the builder refuses the model
with the ways out; on a GPU without fla-core (the pure-torch stand-in in place:
``cpu_patches.gdn_kernels``) it says so once, loudly, unless ``MTEPO_GDN_KERNELS=torch`` chose it
(:func:`say_stand_in_on_gpu`).

Without ``actor.fusions`` the ``torch.compile``-d helpers of megatron's Gated DeltaNet and of its
attention's output gate (``jit_fuser``; gated attention only) run eagerly (:func:`eager_fusers`):
a CPU run compiles nothing.

Left out: Mamba, MLA and DSA layers, multi-token prediction, virtual pipeline stages, megatron's
Transformer Engine ``hybrid_stack_spec`` as such (the same modules come from the GPT TE spec, so
the actor's grouped-GEMM and attention choices hold on both builders).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from megatron_tepo.config import ActorConfig
from megatron_tepo.layer_kinds import ATTENTION, GATED_DELTANET
from megatron_tepo.megatron.family_kwargs import gpt_model_kwargs
from megatron_tepo.models import GPTFamilyConfig

__all__ = ["SUBLAYERS", "MIXER_SPECS", "layer_pattern", "hybrid_stack_spec", "build_hybrid_chunk",
           "GatedOutputNorm", "local_hybrid_stack", "eager_fusers"]

#: stack layers per HF decoder layer: the token mixer, then the MLP
SUBLAYERS = 2


def mixer_symbol(family_cfg: GPTFamilyConfig, layer: int) -> str:
    """The symbol of the layer's token mixer in the layer-kind table (:mod:`megatron_tepo.layer_kinds`):
    ``G`` for a Gated DeltaNet layer, ``*`` for attention."""
    return family_cfg.layer_kind(layer).symbol


def mlp_symbol(family_cfg: GPTFamilyConfig, layer: int) -> str:
    """``E`` for an MoE layer (every layer of an MoE family: :class:`~megatron_tepo.models.MoEConfig`),
    ``-`` for a dense MLP."""
    return "E" if family_cfg.moe is not None else "-"


def layer_pattern(family_cfg: GPTFamilyConfig, pp: int = 1) -> str:
    """The ``hybrid_layer_pattern`` of ``family_cfg``: two symbols per HF layer, ``|`` between the
    ``pp`` pipeline stages (equal numbers of HF layers: the layout rules ask ``num_layers % pp == 0``)."""
    n = family_cfg.num_layers
    if n % pp:
        raise ValueError(f"parallel.pp: {n} layers do not split into {pp} equal pipeline stages")
    per_stage = n // pp
    stages = ["".join(mixer_symbol(family_cfg, i) + mlp_symbol(family_cfg, i)
                      for i in range(s * per_stage, (s + 1) * per_stage)) for s in range(pp)]
    return "|".join(stages)


class GatedOutputNorm:
    """The Gated DeltaNet's output norm over each value head: a plain RMSNorm (weight 1 at init,
    not zero-centred even where the model's other norms are; HF ``Qwen3_5RMSNormGated``), torch's
    on every spec. Each tensor-parallel rank normalises only its own heads, so its weight's
    gradient is a partial sum: it carries ``tp_partial_grad`` and the train model sums it over the
    TP ranks (megatron sums only norms marked for sequence parallelism, or named as QK norms)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        norm.weight.tp_partial_grad = True
        return norm


def _eager(fn):
    """The function under megatron's ``jit_fuser`` (``torch.compile``) decoration."""
    return getattr(fn, "__wrapped__", fn)


@functools.lru_cache(maxsize=None)
def eager_fusers():
    """``{megatron class: its subclass whose jit_fuser helpers run eagerly}`` (made once)."""
    from megatron.core.transformer.attention import SelfAttention

    out = {}
    attn = type("EagerSelfAttention", (SelfAttention,),
                {"_apply_output_gate": _eager(SelfAttention._apply_output_gate), "__module__": __name__,
                 "__doc__": "megatron's SelfAttention, its output gate eager (actor.fusions: off)"})
    out[SelfAttention] = attn
    gdn = gated_delta_net_class()
    if gdn is not None:
        out[gdn] = type("EagerGatedDeltaNet", (gdn,), {
            name: _eager(getattr(gdn, name)) for name in
            ("_prepare_input_for_gated_delta_rule", "_compute_g_and_beta", "_apply_gated_norm")} | {
            "__module__": __name__, "__doc__": "megatron's GatedDeltaNet, its jit_fuser helpers eager"})
    return out


def gated_delta_net_class():
    """megatron's ``GatedDeltaNet``, or None where this megatron-core has none."""
    try:
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    except ImportError:
        return None
    return GatedDeltaNet


_SAID_STAND_IN: list = []  # whether this process said it trains on the stand-in (once)


def say_stand_in_on_gpu() -> None:
    """On a GPU, the Gated DeltaNet on the pure-torch stand-in (fla-core missing) is said once, on
    rank 0, as a warning line naming why it is slow and how to get fla-core, unless the user chose
    it (``MTEPO_GDN_KERNELS=torch``). On CPU, where the stand-in is the only way, nothing is said."""
    import sys

    import torch.distributed as dist

    from megatron_tepo.gdn_kernels import stand_in_chosen, stand_in_warning
    from megatron_tepo.megatron.cpu_patches import cuda_available

    if _SAID_STAND_IN or stand_in_chosen() or not cuda_available():
        return
    _SAID_STAND_IN.append(True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[megatron_tepo] {stand_in_warning('fla-core is not installed in this python')}", file=sys.stderr,
              flush=True)


def _gdn_layer_spec(attention_layer, te: bool, fused: bool):
    """The Gated DeltaNet sublayer: the attention sublayer's input norm (none with ``te``: fused
    into ``in_proj``), megatron's ``GatedDeltaNet`` with :class:`GatedOutputNorm`."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    gdn = gated_delta_net_class()
    if te:
        from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear, TERowParallelLinear

        in_proj, out_proj, norm = TELayerNormColumnParallelLinear, TERowParallelLinear, IdentityOp
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        in_proj, out_proj, norm = ColumnParallelLinear, RowParallelLinear, attention_layer.submodules.input_layernorm
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(module=gdn if fused else eager_fusers()[gdn],
                                  submodules=GatedDeltaNetSubmodules(in_proj=in_proj, out_norm=GatedOutputNorm,
                                                                     out_proj=out_proj)),
        self_attn_bda=get_bias_dropout_add))


def _gdn_sublayer(family_cfg: GPTFamilyConfig, attention_layer, te: bool, fused: bool):
    """The Gated DeltaNet sublayer for ``family_cfg``, or a ValueError where megatron-core has no
    ``GatedDeltaNet`` or fla's backward would refuse this GPU."""
    if gated_delta_net_class() is None:
        raise ValueError(f"{family_cfg.family}: Gated DeltaNet layers need megatron-core's GatedDeltaNet "
                         f"(megatron-core >= 0.19), which this megatron-core does not have")
    from megatron_tepo.gdn_kernels import WAYS_OUT
    from megatron_tepo.megatron.cpu_patches import applied_patches, fla_backward_refusal

    stand_in = GATED_DELTANET.cpu_stand_in in applied_patches()
    refusal = None if stand_in else fla_backward_refusal()
    if refusal:  # (fla raises in the first backward, after the first rollout: say so now)
        raise ValueError(f"{family_cfg.family}: {refusal}: {WAYS_OUT}")
    if stand_in:
        say_stand_in_on_gpu()
    return _gdn_layer_spec(attention_layer, te, fused)


#: the megatron side of the layer-kind table (:mod:`megatron_tepo.layer_kinds`): each token mixer
#: but attention (the GPT spec's own) -> (its ``HybridStackSubmodules`` field, the function that
#: makes its sublayer spec: ``(family_cfg, attention sublayer, te, fused) -> ModuleSpec``)
MIXER_SPECS = {GATED_DELTANET.name: ("gdn_layer", _gdn_sublayer)}


def _split(gpt_layer):
    """A GPT layer spec -> (its attention sublayer, its MLP sublayer)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    s = gpt_layer.submodules
    keys = dict(getattr(s, "sharded_state_dict_keys_map", None) or {})
    attention = ModuleSpec(module=gpt_layer.module, submodules=TransformerLayerSubmodules(
        input_layernorm=s.input_layernorm, self_attention=s.self_attention, self_attn_bda=s.self_attn_bda,
        sharded_state_dict_keys_map=keys))
    mlp = ModuleSpec(module=gpt_layer.module, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=s.pre_mlp_layernorm, mlp=s.mlp, mlp_bda=s.mlp_bda, sharded_state_dict_keys_map=keys))
    return attention, mlp


def hybrid_stack_spec(family_cfg: GPTFamilyConfig, actor: ActorConfig, *, moe_grouped_gemm: bool = False,
                      sequence_parallel: bool = False):
    """The ``HybridStack`` spec for ``family_cfg`` and the resolved ``actor`` (module docstring)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_tepo.megatron.spec import layer_spec

    kw = dict(packed_attention=actor.packed_attention, moe_grouped_gemm=moe_grouped_gemm,
              sequence_parallel=sequence_parallel)
    fused = actor.fusions == "on"
    attention_layer, mlp_layer = _split(layer_spec(dataclasses.replace(family_cfg, moe=None), actor.attention, **kw))
    if (not fused and family_cfg.attention_output_gate
            and attention_layer.submodules.self_attention.module is SelfAttention):
        attention_layer.submodules.self_attention.module = eager_fusers()[SelfAttention]
    moe_layer = None
    if family_cfg.moe is not None:
        _, moe_layer = _split(layer_spec(family_cfg, actor.attention, **kw))
    kinds = {family_cfg.layer_kind(i) for i in range(family_cfg.num_layers)} - {ATTENTION}
    sub = dict(attention_layer=attention_layer, mlp_layer=mlp_layer)
    if moe_layer is not None:
        sub["moe_layer"] = moe_layer
    for kind in sorted(kinds, key=lambda k: k.name):  # each other mixer's sublayer, from its MIXER_SPECS row
        field, make = MIXER_SPECS[kind.name]
        sub[field] = make(family_cfg, attention_layer, actor.attention == "te", fused)
    if actor.attention == "te":
        from megatron.core.models.hybrid.hybrid_block import HybridStack

        return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(**sub))
    return ModuleSpec(module=local_hybrid_stack(), submodules=HybridStackSubmodules(**sub),
                      params={"final_norm": attention_layer.submodules.input_layernorm})


@functools.lru_cache(maxsize=None)
def local_hybrid_stack():
    """megatron's ``HybridStack`` with the local spec's final norm (made on first use: it
    subclasses megatron-core's class, which this module does not import at its own import)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.transformer.spec_utils import build_module

    class _LocalHybridStack(HybridStack):
        """megatron's ``HybridStack`` with the local spec's norm as its final norm (``final_norm``:
        the class or spec that the attention sublayer's input norm is); megatron's hard-codes
        ``TENorm``, which needs Transformer Engine."""

        def __init__(self, config, submodules, *args, final_norm=None, post_layer_norm: bool = True, **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = build_module(final_norm, config=self.config, hidden_size=self.config.hidden_size,
                                               eps=self.config.layernorm_epsilon)

    _LocalHybridStack.__name__ = _LocalHybridStack.__qualname__ = "LocalHybridStack"
    _LocalHybridStack.__module__ = __name__
    return _LocalHybridStack


def build_hybrid_chunk(config, family_cfg: GPTFamilyConfig, pre_process: bool, post_process: bool,
                       actor: ActorConfig, pp: Optional[int] = None):
    """The ``HybridModel`` of one pipeline stage for ``family_cfg`` (its layers: :func:`layer_pattern`
    over ``pp`` stages, default ``config.pipeline_model_parallel_size``)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_tepo.megatron.resolve import require_resolved

    require_resolved(actor)
    pp = pp or config.pipeline_model_parallel_size
    spec = hybrid_stack_spec(family_cfg, actor, moe_grouped_gemm=bool(getattr(config, "moe_grouped_gemm", False)),
                             sequence_parallel=bool(config.sequence_parallel))
    kw = gpt_model_kwargs(family_cfg)
    rope_scaling = {k: kw.pop(k) for k in ("rope_scaling", "rope_scaling_factor") if k in kw}
    model = HybridModel(config=config, hybrid_stack_spec=spec, hybrid_layer_pattern=layer_pattern(family_cfg, pp),
                        pre_process=pre_process, post_process=post_process, **kw)
    if rope_scaling and getattr(model, "rotary_pos_emb", None) is not None:
        # (HybridModel passes no llama3 scaling to its RotaryEmbedding: the same one GPTModel builds)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        model.rotary_pos_emb = RotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=kw.get("rotary_percent", 1.0),
            seq_len_interpolation_factor=kw.get("seq_len_interpolation_factor"), rotary_base=kw["rotary_base"],
            use_cpu_initialization=config.use_cpu_initialization, cp_group=model.pg_collection.cp,
            rope_scaling=True, rope_scaling_factor=rope_scaling.get("rope_scaling_factor", 8.0))
    model.decoder.sublayers_per_hf_layer = SUBLAYERS  # the layer names' translation (sharding.layer_offsets)
    if not config.perform_initialization:
        from megatron_tepo.megatron.sharding import mark_tensor_parallel_attributes

        mark_tensor_parallel_attributes(model)
    return model
