"""One SGLang server as an HTTP endpoint (launched here or attached by URL): :class:`SGLangServer`,
its address, API key and (if launched here) process, its HTTP calls, ``/health`` and the generation
probe, its TP size, its running-request slots (:func:`running_slots`) and its health state
(``health.py``); the fleet also keeps its load on it, and (colocated mode) what memory it has
released. The errors of a call (:class:`RequestFailed`) and of
the fleet (:class:`FleetError`).

Left out: how the process is started and stopped (``server.py``), spreading requests over several
servers and retrying them (``dispatch.py``, a part of the fleet).
"""
from __future__ import annotations

import subprocess
from typing import Any, Dict, FrozenSet, Iterable, Optional, Tuple

import requests

from megatron_tepo.rollout.sglang.health import ServerHealth, State


class FleetError(RuntimeError):
    """No server could answer (all dead, or the deadline passed), or one could not start."""


class RequestFailed(Exception):
    """``status``: the HTTP status when the server answered one (404: it has no such route)."""

    def __init__(self, msg: str, server_dead: bool = False, retryable: bool = True,
                 status: Optional[int] = None):
        super().__init__(msg)
        self.server_dead, self.retryable, self.status = server_dead, retryable, status


def running_slots(info: dict) -> Optional[int]:
    """How many requests a server runs at once, from its ``/server_info``: the sum of its DP ranks'
    ``effective_max_running_requests_per_dp`` (SGLang 0.5.23's ``internal_states``: what the
    scheduler computed when the flag was not given), else its ``max_running_requests`` argument
    (``--max-running-requests``: the launch's setting), else None (not reported)."""
    states = [st for st in info.get("internal_states") or () if isinstance(st, dict)]
    effective = [st.get("effective_max_running_requests_per_dp") for st in states]
    if effective and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in effective):
        return sum(effective)
    given = info.get("max_running_requests")
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return given
    return None


