"""The SGLang fleet: a step's requests spread over SGLang servers, behind the
:class:`~megatron_tepo.rollout.engine.RolloutEngine` interface, and the servers kept alive.

Servers are either started here (``FleetConfig.num_servers``, launched as ``server.py`` and ``options.py`` say:
subprocesses of this one under the SGLang venv's python, each with a random API key -- its own,
or one shared by the servers behind a router -- handed over in the environment, bound to
``ServerConfig.host`` -- loopback by default -- on a free port) or attached to by URL (with their
API key). A step's requests (one per prompt group) are spread over the healthy servers: by
sglang-router where it is installed (``FleetConfig.router``; ``auto``: when the SGLang python
imports ``sglang_router`` and there are two servers or more), a router process started here on
loopback that holds the servers' API key and checks it on every request; least-loaded first
(the fewest requests in flight for its running-request slots: :meth:`SGLangFleet._pick`, the one
place that chooses a server, where a prefix or session affinity would go) otherwise.

With routing replay (``FleetConfig.routing``: every ``/generate`` asks for its routed experts) no
router stands in front: the requests go to the servers directly, least-loaded. sglang-router
(0.3.2, the newest release on PyPI; upstream reports the same of its successor, the SGLang Model
Gateway: sgl-project/sglang#20696, closed as inactive) parses ``/generate`` into its own typed
request, which has no ``return_routed_experts``, and forwards that: the server answers without the
routing and the step fails. The fleet's own
dispatch sends the request as written, to a server it picks, so routing works with any router
release, over any number of servers; ``router: sglang_router`` with routing is refused in one
line. Before the first request the fleet reads each server's SGLang version (``/server_info``) and
refuses one older than routing needs (``versions.py``: 0.5.7), or started without
``--enable-return-routed-experts``.

A request that fails (connection refused or reset,
time-out, HTTP 5xx) -- through the router, after the router's own retries on its other workers --
is moved to another server directly. When no server is left -- or the step's deadline passes --
:class:`FleetError` names every server and its last error. Weight updates and cache flushes go to
every server directly, never through the router.

Health (the states and their table: ``health.py``). A failed request makes its server
*suspect*; while a step runs, a monitor thread probes every suspect server and every server that
holds requests, every ``probe_interval`` seconds, with a real one-token generation
(:meth:`SGLangServer.probe`, ``probe_timeout``): two failed probes in a row, a refused
connection or an exited process make it *dead*, and the requests it still holds are moved at
once (a frozen server is found within about ``2 x (probe_interval + probe_timeout)``, not after
the request time-out). A dead server the fleet launched is restarted in the background
(``server_restarts`` attempts, the k-th after ``restart_backoff x 2^(k-1)`` s) on a new port; an
attached one is restarted by whoever started it (slurm/lib.sh), and the next weight sync waits up
to ``return_timeout`` for it to answer again. Either way it comes back *stale*: it takes no
request, and is not put behind the router, until a weight sync has reached it
(:meth:`update_weights` first waits for restarting servers, then pushes to every reachable one,
then marks the stale ones healthy and rebuilds the router over the healthy set). Every change of
state is logged and counted; :meth:`health_metrics` hands the counts since its last call to the
step metrics.

Partial rollout (:meth:`submit`): each sample is one request, and as many are in flight as the
servers have running-request slots (each server's ``/server_info``, read at the first submit:
0.5.23's effective limit per DP rank, else its ``--max-running-requests``, else
``FleetConfig.max_concurrency``), summed over the fleet and bounded by
:data:`MAX_PARTIAL_INFLIGHT` (``FleetConfig.partial_inflight`` sets it instead), so that the
fleet stays full; :meth:`generate` sends one request per group of n samples,
``max_concurrency`` at a time.

Colocated mode (the servers share the actor's GPUs): :meth:`release_memory` / :meth:`resume_memory`
post ``/release_memory_occupation`` / ``/resume_memory_occupation`` with the tags to every live
server and return once every one has answered (its memory is free, or taken back). The fleet keeps
what it has released (its state) and, per server incarnation, what that process has released
(``SGLangServer.released``), and sends each server only what changes it: releasing what is
released, or resuming what is held, posts nothing (SGLang itself would stop at a resume of a tag
it holds, a ``KeyError`` in its scheduler). A release first aborts whatever the server still runs
(``/pause_generation``, mode abort; SGLang asserts the server is idle) and lets it continue
after. A server serves only when it holds all its memory and valid weights: from a resume of its
weights (their content is garbage) until a weight sync has reached it, and while any of its memory
is released, it is not picked and the router is not used. A server that comes back (restarted or
returned: a new process, all its memory held, its start-up weights) is brought to the fleet's
state at the next memory call or weight sync, whichever comes first (what the fleet has released
is released on it; a restart of the fleet's own does so as soon as the new process answers, so as
to give the GPU back to the actor), and it is stale until a sync reached it, as always. A dead server
is restarted only at the next weight sync, whose phase has room for a starting server (at any
other moment its new process would take its full memory beside the actor): the fleet's own
restarts start there, and for attached servers the fleet creates ``FleetConfig.restart_gate``
while the sync waits for them to come back (slurm/lib.sh restarts a server only while it exists);
a release first waits for restarts under way. The initial state of attached servers a launcher
released before the trainer started: ``FleetConfig.released``.

Left out: starting and stopping one server (``server.py``), its HTTP calls and probe (``client.py``),
the router's process (``router.py``); how weights reach the servers (``weight_sync/``; the fleet
holds one and calls it). A server that dies during a weight sync fails that sync (the export it
needs again is collective over the actor's ranks): the run stops and resumes from its last
checkpoint (docs/FAULT_TOLERANCE.md).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
import os
import secrets
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_tepo.rollout.engine import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, MEMORY_TAGS, Group, Request,
                                          RolloutEngine, Sample, SamplingParams, make_params, validate_prompts)
from megatron_tepo.rollout.sglang.health import COUNTERS, Event, State, counter
from megatron_tepo.rollout.sglang.client import FleetError, RequestFailed, SGLangServer, running_slots
from megatron_tepo.rollout.sglang.options import ServerConfig
from megatron_tepo.rollout.sglang.router import ROUTER_POLICIES, launch_router, router_installed
from megatron_tepo.rollout.sglang.routing import ROUTING_REQUEST, RoutingShape, decode_routed_experts
from megatron_tepo.rollout.sglang.server import launch_server, stop_server, wait_ready
from megatron_tepo.rollout.sglang.versions import R3, check_version
from megatron_tepo.rollout.sglang.weight_sync import TensorSync
from megatron_tepo.time_limits import waves

log = logging.getLogger(__name__)

#: the most requests :meth:`SGLangFleet.submit` keeps in flight, whatever the servers' slots (one
#: waiting thread each)
MAX_PARTIAL_INFLIGHT = 4096
#: the submitted requests' sessions remembered (their server, for the next turn's prefix cache)
MAX_SESSIONS = 1 << 16


@dataclass
class FleetConfig:
    """The servers to launch (``num_servers``, started as ``server``) and to attach to (``urls``,
    ``api_keys``), how requests are spread over them, and how their health is kept."""
    num_servers: int = 0                 # servers to launch
    urls: Sequence[str] = ()             # servers to attach to
    api_keys: Sequence[Optional[str]] = ()  # one per url (None: no key)
    server: ServerConfig = field(default_factory=ServerConfig)  # how launched servers start
    request_timeout: float = 120.0       # one HTTP request
    # one generate() call, retries included; None: its waves of sequences on the servers' running-request
    # slots x request_timeout (megatron_tepo/time_limits.py), read from the servers at the first call
    step_timeout: Optional[float] = None
    max_attempts: int = 4                # per request, over distinct servers where possible
    health_timeout: float = 5.0          # /health while starting
    max_concurrency: int = 64            # generate(): requests (groups of n) in flight over the whole fleet
    # submit() (partial rollout, one sample a request): requests in flight over the whole fleet; None: the
    # servers' running-request slots summed (read from each at the first submit), at most MAX_PARTIAL_INFLIGHT
    partial_inflight: Optional[int] = None
    # sglang-router in front of the servers: "auto" (when the SGLang python imports sglang_router
    # and there are >= 2 servers, and no routing is asked for), "sglang_router" (required; refused
    # with routing), "none" (least-loaded dispatch here)
    router: str = "auto"
    router_policy: str = "cache_aware"   # sglang-router's --policy
    probe_timeout: float = 60.0          # a one-token generation (fault.probe_timeout_s)
    probe_interval: float = 30.0         # while a step runs: probe busy and suspect servers this often
    server_restarts: int = 3             # launched servers: restarts each (fault.server_restarts)
    restart_backoff: float = 10.0        # the k-th restart waits restart_backoff * 2**(k-1) s
    return_timeout: float = 600.0        # attached servers: a sync waits this long for a dead one
    # colocated mode: the memory tags the attached servers had released when the fleet attached
    # (a colocated launch releases them after their health wait: TEPO_SGLANG_RELEASED)
    released: Sequence[str] = ()
    # colocated mode, attached servers: the file this fleet creates while a weight sync waits for
    # dead servers to come back (slurm/lib.sh restarts one only then: TEPO_SGLANG_RESTART_GATE)
    restart_gate: str = ""
    # MoE routing replay (actor.routing_replay: r3): every sample's routed experts are asked for and
    # decoded (the servers need --enable-return-routed-experts, SGLang >= 0.5.7; sent to them directly,
    # never through sglang-router, which drops the field); None: not asked
    routing: Optional[RoutingShape] = None


def use_router(cfg: FleetConfig, n_servers: int) -> bool:
    """Resolve ``cfg.router`` for a fleet of ``n_servers``; errors name the setting."""
    if cfg.router not in ("auto", "sglang_router", "none"):
        raise ValueError(f"FleetConfig.router: expected auto, sglang_router or none, found {cfg.router!r}")
    if cfg.router_policy not in ROUTER_POLICIES:
        raise ValueError(f"FleetConfig.router_policy: expected one of {ROUTER_POLICIES}, found {cfg.router_policy!r}")
    if cfg.router == "none":
        return False
    if cfg.routing is not None:  # the router would drop return_routed_experts: direct dispatch
        if cfg.router == "sglang_router":
            raise ValueError("FleetConfig.router=sglang_router (rollout.router) with routing replay "
                             "(actor.routing_replay: r3): sglang-router drops return_routed_experts from the "
                             "requests it forwards (0.3.2; sgl-project/sglang#20696), and r3's requests go to the "
                             "servers directly: set rollout.router: auto or none")
        return False
    if cfg.router == "auto":
        return n_servers >= 2 and router_installed(cfg.server.python)
    if not router_installed(cfg.server.python):
        raise FleetError(f"FleetConfig.router=sglang_router but {cfg.server.python} cannot import sglang_router: "
                         "`bash tools/install_sglang_cpu.sh` installs it (or pip install sglang-router)")
    return True


def memory_tags(tags: Iterable[str]) -> frozenset:
    """``tags`` as a set of :data:`~megatron_tepo.rollout.engine.MEMORY_TAGS` (an unknown one is an error)."""
    tags = frozenset([tags] if isinstance(tags, str) else tags)
    unknown = sorted(tags - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}: expected some of {MEMORY_TAGS}")
    return tags


def _session_key(key):
    """A submitted request's key as a session (None when it is not hashable)."""
    try:
        hash(key)
    except TypeError:
        return None
    return key


