"""Qwen3-MoE HF config -> :class:`GPTFamilyConfig` (attention of Qwen3 + a routed-expert MLP,
typed in its ``moe`` field: :class:`MoEConfig`, read by :func:`moe_config_from_hf`).

Routing: softmax over all experts, top-k, renormalised when ``norm_topk_prob`` -- megatron's
``topk -> softmax`` (``moe_router_pre_softmax=False``) gives exactly that; without renormalisation
``moe_router_pre_softmax=True``. No token dropping (no capacity factor), no load-balancing loss
(RL fine-tuning; HF only adds it when asked for router logits), no shared experts.

On CPU only the ``allgather`` token dispatcher works (``alltoall`` creates a ``torch.cuda.Stream``
in ``MoEAlltoAllTokenDispatcher.__init__``), and megatron refuses ``allgather`` with
``variable_seq_lengths``, which the actor needs for pipeline parallelism: MoE on CPU is limited to
PP=1 (EP=1 or EP>1 over gloo both work). On GPU the ``alltoall`` dispatcher is used. Which one
runs is the megatron backend's choice for the machine (:func:`megatron_tepo.megatron.resolve.moe_token_dispatcher`),
not a fact of the model, and so is ``moe_grouped_gemm`` (``actor.moe_grouped_gemm``, on with
Transformer Engine; see :mod:`megatron_tepo.megatron.gpt`).

Left out: ``mlp_only_layers`` / ``decoder_sparse_step != 1`` (mixed dense/MoE stacks) ->
NotImplementedError.
"""
from __future__ import annotations

import dataclasses

from ..family import GPTFamilyConfig, MoEConfig, _get
from ..qwen3.config import from_hf_config as qwen3_config


def moe_config_from_hf(hf_config) -> MoEConfig:
    """The routed experts of a Qwen3-MoE HF config (dict or ``PretrainedConfig``)."""
    # hub config.json files say ``num_experts``; transformers >= 5 saves it as ``num_local_experts``
    # (its attribute_map alias), so a raw dict may carry either
    num_experts = _get(hf_config, "num_experts", None) or _get(hf_config, "num_local_experts", None)
    if not num_experts:
        raise ValueError("qwen3_moe config has neither num_experts nor num_local_experts")
    return MoEConfig(
        num_experts=int(num_experts),
        router_topk=int(_get(hf_config, "num_experts_per_tok")),
        ffn_hidden_size=int(_get(hf_config, "moe_intermediate_size")),
        router_pre_softmax=not bool(_get(hf_config, "norm_topk_prob", True)),
        router_score_function="softmax",
    )


def from_hf_config(hf_config, spec: str = "local") -> GPTFamilyConfig:
    if _get(hf_config, "mlp_only_layers", None):
        raise NotImplementedError("qwen3_moe: mlp_only_layers (dense layers in an MoE stack) is not supported")
    if int(_get(hf_config, "decoder_sparse_step", 1)) != 1:
        raise NotImplementedError("qwen3_moe: decoder_sparse_step != 1 is not supported")
    base = qwen3_config(hf_config, spec=spec, family="qwen3_moe")
    return dataclasses.replace(base, moe=moe_config_from_hf(hf_config))
