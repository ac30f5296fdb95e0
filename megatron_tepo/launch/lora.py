"""The fit check's price of LoRA (``actor.lora``): the adapters' parameters on one GPU of a pipeline
stage (:func:`lora_param_split`: the dense ones and the experts'; :func:`lora_params`: their sum)
and the activations they keep per token (:func:`lora_activation_bytes`), from the model's shape and
the target modules, split the way ``megatron/lora.py`` splits them:

* a column-parallel linear (``linear_qkv``, ``linear_fc1``, ``in_proj``; ``in -> out``): A
  ``[r, in]`` whole on every TP rank, B ``[out/t, r]`` split by rows like the weight;
* a row-parallel linear (``linear_proj``, ``linear_fc2``, ``out_proj``): A ``[r, in/t]`` split by
  columns, B ``[out, r]`` whole;
* an MoE expert's ``linear_fc1`` / ``linear_fc2``: one adapter per expert, each expert whole on its
  rank (expert TP 1: ``parallel.tp`` 1), the experts split over EP; their optimizer state is
  sharded over the experts' data-parallel group, as the experts' weights'. A shared expert's
  linears are dense ones (split by TP).

The target linears' shapes: ``linear_qkv`` ``h -> (q + 2 ng) d`` (``q`` = nh, twice with Qwen3.5's
output gate) and ``linear_proj`` ``nh d -> h`` on the attention layers; a Gated DeltaNet layer's
``in_proj`` ``h -> 2 qk + 2 v + 2 nv`` (query, key, value, output gate, beta, alpha) and
``out_proj`` ``v -> h``; ``linear_fc1`` ``h -> 2F`` (gate and up) and ``linear_fc2`` ``F -> h`` on
every layer of a dense model, per expert (``F`` the experts' size) and on the shared expert of an
MoE one. A target no linear of the model has is skipped, as the actor skips it. What the rest of a
LoRA actor costs (the frozen base: weights only; the adapters: weights, gradients, the distributed
optimizer's state) is :func:`megatron_tepo.launch.memory.actor_memory`'s. Pure arithmetic; left
out: the MoE router (no target), the experts' activations per token beyond the dense layers'
average (the adapters' ``h`` of the routed tokens, ``topk x r``, priced as one MLP's ``r``).
"""
from __future__ import annotations

from typing import Dict, Iterator, Tuple

from megatron_tepo.layer_kinds import attention_layers, linear_dims
from megatron_tepo.layout import ModelShape

__all__ = ["target_shapes", "lora_params", "lora_param_split", "lora_activation_bytes", "lora_shape_problem"]

COLUMN = ("linear_qkv", "linear_fc1", "in_proj")  # column-parallel (B split by rows); the others row-parallel
MLP = ("linear_fc1", "linear_fc2")


def lora_shape_problem(m: ModelShape, lora, tp: int = 1, moe_grouped_gemm: str = "off") -> str:
    """Why ``lora`` cannot go on a model of shape ``m`` at TP ``tp`` (megatron/lora.py's rule: an
    MoE model's MLP targets adapt its experts, which must be local linears, each whole on its rank),
    or ""."""
    mlp = sorted(set(lora.target_modules) & set(MLP))
    if not (m.is_moe and mlp):
        return ""
    if moe_grouped_gemm == "on":
        return (f"actor.lora.target_modules: {', '.join(mlp)} on an MoE model ({m.family or 'moe'}) adapt its "
                f"experts, one local linear per expert: set actor.moe_grouped_gemm: off")
    if tp > 1:
        return (f"actor.lora.target_modules: {', '.join(mlp)} on an MoE model ({m.family or 'moe'}) adapt its "
                f"experts, which parallel.tp: {tp} splits (expert TP); use parallel.tp: 1 (with ep), or target "
                f"linear_qkv and linear_proj only")
    return ""


