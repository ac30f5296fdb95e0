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

Where it is decoded: in the fleet's decoder processes (:class:`RoutingDecoder`,
``FleetConfig.routing_decoders``, 4 by default: plain subprocesses fed through pipes), not on the
request threads. A released SGLang sends int32, and ``json.loads`` of an answer and its base64
decode hold the GIL: on the request threads they took that time from the driver's other threads
(the monitor, the other requests, and in one-step-off generation the train step's launches). A
request whose routing is asked for reads its answer's raw bytes; a decoder process parses them,
decodes the routing, narrows it to the contract's dtype (``routing_wire.py``: numpy only, no torch
to import) and hands back the answer with the ids, a quarter of the int32 bytes (docs/BENCHMARKS.md,
"MoE routing on the wire"). The project does not control the wire format of the released servers:
what it controls is where the decode runs.

Left out: a server without the flag answers without the field, which is an error naming the server
(never a silent fall-back: the fleet raises it); shared experts fused into the routed ones
(``num_fused_shared_experts``; not in the Qwen3-MoE family).
"""
from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, List, Optional

import numpy as np
import torch

from megatron_tepo.rollout.sglang.routing_wire import (ERROR_KEY, WIRE_DTYPES, Spec, read_answer, recv_frame,
                                                        routed_ids, send_frame)
from megatron_tepo.routing import RoutingShape

__all__ = ["decode_routed_experts", "routed_experts_of", "ROUTING_REQUEST", "WIRE_DTYPES", "RoutingDecoder"]

log = logging.getLogger(__name__)

#: a fleet's decoder processes that may die before every answer is read on its request thread
MAX_DECODER_DEATHS = 3
#: what a ``/generate`` payload adds to ask for its routing
ROUTING_REQUEST = {"return_routed_experts": True, "routed_experts_start_len": 0}


def spec_of(shape: RoutingShape) -> Spec:
    """What :mod:`.routing_wire` needs of the routing contract (plain values: a decoder process gets them)."""
    return (shape.num_layers, tuple(shape.moe_layers), shape.topk, shape.num_experts,
            torch.empty(0, dtype=shape.dtype).numpy().dtype.str)


def decode_routed_experts(meta: dict, positions: int, shape: RoutingShape, where: str) -> torch.Tensor:
    """``meta_info["routed_experts"]`` as ``[positions, len(moe_layers), topk]`` expert ids, read in
    the dtype ``meta_info["routed_experts_dtype"]`` names (absent: int32), in the contract's dtype
    (:attr:`RoutingShape.dtype`: int8 up to 128 experts, else int16). Missing, of an unknown
    dtype or of another size, or ids out of range: ValueError naming ``where`` (the server)."""
    return torch.from_numpy(routed_ids(meta, positions, spec_of(shape), where))


def routed_experts_of(meta: dict, positions: int, shape: RoutingShape, where: str) -> torch.Tensor:
    """An answer's routing: decoded already (:meth:`RoutingDecoder.read`: an array, or the reason it
    could not be, a ValueError), else decoded here (:func:`decode_routed_experts`)."""
    if ERROR_KEY in meta:
        raise ValueError(meta[ERROR_KEY])
    raw = meta.get("routed_experts")
    if isinstance(raw, np.ndarray):
        return torch.from_numpy(raw)
    return decode_routed_experts(meta, positions, shape, where)


class RoutingDecoder:
    """``workers`` decoder processes (``python -m megatron_tepo.rollout.sglang.routing_wire``, started
    at the first :meth:`read`: plain subprocesses, so nothing of the driver's ``__main__`` is run
    again) that read routed answers' raw bodies; 0 workers: read on the calling thread. A process
    that dies is said once and replaced, the answer in hand read on its thread; after
    :data:`MAX_DECODER_DEATHS` deaths every answer is read on its thread (said once)."""

    def __init__(self, shape: RoutingShape, workers: int):
        if workers < 0:
            raise ValueError(f"FleetConfig.routing_decoders must be >= 0, got {workers}")
        self.spec, self.workers = spec_of(shape), workers
        self._idle: "queue.Queue[subprocess.Popen]" = queue.Queue()
        self._procs: List[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        self.deaths = 0

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[3])  # (the folder that holds megatron_tepo)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        return subprocess.Popen([sys.executable, "-m", "megatron_tepo.rollout.sglang.routing_wire"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def _take(self) -> Optional[subprocess.Popen]:
        """An idle decoder process, a new one while fewer than ``workers`` run, else the next that
        frees; None when there are none to be had (closed, given up, or 0 workers)."""
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if self._closed or self.deaths >= MAX_DECODER_DEATHS or not self.workers:
                    return None
                if len(self._procs) < self.workers:
                    proc = self._start()
                    self._procs.append(proc)
                    return proc
            try:  # (all busy: the next that frees; a look again meanwhile, in case one died)
                return self._idle.get(timeout=0.5)
            except queue.Empty:
                continue

    def read(self, body: bytes, where: str) -> Any:
        """The answer ``body`` parsed, its routing decoded (``routing_wire.read_answer``); a body that
        is not JSON: ValueError."""
        proc = self._take()
        if proc is None:
            return read_answer(body, self.spec, where)
        try:
            send_frame(proc.stdin, (self.spec, where, len(body)), body)
            ok, value = recv_frame(proc.stdout)
        except (OSError, EOFError, ValueError) as exc:
            self._died(proc, exc)
            return read_answer(body, self.spec, where)
        self._idle.put(proc)
        if not ok:
            raise ValueError(value)
        return value

    def _died(self, proc: subprocess.Popen, exc: BaseException) -> None:
        with self._lock:
            if proc in self._procs:
                self._procs.remove(proc)
            self.deaths += 1
            given_up = self.deaths >= MAX_DECODER_DEATHS
        proc.kill()
        proc.wait()
        log.warning("r3: a routing decoder process ended (%s: %s, exit %s): %s", type(exc).__name__, exc,
                    proc.returncode, "the answers are read on the request threads from now on" if given_up
                    else "this answer is read on its request thread, and a new process starts for the next")

    def close(self) -> None:
        with self._lock:
            procs, self._procs, self._closed = self._procs, [], True
        for proc in procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
