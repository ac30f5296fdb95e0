"""MoE routing from SGLang servers (``actor.routing_replay: r3``): the request field that asks for
it, and its decoding from a ``/generate`` answer into ``Sample.routed_experts``
(:func:`decode_routed_experts`) in the wire dtype the answer names. Which layers route, how many
experts each token takes and the ids' dtype are the routing contract's
(:class:`megatron_tepo.routing.RoutingShape`, made by the model family's config and handed to the
fleet by the trainer through ``EngineSettings.routing``): nothing here reads a ``config.json``.

What SGLang returns (read in 0.5.7 and 0.5.23: ``srt/state_capturer/routed_experts.py``,
``srt/managers/tokenizer_manager.py``): a server started with ``--enable-return-routed-experts``
(SGLang >= 0.5.7: ``versions.py``) answers a request with ``return_routed_experts: true``
(``routed_experts_start_len`` 0: from the prompt's first token) with ``meta_info["routed_experts"]``,
the base64 of an array of ``[prompt + output - 1, num_hidden_layers, num_experts_per_tok]`` ids
(every layer of the model, the dense ones of a mixed stack included; the last output token is never
run). This module keeps the MoE layers, in the actor's order.

The wire format: int32 in every release up to 0.5.23 (the newest; 4 bytes an id, 1536 a token for
Qwen3-30B-A3B's 48 layers x top-8, a third more as base64). SGLang's source after 0.5.23
(``python/sglang/srt/state_capturer/routed_experts_wire.py``, sgl-project/sglang#31219) encodes
them in the dtype its ``SGLANG_ROUTED_EXPERTS_DTYPE`` environment names (``int32``, ``uint16`` or
``uint8``; int32 where an id does not fit) and names the dtype it sent in
``meta_info["routed_experts_dtype"]``; an answer without that key is int32. The decoder reads the
dtype the answer names, and the servers are started with the narrowest one that holds the model's
expert ids (``options.py``'s ``routed_experts_wire_dtype``: uint8 up to 256 experts, 384 bytes a
token for the 30B-A3B), which a release without the compact format ignores.

Left out: a server without the flag answers without the field, which is an error naming the server
(never a silent fall-back: the fleet raises it); shared experts fused into the routed ones
(``num_fused_shared_experts``; not in the Qwen3-MoE family).
"""
from __future__ import annotations

import base64
from typing import Optional

import numpy as np
import torch

from megatron_tepo.routing import RoutingShape

__all__ = ["decode_routed_experts", "ROUTING_REQUEST", "WIRE_DTYPES"]

#: what a ``/generate`` payload adds to ask for its routing
ROUTING_REQUEST = {"return_routed_experts": True, "routed_experts_start_len": 0}
#: ``meta_info["routed_experts_dtype"]`` -> the ids' dtype (SGLang's ``_WIRE_DTYPES``); absent: int32
WIRE_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}


def decode_routed_experts(meta: dict, positions: int, shape: RoutingShape, where: str) -> torch.Tensor:
    """``meta_info["routed_experts"]`` as ``[positions, len(moe_layers), topk]`` expert ids, read in
    the dtype ``meta_info["routed_experts_dtype"]`` names (absent: int32), in the contract's dtype
    (:attr:`RoutingShape.dtype`: int8 up to 128 experts, else int16). Missing, of an unknown
    dtype or of another size, or ids out of range: ValueError naming ``where`` (the server)."""
    raw: Optional[str] = meta.get("routed_experts")
    if raw is None:
        raise ValueError(f"{where} returned no routed experts although asked (return_routed_experts): start it "
                         f"with --enable-return-routed-experts (launch.rollout.enable_return_routed_experts)")
    name = meta.get("routed_experts_dtype")
    dtype = WIRE_DTYPES.get(name.strip().lower() if isinstance(name, str) else "int32" if name is None else None)
    if dtype is None:
        raise ValueError(f"{where} returned routed experts in routed_experts_dtype={name!r}, expected one of "
                         f"{sorted(WIRE_DTYPES)} (or none: int32)")
    data = base64.b64decode(raw)
    if len(data) % dtype.itemsize:
        raise ValueError(f"{where} returned {len(data)} bytes of routed experts, not a whole number of "
                         f"{dtype.name} ids (routed_experts_dtype={name!r})")
    ids = np.frombuffer(data, dtype=dtype)
    want = positions * shape.num_layers * shape.topk
    if ids.size != want:
        raise ValueError(f"{where} returned {ids.size} routed-expert ids, expected {positions} positions x "
                         f"{shape.num_layers} layers x top-{shape.topk} = {want}")
    picked = ids.reshape(positions, shape.num_layers, shape.topk)[:, list(shape.moe_layers)]
    if picked.size and (int(picked.min()) < 0 or int(picked.max()) >= shape.num_experts):
        raise ValueError(f"{where} returned expert ids outside [0, {shape.num_experts})")
    return torch.from_numpy(picked.astype(torch.empty(0, dtype=shape.dtype).numpy().dtype))