def target_shapes(m: ModelShape) -> Dict[str, Tuple[int, int]]:
    """``(in, out)`` of each target linear's whole weight (a dense MLP's, or one expert's)."""
    h, d = m.hidden_size, m.head_dim
    q = (2 if m.attention_output_gate else 1) * m.num_attention_heads
    f = m.moe_intermediate_size if m.is_moe else m.intermediate_size
    shapes = {"linear_qkv": (h, (q + 2 * m.num_key_value_heads) * d), "linear_proj": (m.num_attention_heads * d, h),
              "linear_fc1": (h, 2 * f), "linear_fc2": (f, h)}
    if m.linear_layers:
        qk, v, nv = linear_dims(m)
        shapes.update(in_proj=(h, 2 * qk + 2 * v + 2 * nv), out_proj=(v, h))
    return shapes


def _adapted(m: ModelShape, lora, t: int, p: int, e: int) -> Iterator[Tuple[str, int, int, int, bool]]:
    """``(target, linears on one GPU of a stage, in, out, expert)`` of every target the model has."""
    n = m.num_hidden_layers // p
    shapes = target_shapes(m)
    for target in lora.target_modules:
        if target not in shapes:
            continue  # (no such linear in this model: the actor skips it too)
        fan_in, fan_out = shapes[target]
        if target in ("linear_qkv", "linear_proj"):
            yield target, attention_layers(m) * n // m.num_hidden_layers, fan_in, fan_out, False
        elif target in ("in_proj", "out_proj"):
            yield target, m.linear_layers * n // m.num_hidden_layers, fan_in, fan_out, False
        elif m.is_moe:
            yield target, n * (m.num_experts // e), fan_in, fan_out, True
            if m.shared_expert_intermediate_size:
                s, h = m.shared_expert_intermediate_size, m.hidden_size
                yield target, n, *((h, 2 * s) if target == "linear_fc1" else (s, h)), False
        else:
            yield target, n, fan_in, fan_out, False


def lora_param_split(m: ModelShape, lora, t: int = 1, p: int = 1, e: int = 1) -> Tuple[int, int]:
    """The adapters' parameters on one GPU of a stage at TP ``t``, PP ``p`` and EP ``e`` (every stage
    holds the same number of layers): (dense, the experts'); ``t=p=e=1``: the whole model's."""
    r, dense, expert = lora.rank, 0, 0
    for target, count, fan_in, fan_out, is_expert in _adapted(m, lora, t, p, e):
        if is_expert:  # (each expert whole on its rank)
            expert += count * r * (fan_in + fan_out)
        elif target in COLUMN:
            dense += count * (r * fan_in + r * fan_out // t)
        else:
            dense += count * (r * fan_in // t + r * fan_out)
    return dense, expert


def lora_params(m: ModelShape, lora, t: int = 1, p: int = 1, e: int = 1) -> int:
    """:func:`lora_param_split`'s sum."""
    return sum(lora_param_split(m, lora, t, p, e))


def lora_activation_bytes(m: ModelShape, lora, t: int, sp: bool, elem: int = 2) -> float:
    """Bytes per token of the micro-batch that one layer's adapters keep for backward, averaged over
    the layers as :func:`~megatron_tepo.launch.memory.layer_activation_bytes` is: each target's
    ``h = x A^T`` (``r`` elements a token; a column-parallel linear's under sequence parallelism is
    gathered over the sequence, still ``r`` a token of the micro-batch); with ``actor.lora.dropout``
    the dropped input (its elements and its boolean mask: a column-parallel linear's input is whole,
    or 1/t of the tokens under sequence parallelism; a row-parallel one's is split, ``in/t``). Its
    input itself is the base linear's, kept anyway. An MoE layer's experts count as one MLP."""
    total, n = 0.0, m.num_hidden_layers
    seen = set()
    for target, count, fan_in, _, _ in _adapted(m, lora, t, 1, 1):
        if target in seen:
            continue  # (an MoE layer's shared expert: counted with its experts, as one MLP)
        seen.add(target)
        one = float(elem * lora.rank)
        if lora.dropout > 0:
            one += (elem + 1) * fan_in / t if (target not in COLUMN or sp) else (elem + 1) * fan_in
        layers = count if not (m.is_moe and target in MLP) else n
        total += one * layers / n
    return total
