"""A fake SGLang HTTP server for the weight sync's unit tests: it answers the routes the sync uses
with success, reports a TP size, an SGLang version (0.5.23 unless told) and, if told, a
running-request limit and more server arguments on ``/server_info`` and ``/get_server_info``
(as 0.5.23 does: ``max_running_requests`` and ``internal_states``), can hold every ``/generate``
until an event is set (``hold``), can lack routes
(HTTP 404, as an SGLang version without them answers), can take its time over a bucket, and
records every request (path, JSON body, start and end time) and the most ``/generate`` sequences
it held at once (``max_sequences``: n a request); it answers ``/generate`` with two
fixed tokens (n of them: a list) and can be frozen (``freeze``: generation and its probe hang while ``/health`` still
answers, as a SIGSTOP-ed scheduler behind a live HTTP server; ``restart`` brings it back as a new
process would, holding all its memory); it keeps the memory it has released and every request that
generates while any is (``generated_while_released``); ``inspect(path, body, when)`` is
called as a request starts (``when="start"``, before its delay) and before it is answered
(``"end"``). It loads nothing: what a real
server does with the bytes is tested against real servers (test_sglang_fleet.py,
test_sglang_tp2_sync.py)."""
from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Iterable, List, Optional


#: the routes on which SGLang 0.5.23 runs a generation: ``/health`` too, unless the server runs with
#: SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false (``srt/entrypoints/http_server.py``); on a server
#: whose KV cache is released that kills its scheduler
GENERATING = frozenset({"/generate", "/health_generate", "/health"})


def routed_experts_ids(positions: int, num_layers: int, topk: int, num_experts: int):
    """The expert ids a fake server routes to: ``[positions, num_layers, topk]`` int32, a function of
    the position, the layer and the slot."""
    import numpy as np

    p, layer, k = np.meshgrid(np.arange(positions), np.arange(num_layers), np.arange(topk), indexing="ij")
    return ((3 * p + 5 * layer + k) % num_experts).astype(np.int32)


def routed_experts_b64(positions: int, num_layers: int, topk: int, num_experts: int,
                       wire_dtype: Optional[str] = None) -> str:
    """As SGLang 0.5.23's tokenizer manager writes ``meta_info["routed_experts"]``:
    ``pybase64.b64encode(tensor.numpy().tobytes())`` of the int32 ids; with ``wire_dtype`` (uint8,
    uint16, int32) as SGLang's source after 0.5.23 writes it (``srt/state_capturer/
    routed_experts_wire.py``'s ``encode_routed_experts_for_wire``: the ids cast to that dtype, the
    server sending ``meta_info["routed_experts_dtype"] = wire_dtype`` beside them)."""
    import base64

    ids = routed_experts_ids(positions, num_layers, topk, num_experts)
    return base64.b64encode(ids.astype(wire_dtype or "int32").tobytes()).decode("utf-8")


class _QuietServer(ThreadingHTTPServer):
    request_queue_size = 512  # (a fleet's partial rollout opens hundreds of connections at once)

    def handle_error(self, request, client_address):  # a client that gave up on a frozen server
        if not isinstance(sys.exc_info()[1], (ConnectionError, BrokenPipeError)):
            super().handle_error(request, client_address)


