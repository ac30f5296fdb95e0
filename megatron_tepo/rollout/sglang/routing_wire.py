"""The routing payload of a ``/generate`` answer read into expert ids, with numpy, json and base64
only (``actor.routing_replay: r3``), so that it runs in the fleet's decoder processes
(``routing.py``'s :class:`~megatron_tepo.rollout.sglang.routing.RoutingDecoder`) without torch.
``python -m megatron_tepo.rollout.sglang.routing_wire`` is one such process (:func:`serve`): it
reads requests on stdin and writes answers on stdout, each a length-prefixed pickle (the answer's
body follows its request's header as raw bytes, never copied into a pickle).

:func:`read_answer` parses an answer's raw body and replaces each ``meta_info["routed_experts"]``
(base64 of ``[positions, num_hidden_layers, topk]`` ids in the wire dtype the answer names, int32
where it names none: ``routing.py`` says what SGLang sends) by the ids of the MoE layers in the
contract's narrow dtype (int8 up to 128 experts, else int16), or by the one-line reason it cannot be
read. :func:`routed_ids` is that decode for one answer's ``meta_info``.

Left out: torch (``routing.py`` turns the ids into a tensor), the request and the servers.
"""
from __future__ import annotations

import base64
import json
import pickle
import sys
from typing import Any, BinaryIO, Optional, Tuple

import numpy as np

__all__ = ["WIRE_DTYPES", "ERROR_KEY", "routed_ids", "read_answer", "serve", "send_frame", "recv_frame"]

#: ``meta_info["routed_experts_dtype"]`` -> the ids' dtype (SGLang's ``_WIRE_DTYPES``); absent: int32
WIRE_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}
#: where :func:`read_answer` puts the reason an answer's routing cannot be read
ERROR_KEY = "routed_experts_error"

#: what the decode needs of the routing contract: (num_layers, moe_layers, topk, num_experts, the ids'
#: numpy dtype string)
Spec = Tuple[int, Tuple[int, ...], int, int, str]


def routed_ids(meta: dict, positions: int, spec: Spec, where: str) -> np.ndarray:
    """``meta["routed_experts"]`` as ``[positions, len(moe_layers), topk]`` ids in ``spec``'s dtype.
    Missing, of an unknown dtype or of another size, or ids out of range: ValueError naming ``where``."""
    num_layers, moe_layers, topk, num_experts, ids_dtype = spec
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
    want = positions * num_layers * topk
    if ids.size != want:
        raise ValueError(f"{where} returned {ids.size} routed-expert ids, expected {positions} positions x "
                         f"{num_layers} layers x top-{topk} = {want}")
    ids = ids.reshape(positions, num_layers, topk)
    picked = ids if tuple(moe_layers) == tuple(range(num_layers)) else ids[:, list(moe_layers)]
    if picked.size and (int(picked.min()) < 0 or int(picked.max()) >= num_experts):
        raise ValueError(f"{where} returned expert ids outside [0, {num_experts})")
    return picked.astype(np.dtype(ids_dtype))


def read_answer(body: bytes, spec: Spec, where: str) -> Any:
    """A ``/generate`` answer's body (one answer or a list) parsed, each answer's
    ``meta_info["routed_experts"]`` replaced by :func:`routed_ids` over its positions (prompt +
    output - 1), or by None with the reason under :data:`ERROR_KEY`. An aborted answer is left as it
    came (the caller refuses it or keeps its tokens without routing)."""
    out = json.loads(body)
    for one in out if isinstance(out, list) else [out]:
        meta = one.get("meta_info") if isinstance(one, dict) else None
        if not isinstance(meta, dict):
            continue
        fr = meta.get("finish_reason") or {}
        if (fr.get("type") if isinstance(fr, dict) else str(fr)) == "abort":
            continue
        ids = one.get("output_ids")
        if ids is None:
            ids = meta.get("output_token_logprobs") or []
        try:
            meta["routed_experts"] = routed_ids(meta, int(meta.get("prompt_tokens", 0)) + len(ids) - 1, spec, where)
        except (ValueError, TypeError) as exc:
            meta["routed_experts"], meta[ERROR_KEY] = None, str(exc)
    return out


def send_frame(out: BinaryIO, obj: Any, raw: bytes = b"") -> None:
    """``obj`` pickled behind its 8-byte length, then ``raw`` as it is (its length is the reader's to know)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(len(data).to_bytes(8, "little"))
    out.write(data)
    if raw:
        out.write(raw)
    out.flush()


def recv_frame(inp: BinaryIO) -> Any:
    """The object :func:`send_frame` wrote; EOFError when the stream ends (or ends short)."""
    head = inp.read(8)
    if len(head) < 8:
        raise EOFError("the stream ended")
    n = int.from_bytes(head, "little")
    data = inp.read(n)
    if len(data) < n:
        raise EOFError("the stream ended inside a frame")
    return pickle.loads(data)


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """A decoder process: for each request ``(spec, where, size)`` followed by ``size`` bytes of an
    answer's body, the frame ``(True, read_answer(...))``, or ``(False, reason)`` when the body
    cannot be read; until ``inp`` ends."""
    while True:
        try:
            spec, where, size = recv_frame(inp)
        except EOFError:
            return
        body = inp.read(size)
        if len(body) < size:
            return
        try:
            result = (True, read_answer(body, spec, where))
        except Exception as exc:  # noqa: BLE001 -- handed back to the request thread
            result = (False, f"{type(exc).__name__}: {exc}")
        send_frame(out, result)


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