class SGLangServer:
    """One server: its URL, key, (if launched here) its process, its load, and its TP size.

    ``tp_size``: the server's tensor-parallel size (how many TP workers join a weight-update
    group), known when it was launched here (``ServerConfig.tp``); ``None`` for an attached
    server until :meth:`resolve_tp_size` asks the server (``/server_info``)."""

    def __init__(self, url: str, api_key: Optional[str] = None, proc: Optional[subprocess.Popen] = None,
                 log_path: Optional[str] = None, tp_size: Optional[int] = None):
        self.url, self.api_key, self.proc, self.log_path = url.rstrip("/"), api_key, proc, log_path
        self.tp_size = tp_size
        self.slots: Optional[int] = None  # requests it runs at once (running_slots; None: not asked yet)
        self.inflight = 0
        self.health = ServerHealth()
        self.last_error: Optional[str] = None
        self.served = 0  # requests answered (by every incarnation)
        # colocated mode, of one incarnation: the memory tags it released, and whether its weights
        # were taken back (their content garbage) and await a weight sync. A new incarnation (a
        # restarted or returned process) holds all its memory and its start-up weights.
        self._memory: Tuple[int, FrozenSet[str], bool] = (0, frozenset(), False)

    @property
    def alive(self) -> bool:
        """Reachable: healthy, suspect, or stale (a weight sync goes to it); not dead, not restarting."""
        return self.health.reachable

    @property
    def state(self) -> State:
        return self.health.state

    @property
    def incarnation(self) -> int:
        """+1 every time the server comes back (a new process: a new weight-update group)."""
        return self.health.incarnation

    @property
    def released(self) -> FrozenSet[str]:
        """The memory tags this process has released (colocated mode; empty: it holds everything)."""
        incarnation, tags, _ = self._memory
        return tags if incarnation == self.incarnation else frozenset()

    @property
    def awaits_weights(self) -> bool:
        """Its weights' memory was taken back and no weight sync has reached it since: it holds
        garbage and must serve nothing."""
        incarnation, _, owed = self._memory
        return owed and incarnation == self.incarnation

    @property
    def memory_ready(self) -> bool:
        """Holds all its memory and valid weights (what serving needs beyond being healthy)."""
        return not self.released and not self.awaits_weights

    def set_memory(self, released: Iterable[str], awaits_weights: bool) -> None:
        """Record the memory state of the current incarnation."""
        self._memory = (self.incarnation, frozenset(released), bool(awaits_weights))

    def replace_process(self, url: str, proc: subprocess.Popen, log_path: Optional[str]) -> None:
        """A restart: the new process's address and log (the key and TP size stay)."""
        self.url, self.proc, self.log_path = url.rstrip("/"), proc, log_path
        self.inflight = 0

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, payload: Optional[dict] = None, timeout: float = 60.0, raw: bool = False) -> Any:
        """The answer's JSON; ``raw``: its body's bytes, unparsed (a routed answer: ``routing.py``)."""
        return self._request("post", path, timeout, raw, json=payload if payload is not None else {})

    def get(self, path: str, timeout: float = 60.0) -> Any:
        return self._request("get", path, timeout)

    def _request(self, method: str, path: str, timeout: float, raw: bool = False, **kw) -> Any:
        try:
            r = requests.request(method, self.url + path, headers=self.headers(), timeout=timeout, **kw)
        except requests.Timeout as e:
            raise RequestFailed(f"{self.url}{path}: timed out after {timeout:.0f} s") from e
        except requests.ConnectionError as e:
            raise RequestFailed(f"{self.url}{path}: connection failed ({type(e).__name__})",
                                server_dead=True) from e
        return self._answer(path, r, raw)

    def _answer(self, path: str, r, raw: bool = False) -> Any:
        if r.status_code >= 500:
            raise RequestFailed(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}", status=r.status_code)
        if r.status_code >= 400:
            raise RequestFailed(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}", retryable=False,
                                status=r.status_code)
        if raw:
            return r.content
        try:
            return r.json()
        except ValueError:
            return r.text

    def server_info(self, timeout: float = 60.0) -> dict:
        """The server's ``/server_info`` (``/get_server_info`` on an SGLang without it)."""
        try:
            out = self.get("/server_info", timeout=timeout)
        except RequestFailed as e:
            if e.status != 404:
                raise
            out = self.get("/get_server_info", timeout=timeout)
        if not isinstance(out, dict):
            raise RequestFailed(f"{self.url}/server_info: expected a JSON object, got {str(out)[:200]!r}",
                                retryable=False)
        return out

    def resolve_tp_size(self, timeout: float = 60.0) -> int:
        """The server's TP size: the known one, else asked of the server once (its
        ``/server_info`` reports ``tp_size``). A missing or bad value is an error naming the field."""
        if self.tp_size is None:
            info = self.server_info(timeout)
            if "tp_size" not in info:
                raise ValueError(f"SGLang server {self.url}: /server_info reports no tp_size "
                                 f"(keys: {sorted(info)[:20]})")
            self.tp_size = info["tp_size"]
        tp = self.tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"SGLang server {self.url}: tp_size must be an integer >= 1, got {tp!r}")
        return tp

    def exited(self) -> bool:
        """A process launched here that is gone (False for an attached server)."""
        return self.proc is not None and self.proc.poll() is not None

    def healthy(self, timeout: float = 5.0) -> bool:
        """``/health`` answers 200 (the HTTP server is up; it says nothing of the scheduler)."""
        if self.exited():
            return False
        try:
            r = requests.get(self.url + "/health", headers=self.headers(), timeout=timeout)
            return r.status_code == 200
        except requests.RequestException:
            return False

    def answers(self, timeout: float = 5.0) -> bool:
        """Its HTTP server answers a request that generates nothing (``/model_info``, or
        ``/get_model_info`` on versions without it: the tokenizer manager's own state): a liveness
        check safe on a server whose memory is released, where SGLang's ``/health`` would run a
        one-token generation (0.5.23, unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false)."""
        if self.exited():
            return False
        try:
            for route in self._liveness_routes:
                r = requests.get(self.url + route, headers=self.headers(), timeout=timeout)
                if r.status_code != 404:
                    self._liveness_routes = (route,)  # (the version's: asked first from now on)
                    return r.status_code == 200
        except requests.RequestException:
            return False
        return False

    _liveness_routes: Tuple[str, ...] = ("/model_info", "/get_model_info")

    def probe(self, timeout: float) -> Tuple[bool, str]:
        """A real generation within ``timeout``: SGLang's ``/health_generate`` (it runs a
        one-token generation, or sees the scheduler answer what it already runs), or, on a
        server without that route, a one-token ``/generate``. A port that accepts connections
        proves nothing: a frozen scheduler answers ``/health`` but not this. Returns (ok, why)."""
        if self.exited():
            return False, f"process exited with code {self.proc.returncode}"
        try:
            r = requests.get(self.url + "/health_generate", headers=self.headers(), timeout=timeout)
            if r.status_code == 404:
                r = requests.post(self.url + "/generate", headers=self.headers(), timeout=timeout,
                                  json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        except requests.Timeout:
            return False, f"no answer to a one-token generation within {timeout:.0f} s"
        except requests.RequestException as e:
            return False, f"probe failed: {type(e).__name__}"
        if r.status_code != 200:
            return False, f"probe answered HTTP {r.status_code}"
        return True, ""

    def describe(self) -> str:
        pid = f" pid={self.pid}" if self.pid else ""
        err = f" last error: {self.last_error}" if self.last_error else ""
        memory = "".join([f", released {','.join(sorted(self.released))}" if self.released else "",
                          ", awaits its weights" if self.awaits_weights else ""])
        return f"{self.url}{pid} [{self.health.state.value}{memory}, served {self.served}]{err}"

    def __repr__(self):
        return f"SGLangServer({self.describe()})"
