"""The fit check's price of LoRA (``actor.lora``): the adapters' parameters on one GPU of a pipeline
stage (:func:`lora_params`) and the activations they keep per token (:func:`lora_activation_bytes`),
from the model's shape and the target modules, split by TP the way ``megatron/lora.py`` splits them:

* a column-parallel linear (``linear_qkv``, ``linear_fc1``; ``in -> out``): A ``[r, in]`` whole on
  every TP rank, B ``[out/t, r]`` split by rows like the weight;
* a row-parallel linear (``linear_proj``, ``linear_fc2``): A ``[r, in/t]`` split by columns, B
  ``[out, r]`` whole.

The target linears' shapes: ``linear_qkv`` ``h -> (q + 2 ng) d`` (``q`` = nh, twice with Qwen3.5's
output gate), ``linear_proj`` ``nh d -> h`` (attention layers only: a hybrid's Gated DeltaNet
projections are no targets), ``linear_fc1`` ``h -> 2F`` (gate and up), ``linear_fc2`` ``F -> h``
(every layer of a dense model). What the rest of a LoRA actor costs (the frozen base: weights only;
the adapters: weights, gradients, the distributed optimizer's state) is
:func:`megatron_tepo.launch.memory.actor_memory`'s. Pure arithmetic; left out: an MoE model's MLP
targets (its experts take no adapters yet: :func:`lora_shape_problem` refuses them, as the actor does).
"""
from __future__ import annotations

from typing import Dict, Tuple

from megatron_tepo.layer_kinds import attention_layers
from megatron_tepo.layout import ModelShape

__all__ = ["target_shapes", "lora_params", "lora_activation_bytes", "lora_shape_problem"]

COLUMN = ("linear_qkv", "linear_fc1")  # column-parallel (B split by rows); the others are row-parallel


def lora_shape_problem(m: ModelShape, lora) -> str:
    """Why ``lora`` cannot go on a model of shape ``m`` (megatron/lora.py's rule: no adapters on MoE
    experts), or ""."""
    mlp = sorted(set(lora.target_modules) & {"linear_fc1", "linear_fc2"})
    if m.is_moe and mlp:
        return (f"actor.lora.target_modules: {', '.join(mlp)} on an MoE model ({m.family or 'moe'}) would adapt its "
                f"experts, which is not built yet; target linear_qkv and linear_proj")
    return ""


def target_shapes(m: ModelShape) -> Dict[str, Tuple[int, int]]:
    """``(in, out)`` of each target linear's whole weight."""
    h, d = m.hidden_size, m.head_dim
    q = (2 if m.attention_output_gate else 1) * m.num_attention_heads
    return {"linear_qkv": (h, (q + 2 * m.num_key_value_heads) * d), "linear_proj": (m.num_attention_heads * d, h),
            "linear_fc1": (h, 2 * m.intermediate_size), "linear_fc2": (m.intermediate_size, h)}


def _layers(m: ModelShape, target: str, p: int) -> int:
    """How many of one pipeline stage's layers have the target (attention's: a hybrid's share)."""
    n = m.num_hidden_layers // p
    if target in ("linear_qkv", "linear_proj"):
        return attention_layers(m) * n // m.num_hidden_layers
    return n


def lora_params(m: ModelShape, lora, t: int = 1, p: int = 1) -> int:
    """The adapters' parameters on one GPU of a stage at TP ``t`` and PP ``p`` (every stage holds
    the same number of layers); ``t=p=1``: the whole model's."""
    r, total = lora.rank, 0
    for target in lora.target_modules:
        fan_in, fan_out = target_shapes(m)[target]
        one = r * fan_in + r * fan_out // t if target in COLUMN else r * fan_in // t + r * fan_out
        total += _layers(m, target, p) * one
    return total


def lora_activation_bytes(m: ModelShape, lora, t: int, sp: bool, elem: int = 2) -> float:
    """Bytes per token of the micro-batch that one layer's adapters keep for backward, averaged over
    the layers as :func:`~megatron_tepo.launch.memory.layer_activation_bytes` is: each target's
    ``h = x A^T`` (``r`` elements a token; a column-parallel linear's under sequence parallelism is
    gathered over the sequence, still ``r`` a token of the micro-batch); with ``actor.lora.dropout``
    the dropped input (its elements and its boolean mask: a column-parallel linear's input is whole,
    or 1/t of the tokens under sequence parallelism; a row-parallel one's is split, ``in/t``). Its
    input itself is the base linear's, kept anyway."""
    total, n = 0.0, m.num_hidden_layers
    for target in lora.target_modules:
        fan_in, _ = target_shapes(m)[target]
        one = float(elem * lora.rank)
        if lora.dropout > 0:
            one += (elem + 1) * fan_in / t if (target not in COLUMN or sp) else (elem + 1) * fan_in
        total += one * _layers(m, target, 1) / n
    return total
