"""The fleet's dispatch (:class:`Dispatch`, a part of
:class:`~megatron_tepo.rollout.sglang.fleet.SGLangFleet`): a call's requests spread over the
servers, through sglang-router or to a server picked here, retried elsewhere on failure, within
the call's time limit; and one ``/generate`` answer read as a sample (:func:`parse_generate_output`).

The server lists: *alive* (a weight sync goes to it), *healthy* (the router stands in front of
them), *serving* (takes requests: healthy, and in colocated mode holding all its memory and valid
weights). A request goes through the router when the fleet has one (``FleetConfig.router``:
``fleet.py`` decides at start-up), it stands in front of exactly the healthy servers and every one
of them serves; otherwise, and after the router has failed it, to the least-loaded serving server
with a free running-request slot (the fewest requests in flight for its slots: :meth:`Dispatch._pick`,
the one place that chooses a server, with a session's affinity to its last server). A request is one
sequence; a call keeps as many in flight as the servers' slots summed, and a request that finds no
free slot waits here, in the fleet, before its own time limit starts: no server is sent more than
it runs, so none queues a request whose clock runs (#56 row 3). A request that fails
(connection refused or reset, time-out, HTTP 5xx) -- through the router, after the router's own
retries on its other workers -- is moved to another server directly, its server reported to
supervision (``supervision.py``: suspect, probed, or dead); a request to a server declared dead
meanwhile gives up at once (:meth:`Dispatch._post_watched`). When no server is left -- or the
call's deadline passes -- :class:`FleetError` names every server and its last error. A call's time
limit (:meth:`Dispatch.call_timeout`): ``FleetConfig.step_timeout``, else its waves of sequences on
the fleet's running-request slots (:meth:`Dispatch.slots`, each server's ``/server_info``, read
once) x ``request_timeout``. Weight updates and cache flushes go to every server directly
(:meth:`Dispatch.broadcast`), never through the router; after a weight sync the router is rebuilt
over the healthy set when that set changed (:meth:`Dispatch._follow_healthy`).

Owns: ``router``, ``_router_members``, ``_routed`` (the fleet has a router), ``routed`` (requests
answered through it), ``_sessions`` (a submitted request's key or a generated group -> its last
server) and ``_slot_free`` (a condition on ``_lock``: a request left a server). Uses, beside the
fleet's ``cfg``, ``servers`` and ``_lock``: ``_probe``, ``_mark_failed``, ``_drop_unreachable`` and
``_step_running`` (``supervision.py``), ``partial_inflight`` (``interruptible.py``: the requests in
flight over the fleet).

Left out: the router's process (``router.py``) and the decision to have one (``fleet.py``'s
``use_router``); where the router places a request (its policy: the fleet bounds only the requests
in flight over all its servers); one server's HTTP calls (``client.py``); what a request carries (the fleet's
``generate`` / ``score``, ``interruptible.py``'s ``submit``), except the served LoRA adapter
(``lora_name``: ``actor.lora.sync: adapters``), which :meth:`Dispatch._run_one` adds to every
``/generate`` as ``lora_path`` when it sends it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_tepo.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Sample
from megatron_tepo.rollout.sglang.client import FleetError, RequestFailed, SGLangServer, running_slots
from megatron_tepo.rollout.sglang.health import State
from megatron_tepo.rollout.sglang.router import launch_router
from megatron_tepo.rollout.sglang.routing import routed_experts_of
from megatron_tepo.rollout.sglang.server import stop_server
from megatron_tepo.routing import RoutingShape
from megatron_tepo.time_limits import waves

log = logging.getLogger(__name__)

#: the submitted requests' sessions remembered (their server, for the next turn's prefix cache)
MAX_SESSIONS = 1 << 16


def parse_generate_output(out: dict, routing: Optional[RoutingShape] = None, where: str = "the server",
                          partial: bool = False) -> Sample:
    """One ``/generate`` answer as a :class:`Sample`; with ``routing`` (the request asked for it) its
    routed experts too (decoded already by the fleet's decoder processes, or here), their absence a
    non-retryable failure naming ``where``. An aborted answer
    is a failure, or with ``partial`` (the fleet aborted it: an interrupt) the response so far,
    ``FINISH_ABORT``: SGLang answers an abort with every token generated and its log-prob, and
    without its routing (none is read: such a sample carries none)."""
    meta = out.get("meta_info", {})
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    lps = meta.get("output_token_logprobs") or []
    ids = out.get("output_ids")
    if ids is None:
        ids = [int(t[1]) for t in lps]
    if kind == "abort" and not partial:
        raise RequestFailed(f"request aborted by the server: {fr}")
    reason = FINISH_ABORT if kind == "abort" else FINISH_STOP if kind == "stop" else FINISH_LENGTH
    if len(lps) != len(ids):
        raise RequestFailed(f"{where} returned {len(ids)} tokens but {len(lps)} log-probs")
    routed = None
    if routing is not None and kind != "abort":
        try:
            routed = routed_experts_of(meta, int(meta.get("prompt_tokens", 0)) + len(ids) - 1, routing, where)
        except ValueError as exc:
            raise RequestFailed(str(exc), retryable=False) from None
    return Sample([int(t) for t in ids], [float(t[0]) for t in lps], reason,
                  meta={"matched_stop": fr.get("matched") if isinstance(fr, dict) else None}, routed_experts=routed)


def with_adapter(path: str, payload: dict, lora_name) -> dict:
    """``payload`` naming the served LoRA adapter ``lora_name`` (``lora_path``) when it is a
    ``/generate`` and there is one (``actor.lora.sync: adapters``); else ``payload`` itself."""
    if path == "/generate" and lora_name:
        return {**payload, "lora_path": lora_name}
    return payload


class Dispatch:
    """The fleet's part that sends requests (see the module docstring for what it owns)."""

    def _init_dispatch(self, routed: bool, keys: Sequence[Optional[str]]) -> None:
        """``routed``: ``FleetConfig.router`` resolved (``use_router``); ``keys``: the attached
        servers' API keys (sglang-router needs one for all)."""
        self.router: Optional[SGLangServer] = None
        self._router_members: Tuple[Tuple[str, int], ...] = ()
        self.routed = 0  # requests answered through the router
        self._sessions: "OrderedDict[object, SGLangServer]" = OrderedDict()  # request key -> its last server
        self._slot_free = threading.Condition(self._lock)  # notified when a request leaves a server
        self._routed = routed
        if self._routed and len(set(keys)) > 1:
            if self.cfg.router == "sglang_router":
                raise ValueError("FleetConfig.api_keys: sglang-router needs one API key for all servers")
            log.warning("SGLang fleet: the attached servers have different API keys; least-loaded "
                        "dispatch instead of sglang-router")
            self._routed = False

    # ------------------------------------------------------------------ the server lists
    def alive_servers(self) -> List[SGLangServer]:
        """The servers a weight sync goes to: healthy, suspect and stale ones."""
        return [s for s in self.servers if s.alive]

    def healthy_servers(self) -> List[SGLangServer]:
        """The healthy servers (what the router stands in front of)."""
        return [s for s in self.servers if s.health.serving]

    def serving_servers(self) -> List[SGLangServer]:
        """The servers that take requests: the healthy ones that hold all their memory and valid
        weights (colocated mode: none between a release and the resume of the KV cache, nor from
        a resume of the weights until a weight sync reached it)."""
        return [s for s in self.servers if s.health.serving and s.memory_ready]

    def _describe_all(self) -> str:
        out = "; ".join(s.describe() for s in self.servers)
        if self.router is not None:
            out += f"; sglang-router {self.router.describe()}"
        return out

    # ------------------------------------------------------------------ one request
    def _pick(self, exclude: set, session=None, deadline: Optional[float] = None) -> Optional[SGLangServer]:
        """The server a request (one sequence) goes to when it does not go through the router: among
        the serving ones not in ``exclude`` (tried already; all tried: any), one with a free
        running-request slot (:meth:`_capacity`), the least loaded, i.e. the fewest requests in
        flight per slot, then the fewest served. When none has a free slot, the request waits here,
        in the fleet, until one has (or ``deadline`` passes: None), so that no server holds more than
        it runs and no request's own time limit runs while it queues. The one place that picks a
        server. ``session`` (a submitted request's key: every turn of a multi-turn episode has the
        same one; a generated group's sequences share one): the server its last request went to,
        while it serves and has a free slot, so that its prefix cache serves the prefill (what
        sglang-router's cache-aware policy does for routed requests)."""
        with self._slot_free:
            while True:
                serving = self.serving_servers()
                if not serving:
                    return None
                pool = [s for s in serving if s.url not in exclude] or serving  # all tried: reuse a live one
                cands = [s for s in pool if s.inflight < self._capacity(s)]
                if cands:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                # (woken by a request that ends; a server that comes back is seen at the next look)
                self._slot_free.wait(timeout=0.5 if left is None else min(0.5, left))
            held = self._sessions.get(session) if session is not None else None
            if held is not None and held in cands:
                best = held
            else:
                best = min(cands, key=lambda s: (s.inflight / self._capacity(s), s.served))
            if session is not None:
                self._sessions[session] = best
                self._sessions.move_to_end(session)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            best.inflight += 1
            return best

    def _capacity(self, s: SGLangServer) -> int:
        """The requests ``s`` runs at once: its running-request slots (:meth:`slots`), or
        ``FleetConfig.max_concurrency`` before they are read."""
        return s.slots or self.cfg.max_concurrency

    def _post_watched(self, s: SGLangServer, path: str, payload: dict, timeout: float, raw: bool = False):
        """``s.post`` that gives up as soon as the server is declared dead (a frozen server's
        requests move on at the probe's verdict, not at the request time-out); ``raw``: the answer's
        bytes, unparsed."""
        box: Dict[str, Any] = {}
        done = threading.Event()
        incarnation = s.incarnation

        def call():
            try:
                box["out"] = s.post(path, payload, timeout=timeout, **({"raw": True} if raw else {}))
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread
                box["err"] = e
            finally:
                done.set()

        threading.Thread(target=call, name="sglang-post", daemon=True).start()
        while not done.wait(0.25):
            if s.health.state in (State.DEAD, State.RESTARTING, State.STALE) or s.incarnation != incarnation:
                raise RequestFailed(f"{s.url}{path}: the server was declared {s.health.state.value} while "
                                    f"the request ran ({s.last_error})", server_dead=True)
        if "err" in box:
            raise box["err"]
        return box["out"]

    # ------------------------------------------------------------------ the router
    def _members(self) -> set:
        """The healthy servers as the router must know them: address and incarnation (an attached
        server restarted by its job comes back at the same address, as a new process)."""
        return {(s.url, s.incarnation) for s in self.healthy_servers()}

    def _use_router(self) -> Optional[SGLangServer]:
        """The router, when it stands in front of exactly the healthy servers and every one of
        them serves (colocated mode: none while their memory is released or their weights owed)."""
        router = self.router
        if router is None or not router.alive:
            return None
        if set(self._router_members) != self._members() or not all(s.memory_ready for s in self.healthy_servers()):
            return None
        return router

    def _rebuild_router(self) -> None:
        """(Re)start sglang-router in front of the healthy servers (at least one)."""
        serving = self.healthy_servers()
        self._stop_router()
        if not serving:
            return
        self.router = launch_router(self.cfg.server, serving, self.cfg.router_policy, self.cfg.request_timeout)
        self._router_members = tuple((s.url, s.incarnation) for s in serving)

    def _stop_router(self) -> None:
        old, self.router, self._router_members = getattr(self, "router", None), None, ()
        if old is not None:
            stop_server(old)

    def _follow_healthy(self) -> None:
        """After a weight sync: the router rebuilt over the healthy set, when that set changed."""
        if self._routed and set(self._router_members) != self._members():
            self._rebuild_router()

    # ------------------------------------------------------------------ a call's requests
    def _run_one(self, path: str, payload: dict, deadline: float, parse, session=None, raw: bool = False):
        """Send one request, moving it to another server on failure, until the deadline (``session``:
        :meth:`_pick`'s; ``raw``: ``parse`` is handed the answer's bytes). Its server's slot is free
        again as soon as the answer is in, before ``parse``."""
        payload = with_adapter(path, payload, getattr(self, "lora_name", None))  # the served LoRA adapter, now
        tried: set = set()
        errors: List[str] = []
        router = self._use_router()
        if router is not None:
            try:
                out = router.post(path, payload, timeout=min(self.cfg.request_timeout,
                                                              max(deadline - time.monotonic(), 0.1)),
                                  **({"raw": True} if raw else {}))
                result = parse(out)
                with self._lock:
                    self.routed += 1
                return result
            except RequestFailed as e:  # the router retried its other workers already
                errors.append(f"via sglang-router: {e}")
                if not e.retryable:
                    raise FleetError(f"request rejected by sglang-router {router.url}: {e}") from e
                if not router.healthy(self.cfg.health_timeout):
                    self._mark_failed(router, RequestFailed(f"{router.url}: no answer to /health", server_dead=True))
                for s in self.serving_servers():  # which server failed it?
                    self._probe(s, max(min(self.cfg.probe_timeout, deadline - time.monotonic()), 1.0))
        for attempt in range(self.cfg.max_attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            s = self._pick(tried, session, deadline)  # (waits in the fleet for a free slot)
            if s is None:
                break
            tried.add(s.url)
            try:
                try:
                    out = self._post_watched(s, path, payload, timeout=min(self.cfg.request_timeout, left), raw=raw)
                finally:
                    with self._lock:
                        s.inflight -= 1
                        self._slot_free.notify_all()
                result = parse(out)
                s.served += 1
                return result
            except RequestFailed as e:
                errors.append(str(e))
                if not e.retryable:
                    raise FleetError(f"request rejected by {s.url}: {e}") from e
                self._mark_failed(s, e, deadline)
        reason = ("the step time-out passed" if time.monotonic() >= deadline else
                  "no SGLang server is left" if not self.serving_servers() else
                  f"{self.cfg.max_attempts} attempts failed")
        raise FleetError(f"{reason}; attempts: {errors or 'none'}; servers: {self._describe_all()}")

    def _run_all(self, path: str, payloads: List[dict], parse,
                 sessions: Optional[Sequence[object]] = None, raw: bool = False) -> List[Any]:
        """Every payload (one sequence each; ``sessions``: one :meth:`_pick` session each, or none;
        ``raw``: :meth:`_run_one`'s)
        within one call's time limit (:meth:`call_timeout`), as many in flight as the fleet runs
        at once (:meth:`partial_inflight`: the servers' running-request slots summed); the rest wait
        here, their own time limits not yet running."""
        step_timeout = self.call_timeout(len(payloads))
        deadline = time.monotonic() + step_timeout
        if not self.serving_servers():
            gated = [s for s in self.healthy_servers() if not s.memory_ready]
            if gated:
                raise FleetError("no SGLang server serves: their memory is released or their weights await a "
                                 "weight sync (colocated mode: resume_memory and update_weights first); servers: "
                                 + self._describe_all())
            raise FleetError(f"no SGLang server is left; servers: {self._describe_all()}")
        workers = max(1, min(self.partial_inflight(), len(payloads)))
        results: List[Any] = [None] * len(payloads)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sglang-req")
        self._step_running(+1)
        try:
            futs = {pool.submit(self._run_one, path, p, deadline, parse, sessions[i] if sessions else None, raw): i
                    for i, p in enumerate(payloads)}
            pending = set(futs)
            while pending:
                left = deadline - time.monotonic() + 5.0  # requests honour the deadline themselves
                done, pending = wait(pending, timeout=max(left, 0.1), return_when=FIRST_COMPLETED)
                if not done and time.monotonic() > deadline + 5.0:
                    raise FleetError(f"step time-out ({step_timeout:.0f} s) passed with "
                                     f"{len(pending)} requests unanswered; servers: {self._describe_all()}")
                for f in done:
                    results[futs[f]] = f.result()  # raises FleetError of that request
        finally:
            self._step_running(-1)
            pool.shutdown(wait=False, cancel_futures=True)
        if self._use_router() is not None:
            # behind the router a dead server goes unnoticed here (the router retries on the
            # others), but the weight sync talks to every live server
            self._drop_unreachable("no answer to /model_info after a routed step")
        return results

    def slots(self) -> int:
        """The fleet's running-request slots: every server's (:func:`~.client.running_slots` of its
        ``/server_info``, asked once per server; ``max_concurrency`` for one that reports none or
        does not answer), summed."""
        total = 0
        for s in self.servers:
            if s.slots is None:
                try:
                    s.slots = running_slots(s.server_info(self.cfg.health_timeout))
                except (RequestFailed, ValueError) as e:
                    log.warning("SGLang server %s: its running-request limit is unknown (%s): counted as %d",
                                s.url, e, self.cfg.max_concurrency)
                if s.slots is None:
                    s.slots = self.cfg.max_concurrency
            total += s.slots
        return total

    def call_timeout(self, sequences: int) -> float:
        """One call's time limit for ``sequences`` sequences: ``FleetConfig.step_timeout`` if set, else
        their waves on the fleet's slots x ``request_timeout`` (:func:`~megatron_tepo.time_limits.waves`)."""
        if self.cfg.step_timeout is not None:
            return float(self.cfg.step_timeout)
        return waves(sequences, self.slots()) * self.cfg.request_timeout

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