def parse_generate_output(out: dict, routing: Optional[RoutingShape] = None, where: str = "the server",
                          partial: bool = False) -> Sample:
    """One ``/generate`` answer as a :class:`Sample`; with ``routing`` (the request asked for it) its
    routed experts too, their absence a non-retryable failure naming ``where``. An aborted answer
    is a failure, or with ``partial`` (the fleet aborted it: partial rollout) the response so far,
    ``FINISH_ABORT``: SGLang answers an abort with every token generated and its log-prob."""
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
    if routing is not None:
        try:
            routed = decode_routed_experts(meta, int(meta.get("prompt_tokens", 0)) + len(ids) - 1, routing, where)
        except ValueError as exc:
            raise RequestFailed(str(exc), retryable=False) from None
    return Sample([int(t) for t in ids], [float(t[0]) for t in lps], reason,
                  meta={"matched_stop": fr.get("matched") if isinstance(fr, dict) else None}, routed_experts=routed)


class SGLangFleet(RolloutEngine):
    """Servers launched or attached per ``cfg``; ``weight_sync``: what :meth:`update_weights`
    pushes with (a :class:`~megatron_tepo.rollout.sglang.weight_sync.WeightSync` on this fleet;
    None: a ``tensor`` one made at the first update)."""

    def __init__(self, cfg: FleetConfig, weight_sync=None):
        self.cfg = cfg
        self.servers: List[SGLangServer] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._counts: Dict[str, int] = {}
        self._restarters: List[threading.Thread] = []
        self._deferred: List[SGLangServer] = []  # colocated: dead servers restarted at the next weight sync
        self._steps_running = 0
        self._probe_round = threading.Lock()  # held by a monitor round and by a weight sync
        self._waited_for: Dict[int, int] = {}  # attached server id -> incarnation whose return was awaited
        self._memory_lock = threading.Lock()  # one memory alignment at a time (a restart's and the phases')
        self.router: Optional[SGLangServer] = None
        self._router_members: Tuple[Tuple[str, int], ...] = ()
        self.weight_sync = weight_sync
        self.routed = 0  # requests answered through the router
        if cfg.routing is not None and not cfg.server.enable_return_routed_experts:
            # the servers launched here return the routing they are asked for (attached ones: their launcher's flag)
            self.cfg = cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server,
                                                                                 enable_return_routed_experts=True))
        keys = list(cfg.api_keys) + [None] * (len(cfg.urls) - len(cfg.api_keys))
        self.servers += [SGLangServer(u, k) for u, k in zip(cfg.urls, keys)]
        self._released = memory_tags(cfg.released)  # what the fleet has released (colocated mode)
        self._colocated = bool(self._released)  # (or from the first release_memory on)
        for s in self.servers:
            s.set_memory(self._released, False)
        self._routed = use_router(cfg, len(self.servers) + cfg.num_servers)
        if self._routed and len(set(keys)) > 1:
            if cfg.router == "sglang_router":
                raise ValueError("FleetConfig.api_keys: sglang-router needs one API key for all servers")
            log.warning("SGLang fleet: the attached servers have different API keys; least-loaded "
                        "dispatch instead of sglang-router")
            self._routed = False
        # servers behind one router share its key (the attached servers' one, or a new one)
        self._shared_key = (keys[0] if keys else secrets.token_hex(16)) if self._routed else None
        try:
            launched = [launch_server(cfg.server, i, self._shared_key) for i in range(cfg.num_servers)]
            self.servers += launched
            wait_ready(self.servers, cfg.server.startup_timeout)
            if not self.servers:
                raise ValueError("FleetConfig names no server: set num_servers or urls")
            for s in self.servers:
                s.health.on_change = partial(self._on_change, s)
            if cfg.routing is not None:
                self._check_routing_servers()
            if self._routed:
                self._rebuild_router()
        except BaseException:
            self.close()
            raise
        # interruptible generation (partial rollout): the requests submitted and not yet handed back
        self._partial_cv = threading.Condition()
        self._sessions: "OrderedDict[object, SGLangServer]" = OrderedDict()  # request key -> its last server
        self._partial_pool: Optional[ThreadPoolExecutor] = None
        self._partial_running: Dict[int, Tuple[Request, Any]] = {}
        self._partial_done: List[Tuple[Request, Sample]] = []
        self._interrupting = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="sglang-health", daemon=True)
        self._monitor.start()

    def _check_routing_servers(self) -> None:
        """Routing replay: every server runs an SGLang that returns routing (``versions.py``) and was
        started to return it; ValueError naming the first that does not (one line, before any
        request). ``/server_info`` reports the version and the server's arguments."""
        for s in self.servers:
            try:
                info = s.server_info(self.cfg.request_timeout)
            except RequestFailed as e:
                raise FleetError(f"routing replay: cannot read {s.url}/server_info: {e}") from None
            check_version(info.get("version"), [R3], f"SGLang server {s.url}")
            if info.get("enable_return_routed_experts") is False:
                raise ValueError(f"SGLang server {s.url} runs without --enable-return-routed-experts, which "
                                 f"{R3} needs (launch.rollout.enable_return_routed_experts; the launchers set it "
                                 f"when the run config says r3)")

    # ------------------------------------------------------------------ health
    def _on_change(self, s: SGLangServer, health, t) -> None:
        """Every change of a server's state: logged, counted; a dead server the fleet launched is
        restarted (bounded); the router is not used until it is rebuilt over the healthy set."""
        name = counter(t)
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + 1
        log.warning("SGLang server %s: %s -> %s on %s%s", s.url, t.old.value, t.new.value, t.event.value,
                    f" ({t.why})" if t.why else "")
        if t.new == State.DEAD and not self._closing.is_set():
            if s.proc is not None and self.cfg.server.model_path and s.health.restarts < self.cfg.server_restarts:
                if self._colocated:  # a new process takes its full memory: not beside the training actor
                    log.warning("SGLang server %s: restarted at the next weight sync (colocated: the GPUs are "
                                "the actor's until then)", s.url)
                    with self._lock:
                        self._deferred.append(s)
                else:
                    self._start_restart(s)
            elif s.proc is not None:
                log.error("SGLang server %s stays down: %d restart(s) used of FleetConfig.server_restarts=%d",
                          s.url, s.health.restarts, self.cfg.server_restarts)

    def _start_restart(self, s: SGLangServer) -> None:
        th = threading.Thread(target=self._restart, args=(s,), name=f"sglang-restart-{s.pid}", daemon=True)
        with self._lock:
            self._restarters.append(th)
        th.start()

    def _restart(self, s: SGLangServer) -> None:
        """Launch mode: stop what is left of the server, wait the back-off, start a new process on
        a new port (a router keeps the old address out), wait until it answers: then it is stale."""
        delay = self.cfg.restart_backoff * 2 ** s.health.restarts
        stop_server(s)  # the whole process group, a frozen one included (SIGKILL)
        if self._closing.wait(delay):
            return
        index = self.servers.index(s)
        s.health.fire(Event.RESTART, f"attempt {s.health.restarts + 1} of {self.cfg.server_restarts}, "
                                     f"after {delay:.0f} s")
        try:
            new = launch_server(self.cfg.server, index, s.api_key)
            s.replace_process(new.url, new.proc, new.log_path)
            if self._closing.is_set():  # close() ran while it started: it stops with the fleet
                stop_server(s)
                return
            wait_ready([s], self.cfg.server.startup_timeout)
        except Exception as e:  # noqa: BLE001 -- a failed start is a state, retried while attempts remain
            s.last_error = str(e).splitlines()[0]
            if not self._closing.is_set():
                s.health.fire(Event.START_FAILED, s.last_error)
            return
        if not self._closing.is_set():
            s.health.fire(Event.READY, f"restarted at {s.url}, pid {s.pid}; waits for a weight sync")
            try:  # colocated mode: what the fleet has released, released on the new process at once
                self._align([s])
            except FleetError as e:  # (retried at the next memory call or weight sync)
                log.warning("SGLang server %s: %s", s.url, e)

    def _join_restarts(self) -> None:
        """Wait for every restart under way (each ends stale, or dead once its attempts are used;
        a failed start may begin the next attempt, which is waited for too)."""
        while True:
            with self._lock:
                self._restarters = [th for th in getattr(self, "_restarters", []) if th.is_alive()]
                running = list(self._restarters)
            if not running:
                return
            for th in running:
                th.join()

    def _probe(self, s: SGLangServer, timeout: Optional[float] = None) -> None:
        ok, why = s.probe(self.cfg.probe_timeout if timeout is None else timeout)
        if s.health.state not in (State.HEALTHY, State.SUSPECT):
            return  # it changed meanwhile (died, a sync reached it)
        if ok:
            s.health.fire(Event.PROBE_OK)
        else:
            s.last_error = why
            s.health.fire(Event.EXITED if s.exited() else Event.PROBE_FAILED, why)

    def _watch(self) -> None:
        """While a step runs: probe the suspect servers and those holding requests. A round and
        a weight sync exclude each other (a paused server would not answer the probe)."""
        while not self._closing.wait(self.cfg.probe_interval):
            with self._probe_round:
                if not self._steps_running:
                    continue
                for s in list(self.servers):
                    if s.health.state == State.SUSPECT or (s.health.state == State.HEALTHY and s.inflight > 0):
                        self._probe(s)

    def health_metrics(self) -> Dict[str, float]:
        """Changes of server state since the last call (``fleet_died``, ``fleet_restarts``,
        ``fleet_resynced``, ...; see ``health.counter``) and ``fleet_healthy``, the servers that
        serve now. Each change is counted in exactly one call."""
        with self._lock:
            counts, self._counts = self._counts, {}
        out = {k: float(counts.get(k, 0)) for k in COUNTERS}
        out["fleet_healthy"] = float(len(self.healthy_servers()))
        return out

    # ------------------------------------------------------------------ dispatch
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

    def _pick(self, exclude: set, session=None) -> Optional[SGLangServer]:
        """The server a request goes to when it does not go through the router: among the serving
        ones not in ``exclude`` (tried already; all tried: any), the least loaded, i.e. the fewest
        requests in flight per running-request slot (slots known once :meth:`submit` has read
        them; before, every server counts alike), then the fewest served. The one place that picks
        a server. ``session`` (a submitted request's key: every turn of a multi-turn episode has the
        same one): the server its last request went to, while it serves and has a free slot, so
        that its prefix cache serves the turn's prefill (what sglang-router's cache-aware policy does
        for routed requests)."""
        with self._lock:
            serving = self.serving_servers()
            cands = [s for s in serving if s.url not in exclude]
            if not cands:
                cands = serving  # all tried: reuse a live one
            if not cands:
                return None
            held = self._sessions.get(session) if session is not None else None
            if held is not None and held in cands and held.inflight < (held.slots or self.cfg.max_concurrency):
                best = held
            else:
                best = min(cands, key=lambda s: (s.inflight / (s.slots or 1), s.served))
            if session is not None:
                self._sessions[session] = best
                self._sessions.move_to_end(session)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            best.inflight += 1
            return best

    def _mark_failed(self, s: SGLangServer, err: RequestFailed, deadline: Optional[float] = None) -> None:
        """A request to ``s`` failed: dead when its connection was refused or its process is gone;
        suspect otherwise, then probed at once (within the step's deadline): healthy again if it
        answers, dead if not."""
        s.last_error = str(err)
        if s.health.state in (State.DEAD, State.RESTARTING, State.STALE):
            return
        if err.server_dead or s.exited():
            s.health.fire(Event.EXITED, str(err))
            return
        s.health.fire(Event.REQUEST_FAILED, str(err))
        if s.health.state == State.SUSPECT:
            left = self.cfg.probe_timeout if deadline is None else deadline - time.monotonic()
            self._probe(s, max(min(self.cfg.probe_timeout, left), 1.0))

    def _post_watched(self, s: SGLangServer, path: str, payload: dict, timeout: float):
        """``s.post`` that gives up as soon as the server is declared dead (a frozen server's
        requests move on at the probe's verdict, not at the request time-out)."""
        box: Dict[str, Any] = {}
        done = threading.Event()
        incarnation = s.incarnation

        def call():
            try:
                box["out"] = s.post(path, payload, timeout=timeout)
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
        old, self.router, self._router_members = self.router, None, ()
        if old is not None:
            stop_server(old)
        if not serving:
            return
        self.router = launch_router(self.cfg.server, serving, self.cfg.router_policy, self.cfg.request_timeout)
        self._router_members = tuple((s.url, s.incarnation) for s in serving)

    def _run_one(self, path: str, payload: dict, deadline: float, parse, session=None):
        """Send one request, moving it to another server on failure, until the deadline (``session``:
        :meth:`_pick`'s)."""
        tried: set = set()
        errors: List[str] = []
        router = self._use_router()
        if router is not None:
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
                if not router.healthy(self.cfg.health_timeout):
                    self._mark_failed(router, RequestFailed(f"{router.url}: no answer to /health", server_dead=True))
                for s in self.serving_servers():  # which server failed it?
                    self._probe(s, max(min(self.cfg.probe_timeout, deadline - time.monotonic()), 1.0))
        for attempt in range(self.cfg.max_attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            s = self._pick(tried, session)
            if s is None:
                break
            tried.add(s.url)
            try:
                out = self._post_watched(s, path, payload, timeout=min(self.cfg.request_timeout, left))
                result = parse(out)
                s.served += 1
                return result
            except RequestFailed as e:
                errors.append(str(e))
                if not e.retryable:
                    raise FleetError(f"request rejected by {s.url}: {e}") from e
                self._mark_failed(s, e, deadline)
            finally:
                with self._lock:
                    s.inflight -= 1
        reason = ("the step time-out passed" if time.monotonic() >= deadline else
                  "no SGLang server is left" if not self.serving_servers() else
                  f"{self.cfg.max_attempts} attempts failed")
        raise FleetError(f"{reason}; attempts: {errors or 'none'}; servers: {self._describe_all()}")

    def _run_all(self, path: str, payloads: List[dict], parse, sequences: Optional[int] = None) -> List[Any]:
        """Every payload (``sequences`` in all: n per payload; default one each) within one call's
        time limit (:meth:`call_timeout`)."""
        step_timeout = self.call_timeout(sequences or len(payloads))
        deadline = time.monotonic() + step_timeout
        if not self.serving_servers():
            gated = [s for s in self.healthy_servers() if not s.memory_ready]
            if gated:
                raise FleetError("no SGLang server serves: their memory is released or their weights await a "
                                 "weight sync (colocated mode: resume_memory and update_weights first); servers: "
                                 + self._describe_all())
            raise FleetError(f"no SGLang server is left; servers: {self._describe_all()}")
        workers = max(1, min(self.cfg.max_concurrency, len(payloads)))
        results: List[Any] = [None] * len(payloads)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sglang-req")
        with self._lock:
            self._steps_running += 1
        try:
            futs = {pool.submit(self._run_one, path, p, deadline, parse): i for i, p in enumerate(payloads)}
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
            with self._lock:
                self._steps_running -= 1
            pool.shutdown(wait=False, cancel_futures=True)
        if self._use_router() is not None:
            # behind the router a dead server goes unnoticed here (the router retries on the
            # others), but the weight sync talks to every live server
            self._drop_unreachable("no answer to /model_info after a routed step")
        return results

    def _drop_unreachable(self, why: str) -> None:
        """Every healthy or suspect server whose process is gone or whose HTTP server does not
        answer within ``health_timeout`` is dead (a cheap check that generates nothing, safe on
        released memory: :meth:`SGLangServer.answers`; the generation probe is for servers that
        answer but may not generate)."""
        for s in self.servers:
            if s.health.state in (State.HEALTHY, State.SUSPECT) and not s.answers(self.cfg.health_timeout):
                self._mark_failed(s, RequestFailed(f"{s.url}: {why}", server_dead=True))

    # ------------------------------------------------------------------ recovery at a weight sync
    def _gather_for_sync(self) -> None:
        """Before a push: wait for restarting servers (their start-up time-out), wait up to
        ``return_timeout`` once for each dead attached server to answer again (its job restarts
        it), probe the suspect ones. What comes back is stale and gets this push. Colocated: the
        restarts deferred to this sync start now, and the restart gate is open while it waits."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        for s in deferred:
            if not self._closing.is_set():
                self._start_restart(s)
        self._join_restarts()
        self._drop_unreachable("no answer to /model_info before a weight sync")
        with self._restart_gate():
            self._await_returns()

    @contextmanager
    def _restart_gate(self):
        """Colocated, attached servers: ``cfg.restart_gate`` exists while this lasts, if a server the
        fleet did not launch is dead (its job restarts it only then; slurm/lib.sh)."""
        gate = Path(self.cfg.restart_gate) if self.cfg.restart_gate else None
        if gate is None or not any(s.health.state == State.DEAD and s.proc is None for s in self.servers):
            yield
            return
        gate.parent.mkdir(parents=True, exist_ok=True)
        gate.write_text(f"a weight sync waits for dead servers (pid {os.getpid()})\n")
        try:
            yield
        finally:
            gate.unlink(missing_ok=True)

    def _await_returns(self) -> None:
        for s in self.servers:
            if s.health.state == State.SUSPECT and not s.released:  # (a probe generates: not on released memory)
                self._probe(s)
            if s.health.state != State.DEAD or s.proc is not None:
                continue
            first = self._waited_for.get(id(s)) != s.incarnation
            wait_s = self.cfg.return_timeout if first else 0.0
            self._waited_for[id(s)] = s.incarnation
            if first:
                log.warning("SGLang server %s is down: waiting up to %.0f s for it to come back "
                            "(FleetConfig.return_timeout / fault.server_return_timeout_s)", s.url, wait_s)
            end = time.monotonic() + wait_s
            while True:
                ok, why = s.probe(min(self.cfg.probe_timeout, max(end - time.monotonic(), 5.0)))
                if ok:
                    s.health.fire(Event.READY, "answers again; waits for a weight sync")
                    break
                if time.monotonic() >= end:
                    if first:
                        log.error("SGLang server %s did not come back within %.0f s (%s): going on without it",
                                  s.url, wait_s, why)
                    break
                time.sleep(min(5.0, max(end - time.monotonic(), 0.1)))

    def _after_sync(self, pushed: List[SGLangServer]) -> None:
        for s in pushed:
            s.set_memory(s.released, False)  # its weights are the fleet's again
            if s.health.state == State.STALE:
                s.health.fire(Event.SYNCED, f"incarnation {s.incarnation} holds the current weights")
        if self._routed and set(self._router_members) != self._members():
            self._rebuild_router()

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
                             "return_logprob": True, "logprob_start_len": -1,
                             **(ROUTING_REQUEST if self.cfg.routing is not None else {})})

        def parse(out):
            outs = out if isinstance(out, list) else [out]
            if len(outs) != sp.n:
                raise RequestFailed(f"expected {sp.n} samples, got {len(outs)}")
            return [parse_generate_output(o, self.cfg.routing, "an SGLang server") for o in outs]

        return self._run_all("/generate", payloads, parse, sequences=len(payloads) * sp.n)

    # ------------------------------------------------------------------ interruptible generation
    interruptible = True

    def submit(self, requests: Sequence[Request], params: SamplingParams) -> None:
        """Each request as one ``/generate`` of one sample (``prompt + token_ids``, its remaining
        tokens), through the router where there is one, retried as :meth:`generate`'s are;
        :meth:`partial_inflight` of them in flight at once (the fleet's running-request slots), the
        rest waiting here."""
        if self.cfg.routing is not None:
            raise ValueError("SGLangFleet.submit: routing is not returned for interrupted requests "
                             "(rollout.partial_rollout with actor.routing_replay: r3)")
        validate_prompts([r.prompt for r in requests])
        sampling = {"n": 1, "temperature": params.temperature, "top_p": params.top_p, "top_k": -1,
                    "stop_token_ids": list(params.stop_token_ids), "ignore_eos": not params.stop_token_ids,
                    "skip_special_tokens": False}
        workers = self.partial_inflight() if self._partial_pool is None else 0  # (asks the servers: not under the lock)
        with self._partial_cv:
            if self._partial_pool is None:
                self._partial_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sglang-partial")
            for r in requests:
                if r.remaining < 1:
                    raise ValueError(f"request {r.key!r}: no tokens left to generate")
                payload = {"input_ids": [int(t) for t in r.prompt + r.token_ids],
                           "sampling_params": {**sampling, "max_new_tokens": r.remaining},
                           "return_logprob": True, "logprob_start_len": -1}
                if not self._partial_running:
                    with self._lock:
                        self._steps_running += 1  # (the monitor probes the servers that hold requests)
                self._partial_running[id(r)] = (r, self._partial_pool.submit(self._run_partial, r, payload))

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

    def partial_inflight(self) -> int:
        """How many requests :meth:`submit` keeps in flight: ``FleetConfig.partial_inflight`` if set,
        else the fleet's running-request :meth:`slots`, at most :data:`MAX_PARTIAL_INFLIGHT`. One
        request a slot keeps each server's batch full; more would only queue on the servers, where an
        interrupt has to abort them too."""
        if self.cfg.partial_inflight is not None:
            if self.cfg.partial_inflight < 1:
                raise ValueError(f"FleetConfig.partial_inflight must be >= 1, got {self.cfg.partial_inflight}")
            return self.cfg.partial_inflight
        total = self.slots()
        if total > MAX_PARTIAL_INFLIGHT:
            log.warning("SGLang fleet: %d running-request slots over %d servers; partial rollout keeps %d requests "
                        "in flight (MAX_PARTIAL_INFLIGHT)", total, len(self.servers), MAX_PARTIAL_INFLIGHT)
        return max(1, min(total, MAX_PARTIAL_INFLIGHT))

    def _run_partial(self, r: Request, payload: dict) -> None:
        deadline = time.monotonic() + self.call_timeout(self.partial_inflight())
        try:
            seg = self._run_one("/generate", payload, deadline,
                                lambda out: parse_generate_output(out[0] if isinstance(out, list) else out,
                                                                  partial=self._interrupting.is_set()),
                                session=_session_key(r.key))
        except Exception as exc:  # noqa: BLE001 -- cut by an interrupt, or failed: handed back either way
            seg = Sample([], [], FINISH_ABORT, meta={} if self._interrupting.is_set() else
                         {"error": f"{type(exc).__name__}: {exc}"})
        with self._partial_cv:
            if self._partial_running.pop(id(r), None) is not None:
                self._partial_done.append((r, seg))
                if not self._partial_running:
                    with self._lock:
                        self._steps_running -= 1
            self._partial_cv.notify_all()

    def collect(self, timeout: float = 0.0) -> List[Tuple[Request, Sample]]:
        with self._partial_cv:
            if not self._partial_done and timeout > 0:
                self._partial_cv.wait_for(lambda: bool(self._partial_done), timeout=timeout)
            out, self._partial_done = self._partial_done, []
        return out

    def interrupt(self) -> List[Tuple[Request, Sample]]:
        """``/abort_request`` (all) on every server directly (sglang-router has no such route),
        again every 0.2 s until every request has answered: a request that reached a server after
        an abort, or was retried on another, is cut by the next one. Each answers with its tokens so
        far and their log-probs (HTTP 200, finish ``abort``); one cut before it ran, with none."""
        self._interrupting.set()
        try:
            while True:
                with self._partial_cv:
                    if not self._partial_running:
                        break
                for s in self.alive_servers():
                    try:
                        s.post("/abort_request", {"abort_all": True}, timeout=self.cfg.health_timeout)
                    except RequestFailed as e:  # a dead server's requests fail and come back anyway
                        log.warning("SGLang server %s: /abort_request failed: %s", s.url, e)
                with self._partial_cv:
                    self._partial_cv.wait_for(lambda: not self._partial_running, timeout=0.2)
            with self._partial_cv:
                out, self._partial_done = self._partial_done, []
            return out
        finally:
            self._interrupting.clear()

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
        """Push the stream to every reachable server (the fleet's weight sync; ``tensor`` mode
        unless the trainer set another up), servers paused, then one cache flush. Restarted and
        returned servers are gathered first and take requests only once this push reached them."""
        with self._partial_cv:
            if self._partial_running:
                raise RuntimeError(f"SGLangFleet.update_weights: {len(self._partial_running)} submitted requests are "
                                   f"generating; interrupt() them first (no token is generated under weights being "
                                   f"written)")
        if self.weight_sync is None:
            self.weight_sync = TensorSync(self)
        with self._probe_round:
            self._gather_for_sync()
            self._align()  # a server that came back: to the fleet's memory state before the push
            if "weights" in self._released:
                raise FleetError("a weight update while the servers' weights are released (colocated mode): "
                                 "resume_memory(('weights',)) first")
            pushed = self.alive_servers()
            self.weight_sync.push(named_tensors)
            self._after_sync(pushed)

    def flush_cache(self) -> None:
        self.broadcast("/flush_cache")

    # ------------------------------------------------------------------ colocated mode: memory
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Every live server frees the memory of ``tags``; returns once each answered (its memory is
        free). What a server has released already is not sent again."""
        self._join_restarts()  # (a new process holds all its memory until it is aligned)
        with self._probe_round:
            self._colocated = True
            self._released = self._released | memory_tags(tags)
            self._align()

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Every live server takes back the memory of ``tags`` it released; returns once each
        answered. A server whose weights come back serves nothing until a weight sync reached it."""
        with self._probe_round:
            self._released = self._released - memory_tags(tags)
            self._align()

    def _align(self, servers: Optional[List[SGLangServer]] = None) -> None:
        """Bring every live server (or ``servers``) to the fleet's memory state, concurrently: release what the
        fleet has released and the server holds, resume what it released and the fleet holds. A
        server found dead meanwhile is left to the restart path (it comes back holding everything
        and is aligned then); any other failure is an error once every server has answered."""
        errors: Dict[str, str] = {}

        def align(s: SGLangServer) -> None:
            release = [t for t in MEMORY_TAGS if t in self._released and t not in s.released]
            resume = [t for t in MEMORY_TAGS if t in s.released and t not in self._released]
            before = (s.released, s.awaits_weights)
            try:
                if release:
                    # not picked from now on; SGLang releases only an idle server: abort what it
                    # may still run (a request given up on here and retried elsewhere), then let
                    # it continue
                    s.set_memory(s.released | set(release), s.awaits_weights)
                    s.post("/pause_generation", {"mode": "abort"}, timeout=self.cfg.request_timeout)
                    try:
                        s.post("/release_memory_occupation", {"tags": release}, timeout=self.cfg.request_timeout)
                        before = (s.released, s.awaits_weights)  # released, whatever follows
                    finally:
                        s.post("/continue_generation", {}, timeout=self.cfg.request_timeout)
                if resume:
                    s.post("/resume_memory_occupation", {"tags": resume}, timeout=self.cfg.request_timeout)
                    s.set_memory(s.released - set(resume), s.awaits_weights or "weights" in resume)
            except RequestFailed as e:
                s.last_error = str(e)
                if e.server_dead or s.exited():  # restarted or awaited; aligned once it is back
                    s.health.fire(Event.EXITED, str(e))
                else:  # what it answered is what it holds (no probe: a probe generates)
                    s.set_memory(*before)
                    errors[s.url] = str(e)

        with self._memory_lock:
            servers = [s for s in (self.alive_servers() if servers is None else servers) if s.alive]
            with ThreadPoolExecutor(max_workers=max(1, len(servers)), thread_name_prefix="sglang-memory") as pool:
                list(pool.map(align, servers))
        if errors:
            raise FleetError(f"memory release/resume failed: {errors}; servers: {self._describe_all()}")

    def close(self) -> None:
        self._closing.set()
        pool = getattr(self, "_partial_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for s in self.servers:  # a restart still starting sees its process exit and gives up
            stop_server(s)
        self._join_restarts()
        ws, self.weight_sync = getattr(self, "weight_sync", None), None
        if ws is not None and hasattr(ws, "close"):
            ws.close()
        router, self.router = getattr(self, "router", None), None
        if router is not None:
            stop_server(router)
        for s in self.servers:
            stop_server(s)