class FakeSGLang:
    def __init__(self, tp_size: int = 1, missing: Iterable[str] = (), delays: Optional[Dict[str, float]] = None,
                 port: int = 0, inspect: Optional[Callable[[str, Optional[dict], str], None]] = None,
                 routing: Optional[tuple] = None, wire_dtype: Optional[str] = None, version: str = "0.5.23",
                 slots: Optional[int] = None, info: Optional[dict] = None, hold: Optional[threading.Event] = None):
        self.tp_size, self.missing, self.delays, self.inspect = tp_size, set(missing), dict(delays or {}), inspect
        # (num_layers, topk, num_experts): a server started with --enable-return-routed-experts, which answers a
        # request asking for them with SGLang 0.5.23's meta_info["routed_experts"] (routed_experts_b64), or with
        # wire_dtype as the compact format of SGLang's newer source writes it
        self.routing, self.wire_dtype = routing, wire_dtype
        # /server_info: the version, the running-request limit (slots: as 0.5.23 reports it), and more arguments
        self.info = {"version": version, "enable_return_routed_experts": routing is not None, **(info or {})}
        if slots is not None:
            self.info.update(max_running_requests=slots,
                             internal_states=[{"effective_max_running_requests_per_dp": slots}])
        self.hold = hold  # set: /generate answers; clear: it waits (a server whose batch is busy)
        self.requests: List[dict] = []  # {"method", "path", "body", "start", "end"}
        # freeze(): /generate and /health_generate hang until thaw() (a SIGSTOP-ed scheduler)
        self.frozen, self.thawed = threading.Event(), threading.Event()
        # the memory it holds released (``/release_memory_occupation`` tags until their resume), and every
        # request that generates (GENERATING) that arrived while any of it was released
        self.released: set = set()
        self.generated_while_released: List[tuple] = []
        self.inflight: Dict[str, int] = {}
        self.max_inflight: Dict[str, int] = {}
        # /generate's sequences (sampling_params.n each) in flight, and the most at once: what a real
        # server runs up to its slots and queues beyond them
        self.sequences, self.max_sequences = 0, 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _answer(self, method: str):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                path = self.path.split("?")[0]
                rec = {"method": method, "path": path, "body": body, "start": time.monotonic(), "end": None}
                with fake._lock:
                    fake.requests.append(rec)
                    if path in GENERATING and fake.released and not fake.frozen.is_set():  # (frozen: never runs)
                        fake.generated_while_released.append((path, tuple(sorted(fake.released))))
                    if path == "/release_memory_occupation":
                        fake.released |= set((body or {}).get("tags") or ())
                    elif path == "/resume_memory_occupation":
                        fake.released -= set((body or {}).get("tags") or ())
                    fake.inflight[path] = fake.inflight.get(path, 0) + 1
                    fake.max_inflight[path] = max(fake.max_inflight.get(path, 0), fake.inflight[path])
                    seqs = int(((body or {}).get("sampling_params") or {}).get("n", 1)) if path == "/generate" else 0
                    fake.sequences += seqs
                    fake.max_sequences = max(fake.max_sequences, fake.sequences)
                try:
                    if fake.inspect is not None:
                        fake.inspect(path, body, "start")
                    if path in fake.missing:
                        status, out = 404, {"detail": "Not Found"}
                    elif method == "GET" and path in ("/server_info", "/get_server_info"):
                        status, out = 200, {"tp_size": fake.tp_size, "dp_size": 1, **fake.info}
                    elif method == "GET" and path == "/health":
                        status, out = 200, {}
                    elif fake.frozen.is_set() and path in ("/generate", "/health_generate"):
                        fake.thawed.wait()  # a frozen scheduler: HTTP still accepts, nothing answers
                        status, out = 503, {}
                    elif path == "/health_generate":
                        status, out = 200, {}
                    elif path == "/generate":
                        time.sleep(fake.delays.get(path, 0.0))
                        if fake.hold is not None:
                            fake.hold.wait()
                        status, out = 200, {"output_ids": [7, 8], "meta_info": {
                            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
                            "finish_reason": {"type": "length", "length": 2},
                            "prompt_tokens": len((body or {}).get("input_ids") or ())}}
                        if fake.routing is not None and (body or {}).get("return_routed_experts"):
                            out["meta_info"]["routed_experts"] = routed_experts_b64(
                                out["meta_info"]["prompt_tokens"] + 2 - 1, *fake.routing, wire_dtype=fake.wire_dtype)
                            if fake.wire_dtype is not None:
                                out["meta_info"]["routed_experts_dtype"] = fake.wire_dtype
                        if seqs > 1:  # (n samples: SGLang answers a list of n)
                            out = [json.loads(json.dumps(out)) for _ in range(seqs)]
                    else:
                        time.sleep(fake.delays.get(path, 0.0))
                        status, out = 200, {"success": True, "message": "ok"}
                    if fake.inspect is not None:
                        fake.inspect(path, body, "end")
                finally:
                    with fake._lock:
                        fake.inflight[path] -= 1
                        fake.sequences -= seqs
                        rec["end"] = time.monotonic()
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

        self.httpd = _QuietServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def freeze(self) -> None:
        self.thawed.clear()
        self.frozen.set()

    def thaw(self) -> None:
        self.frozen.clear()
        self.thawed.set()

    def restart(self) -> None:
        """Its job started it again: a new process, holding all its memory, answering."""
        with self._lock:
            self.released = set()
        self.thaw()

    def paths(self, method: Optional[str] = None) -> List[str]:
        return [r["path"] for r in self.requests if method is None or r["method"] == method]

    def bodies(self, path: str) -> List[dict]:
        return [r["body"] for r in self.requests if r["path"] == path]

    def close(self) -> None:
        self.thaw()
        if self.hold is not None:
            self.hold.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeFleet:
    """What :class:`~megatron_tepo.rollout.sglang.weight_sync.WeightSync` needs of a fleet."""

    def __init__(self, servers):
        self.servers = list(servers)

    def alive_servers(self):
        return self.servers
