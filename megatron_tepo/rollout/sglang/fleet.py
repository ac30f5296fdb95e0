"""The SGLang fleet: a step's requests spread over SGLang servers, behind the
:class:`~megatron_tepo.rollout.engine.RolloutEngine` interface.

Servers are either started here (``FleetConfig.num_servers``, launched as ``server.py`` says:
subprocesses of this one under the SGLang venv's python, each with a random API key -- its own,
or one shared by the servers behind a router -- handed over in the environment, bound to
``ServerConfig.host`` -- loopback by default -- on a free port) or attached to by URL (with their
API key). A step's requests (one per prompt group) are spread over the healthy servers: by
sglang-router where it is installed (``FleetConfig.router``; ``auto``: when the SGLang python
imports ``sglang_router`` and there are two servers or more), a router process started here on
loopback that holds the servers' API key and checks it on every request; least-loaded first
(fewest requests in flight) otherwise. A request that fails (connection refused or reset,
time-out, HTTP 5xx) -- through the router, after the router's own retries on its other workers --
is moved to another server directly; the server it failed on is health-checked and dropped from
the rotation if it does not answer (a dead router is dropped the same way). When no server is
left -- or the step's deadline passes -- :class:`FleetError` names every server and its last
error. Weight updates and cache flushes go to every server directly, never through the router.

Left out: starting, stopping and health of one server, the router's process (``server.py``);
how weights reach the servers (``weight_sync/``; the fleet holds one and calls it).
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_tepo.rollout.engine import (FINISH_LENGTH, FINISH_STOP, Group, RolloutEngine, Sample,
                                          make_params, validate_prompts)
from megatron_tepo.rollout.sglang.server import (ROUTER_POLICIES, FleetError, RequestFailed, ServerConfig,
                                                 SGLangServer, launch_router, launch_server, router_installed,
                                                 stop_server, wait_ready)
from megatron_tepo.rollout.sglang.weight_sync import TensorSync

log = logging.getLogger(__name__)


@dataclass
class FleetConfig:
    """The servers to launch (``num_servers``, started as ``server``) and to attach to (``urls``,
    ``api_keys``), and how requests are spread over them."""
    num_servers: int = 0                 # servers to launch
    urls: Sequence[str] = ()             # servers to attach to
    api_keys: Sequence[Optional[str]] = ()  # one per url (None: no key)
    server: ServerConfig = field(default_factory=ServerConfig)  # how launched servers start
    request_timeout: float = 120.0       # one HTTP request
    step_timeout: float = 600.0          # one generate() call, retries included
    max_attempts: int = 4                # per request, over distinct servers where possible
    health_timeout: float = 5.0
    max_concurrency: int = 64            # requests in flight over the whole fleet
    # sglang-router in front of the servers: "auto" (when the SGLang python imports sglang_router
    # and there are >= 2 servers), "sglang_router" (required), "none" (least-loaded dispatch here)
    router: str = "auto"
    router_policy: str = "cache_aware"   # sglang-router's --policy


def use_router(cfg: FleetConfig, n_servers: int) -> bool:
    """Resolve ``cfg.router`` for a fleet of ``n_servers``; errors name the setting."""
    if cfg.router not in ("auto", "sglang_router", "none"):
        raise ValueError(f"FleetConfig.router: expected auto, sglang_router or none, found {cfg.router!r}")
    if cfg.router_policy not in ROUTER_POLICIES:
        raise ValueError(f"FleetConfig.router_policy: expected one of {ROUTER_POLICIES}, found {cfg.router_policy!r}")
    if cfg.router == "none":
        return False
    if cfg.router == "auto":
        return n_servers >= 2 and router_installed(cfg.server.python)
    if not router_installed(cfg.server.python):
        raise FleetError(f"FleetConfig.router=sglang_router but {cfg.server.python} cannot import sglang_router: "
                         "`bash tools/install_sglang_cpu.sh` installs it (or pip install sglang-router)")
    return True


def parse_generate_output(out: dict) -> Sample:
    meta = out.get("meta_info", {})
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    lps = meta.get("output_token_logprobs") or []
    ids = out.get("output_ids")
    if ids is None:
        ids = [int(t[1]) for t in lps]
    if kind == "abort":
        raise RequestFailed(f"request aborted by the server: {fr}")
    reason = FINISH_STOP if kind == "stop" else FINISH_LENGTH
    return Sample([int(t) for t in ids], [float(t[0]) for t in lps], reason,
                  meta={"matched_stop": fr.get("matched") if isinstance(fr, dict) else None})


class SGLangFleet(RolloutEngine):
    """Servers launched or attached per ``cfg``; ``weight_sync``: what :meth:`update_weights`
    pushes with (a :class:`~megatron_tepo.rollout.sglang.weight_sync.WeightSync` on this fleet;
    None: a ``tensor`` one made at the first update)."""

    def __init__(self, cfg: FleetConfig, weight_sync=None):
        self.cfg = cfg
        self.servers: List[SGLangServer] = []
        self._lock = threading.Lock()
        self.router: Optional[SGLangServer] = None
        keys = list(cfg.api_keys) + [None] * (len(cfg.urls) - len(cfg.api_keys))
        self.servers += [SGLangServer(u, k) for u, k in zip(cfg.urls, keys)]
        routed = use_router(cfg, len(self.servers) + cfg.num_servers)
        if routed and len(set(keys)) > 1:
            if cfg.router == "sglang_router":
                raise ValueError("FleetConfig.api_keys: sglang-router needs one API key for all servers")
            log.warning("SGLang fleet: the attached servers have different API keys; least-loaded "
                        "dispatch instead of sglang-router")
            routed = False
        # servers behind one router share its key (the attached servers' one, or a new one)
        shared_key = (keys[0] if keys else secrets.token_hex(16)) if routed else None
        try:
            launched = [launch_server(cfg.server, i, shared_key) for i in range(cfg.num_servers)]
            self.servers += launched
            wait_ready(self.servers, cfg.server.startup_timeout)
            if not self.servers:
                raise ValueError("FleetConfig names no server: set num_servers or urls")
            if routed:
                self.router = launch_router(cfg.server, self.servers, cfg.router_policy, cfg.request_timeout)
        except BaseException:
            self.close()
            raise
        self.routed = 0  # requests answered through the router
        self.weight_sync = weight_sync

    # ------------------------------------------------------------------ dispatch
    def alive_servers(self) -> List[SGLangServer]:
        return [s for s in self.servers if s.alive]

    def _describe_all(self) -> str:
        out = "; ".join(s.describe() for s in self.servers)
        if self.router is not None:
            out += f"; sglang-router {self.router.describe()}"
        return out

    def _pick(self, exclude: set) -> Optional[SGLangServer]:
        with self._lock:
            cands = [s for s in self.servers if s.alive and s.url not in exclude]
            if not cands:
                cands = [s for s in self.servers if s.alive]  # all tried: reuse a live one
            if not cands:
                return None
            best = min(cands, key=lambda s: (s.inflight, s.served))
            best.inflight += 1
            return best

    def _mark_failed(self, s: SGLangServer, err: RequestFailed) -> None:
        s.last_error = str(err)
        if err.server_dead or not s.healthy(self.cfg.health_timeout):
            if s.alive:
                log.warning("SGLang server %s dropped from the fleet: %s", s.url, err)
            s.alive = False

    def _run_one(self, path: str, payload: dict, deadline: float, parse):
        """Send one request, moving it to another server on failure, until the deadline."""
        tried: set = set()
        errors: List[str] = []
        router = self.router
        if router is not None and router.alive and self.alive_servers():
            try:
                out = router.post(path, payload, timeout=min(self.cfg.request_timeout,
                                                              max(deadline - time.monotonic(), 0.1)))
                result = parse(out)
                with self._lock:
                    self.routed += 1
                return result
            except RequestFailed as e:  # the router retried its other workers already
                errors.append(f"via sglang-router: {e}")
                if not e.retryable:
                    raise FleetError(f"request rejected by sglang-router {router.url}: {e}") from e
                self._mark_failed(router, e)
                # which server failed it? drop the dead ones
                self._drop_unhealthy("no answer to /health",
                                     min(self.cfg.health_timeout, max(deadline - time.monotonic(), 0.5)))
        for attempt in range(self.cfg.max_attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            s = self._pick(tried)
            if s is None:
                break
            tried.add(s.url)
            try:
                out = s.post(path, payload, timeout=min(self.cfg.request_timeout, left))
                result = parse(out)
                s.served += 1
                return result
            except RequestFailed as e:
                errors.append(str(e))
                if not e.retryable:
                    raise FleetError(f"request rejected by {s.url}: {e}") from e
                self._mark_failed(s, e)
            finally:
                with self._lock:
                    s.inflight -= 1
        reason = ("the step time-out passed" if time.monotonic() >= deadline else
                  "no SGLang server is left" if not self.alive_servers() else
                  f"{self.cfg.max_attempts} attempts failed")
        raise FleetError(f"{reason}; attempts: {errors or 'none'}; servers: {self._describe_all()}")

    def _run_all(self, path: str, payloads: List[dict], parse) -> List[Any]:
        deadline = time.monotonic() + self.cfg.step_timeout
        if not self.alive_servers():
            raise FleetError(f"no SGLang server is left; servers: {self._describe_all()}")
        workers = max(1, min(self.cfg.max_concurrency, len(payloads)))
        results: List[Any] = [None] * len(payloads)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sglang-req")
        try:
            futs = {pool.submit(self._run_one, path, p, deadline, parse): i for i, p in enumerate(payloads)}
            pending = set(futs)
            while pending:
                left = deadline - time.monotonic() + 5.0  # requests honour the deadline themselves
                done, pending = wait(pending, timeout=max(left, 0.1), return_when=FIRST_COMPLETED)
                if not done and time.monotonic() > deadline + 5.0:
                    raise FleetError(f"step time-out ({self.cfg.step_timeout:.0f} s) passed with "
                                     f"{len(pending)} requests unanswered; servers: {self._describe_all()}")
                for f in done:
                    results[futs[f]] = f.result()  # raises FleetError of that request
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if self.router is not None:
            # behind the router a dead server goes unnoticed here (the router retries on the
            # others), but the weight sync talks to every live server
            self._drop_unhealthy("no answer to /health after a routed step", self.cfg.health_timeout)
        return results

    def _drop_unhealthy(self, why: str, timeout: float) -> None:
        """Drop from the fleet every live server that does not answer /health within ``timeout``."""
        for s in self.alive_servers():
            if not s.healthy(timeout):
                self._mark_failed(s, RequestFailed(f"{s.url}: {why}", server_dead=True))

    # ------------------------------------------------------------------ RolloutEngine
    def generate(self, prompts: List[List[int]], n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 128,
                 stop_token_ids: Sequence[int] = (), seed: Optional[int] = None) -> List[Group]:
        sp = make_params(n, temperature, top_p, max_new_tokens, stop_token_ids)
        validate_prompts(prompts)
        sampling = {"n": sp.n, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": -1,
                    "max_new_tokens": sp.max_new_tokens, "stop_token_ids": list(sp.stop_token_ids),
                    # SGLang checks stop_token_ids only when ignore_eos is false; then the model's
                    # own EOS id also stops (pass it in stop_token_ids to be explicit)
                    "ignore_eos": not sp.stop_token_ids, "skip_special_tokens": False}
        payloads = []
        for i, p in enumerate(prompts):
            s = dict(sampling)
            if seed is not None:
                s["sampling_seed"] = int(seed) + i
            payloads.append({"input_ids": [int(t) for t in p], "sampling_params": s,
                             "return_logprob": True, "logprob_start_len": -1})

        def parse(out):
            outs = out if isinstance(out, list) else [out]
            if len(outs) != sp.n:
                raise RequestFailed(f"expected {sp.n} samples, got {len(outs)}")
            return [parse_generate_output(o) for o in outs]

        return self._run_all("/generate", payloads, parse)

    def score(self, sequences: List[List[int]], prompt_lens: List[int],
              temperature: float = 1.0) -> List[List[float]]:
        """The server's log-probs of ``seq[prompt_len:]`` (prefill only, no sampling).

        SGLang's input-token log-probs are ``log_softmax(logits)`` (temperature 1) whatever the
        sampling temperature; the log-probs that :meth:`generate` returns are under ``logits / T``.
        """
        if temperature != 1.0:
            raise NotImplementedError("SGLang scores fixed tokens at temperature 1 only")
        payloads = [{"input_ids": [int(t) for t in seq],
                     "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                     "return_logprob": True, "logprob_start_len": int(pl) - 1}
                    for seq, pl in zip(sequences, prompt_lens)]

        def parse(out):
            out = out[0] if isinstance(out, list) else out
            lps = out["meta_info"]["input_token_logprobs"]
            return [float(t[0]) for t in lps[1:]]  # the first is the prompt's last token's own

        return self._run_all("/generate", payloads, parse)

    def broadcast(self, path: str, payload: Optional[dict] = None, timeout: Optional[float] = None) -> List[Any]:
        """POST to every live server (weight updates, cache flushes); a failure is an error."""
        outs = []
        for s in self.alive_servers():
            try:
                outs.append(s.post(path, payload, timeout=timeout or self.cfg.request_timeout))
            except RequestFailed as e:
                self._mark_failed(s, e)
                raise FleetError(f"{path} failed on {s.url}: {e}; servers: {self._describe_all()}") from e
        return outs

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Push the stream to every live server (the fleet's weight sync; ``tensor`` mode unless
        the trainer set another up), servers paused, then one cache flush."""
        if self.weight_sync is None:
            self.weight_sync = TensorSync(self)
        self.weight_sync.push(named_tensors)

    def flush_cache(self) -> None:
        self.broadcast("/flush_cache")

    def close(self) -> None:
        ws, self.weight_sync = getattr(self, "weight_sync", None), None
        if ws is not None and hasattr(ws, "close"):
            ws.close()
        router, self.router = getattr(self, "router", None), None
        if router is not None:
            stop_server(router)
        for s in self.servers:
            stop_server(s)
