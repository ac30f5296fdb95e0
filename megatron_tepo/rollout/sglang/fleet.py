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
(the fewest requests in flight for its running-request slots: ``dispatch.py``'s ``_pick``, the
one place that chooses a server, where a prefix or session affinity would go) otherwise.

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
``--enable-return-routed-experts``. A routed answer is read as raw bytes and parsed, its routing
decoded, in the fleet's decoder processes (``routing.py``'s ``RoutingDecoder``,
``FleetConfig.routing_decoders``), not on the request threads.

:class:`SGLangFleet` is one object, the trainer's engine, made of four parts with one job each
over the one list of servers (``servers``), the settings (``cfg``) and one lock for their counters
(``_lock``), which are the fleet's own; each part's module is its spec and says which attributes it
owns and what it uses of the others:

* ``dispatch.py`` -- the server lists (alive, healthy, serving); a call's requests through the
  router, or to the server ``_pick`` chooses, moved to another server when one fails (connection
  refused or reset, time-out, HTTP 5xx), until none is left or the call's time limit (from the
  servers' running-request slots) passes: then :class:`FleetError` names every server and its last
  error; weight updates and cache flushes to every server directly, never through the router; one
  ``/generate`` answer read as a sample (:func:`parse_generate_output`).
* ``supervision.py`` -- the servers' health (the states: ``health.py``): a failed request makes its
  server suspect, a monitor thread probes the suspect and busy ones while a step runs, a dead server
  is restarted (launched here) or awaited at the next weight sync (attached), and comes back stale,
  taking no request until a weight sync reached it; every change logged and counted
  (:meth:`health_metrics`).
* ``interruptible.py`` -- partial rollout's :meth:`submit` / :meth:`collect` / :meth:`interrupt`:
  one request a sample, as many in flight as the servers have running-request slots, at most
  :data:`MAX_PARTIAL_INFLIGHT`.
* ``memory.py`` -- colocated mode (the servers share the actor's GPUs): :meth:`release_memory` /
  :meth:`resume_memory` on every live server, each sent only what changes it; a server serves only
  while it holds all its memory and valid weights, and one that comes back is brought to the
  fleet's state.

This module assembles them: the settings (:class:`FleetConfig`; :func:`use_router` resolves the
router), the start-up (servers launched and attached, the routing-replay check, the router), the
verbs that build requests (:meth:`generate`: one request a sequence, the n of a group one session,
as many in flight as the servers have running-request slots; :meth:`score`), the weight update that
brings the parts together (:meth:`update_weights`: refused while a submitted request generates;
supervision gathers the restarting and returning servers, colocated mode brings them to the fleet's
memory state, the weight sync pushes to every reachable server, the stale ones become healthy and
the router is rebuilt over the healthy set), and :meth:`close`.

Left out: starting and stopping one server (``server.py``), its HTTP calls and probe (``client.py``),
the router's process (``router.py``); how weights reach the servers (``weight_sync/``; the fleet
holds one and calls it). A server that dies during a weight sync fails that sync (the export it
needs again is collective over the actor's ranks): the run stops and resumes from its last
checkpoint (docs/FAULT_TOLERANCE.md).
"""
from __future__ import annotations

import dataclasses
import secrets
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_tepo.rollout.engine import Group, RolloutEngine, Sample, make_params, validate_prompts
from megatron_tepo.rollout.sglang.client import FleetError, RequestFailed, SGLangServer
from megatron_tepo.rollout.sglang.dispatch import Dispatch, parse_generate_output
from megatron_tepo.rollout.sglang.interruptible import MAX_PARTIAL_INFLIGHT, Interruptible
from megatron_tepo.rollout.sglang.memory import ColocatedMemory, memory_tags
from megatron_tepo.rollout.sglang.options import ServerConfig
from megatron_tepo.rollout.sglang.router import ROUTER_POLICIES, router_installed
from megatron_tepo.rollout.sglang.routing import ROUTING_REQUEST, RoutingDecoder
from megatron_tepo.rollout.sglang.server import launch_server, stop_server, wait_ready
from megatron_tepo.rollout.sglang.supervision import Supervision
from megatron_tepo.rollout.sglang.versions import R3, check_version
from megatron_tepo.rollout.sglang.weight_sync import TensorSync
from megatron_tepo.routing import RoutingShape

# the parts' public names, imported from here by attach.py and the tests
__all__ = ["FleetConfig", "SGLangFleet", "use_router", "memory_tags", "parse_generate_output", "MAX_PARTIAL_INFLIGHT"]


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
    max_concurrency: int = 64            # the running-request slots of a server that reports none
    # generate(), score() and submit() (one sequence a request): requests in flight over the whole fleet; None:
    # the servers' running-request slots summed (read from each at the first call), at most MAX_PARTIAL_INFLIGHT
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
    # r3: processes that parse the routed answers and decode their routing off the request threads
    # (routing.py's RoutingDecoder; 0: on the request threads, holding the GIL)
    routing_decoders: int = 4


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


class SGLangFleet(Dispatch, Supervision, Interruptible, ColocatedMemory, RolloutEngine):
    """Servers launched or attached per ``cfg``; ``weight_sync``: what :meth:`update_weights`
    pushes with (a :class:`~megatron_tepo.rollout.sglang.weight_sync.WeightSync` on this fleet;
    None: a ``tensor`` one made at the first update). Its parts: :class:`~.dispatch.Dispatch`,
    :class:`~.supervision.Supervision`, :class:`~.interruptible.Interruptible`,
    :class:`~.memory.ColocatedMemory` (the module docstring)."""

    def __init__(self, cfg: FleetConfig, weight_sync=None):
        self.cfg = cfg
        self.servers: List[SGLangServer] = []
        self._lock = threading.Lock()  # the parts' counters and lists (held briefly)
        self._init_supervision()
        self.weight_sync = weight_sync
        # the LoRA adapter the servers serve the policy as (actor.lora.sync: adapters; set by its weight
        # sync, weight_sync/lora.py): every /generate request names it; None: the base weights
        self.lora_name: Optional[str] = None
        self.routing_decoder = RoutingDecoder(cfg.routing, cfg.routing_decoders) if cfg.routing is not None else None
        if cfg.routing is not None and not cfg.server.enable_return_routed_experts:
            # the servers launched here return the routing they are asked for (attached ones: their launcher's flag)
            self.cfg = cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server,
                                                                                 enable_return_routed_experts=True))
        keys = list(cfg.api_keys) + [None] * (len(cfg.urls) - len(cfg.api_keys))
        self.servers += [SGLangServer(u, k) for u, k in zip(cfg.urls, keys)]
        self._init_memory(cfg.released)
        self._init_dispatch(use_router(cfg, len(self.servers) + cfg.num_servers), keys)
        self._init_interruptible()
        # servers behind one router share its key (the attached servers' one, or a new one)
        shared_key = (keys[0] if keys else secrets.token_hex(16)) if self._routed else None
        try:
            launched = [launch_server(cfg.server, i, shared_key) for i in range(cfg.num_servers)]
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
        self._start_monitor()

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

    # ------------------------------------------------------------------ RolloutEngine
    def generate(self, prompts: List[List[int]], n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 128,
                 stop_token_ids: Sequence[int] = (), seed: Optional[int] = None) -> List[Group]:
        sp = make_params(n, temperature, top_p, max_new_tokens, stop_token_ids)
        validate_prompts(prompts)
        # one request a sequence (n: 1), so that each server runs exactly its slots' worth and a slot
        # that frees takes the next sequence (a group of n would hold n slots until its longest answer)
        sampling = {"n": 1, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": -1,
                    "max_new_tokens": sp.max_new_tokens, "stop_token_ids": list(sp.stop_token_ids),
                    # SGLang checks stop_token_ids only when ignore_eos is false; then the model's
                    # own EOS id also stops (pass it in stop_token_ids to be explicit)
                    "ignore_eos": not sp.stop_token_ids, "skip_special_tokens": False}
        payloads, sessions = [], []
        call = object()  # (this call's groups as sessions: a group's sequences share its prompt's prefix)
        for i, p in enumerate(prompts):
            for j in range(sp.n):
                s = dict(sampling)
                if seed is not None:  # (n = 1: seed + i, as one request of n had)
                    s["sampling_seed"] = int(seed) + i * sp.n + j
                payloads.append({"input_ids": [int(t) for t in p], "sampling_params": s,
                                 "return_logprob": True, "logprob_start_len": -1,
                                 **(ROUTING_REQUEST if self.cfg.routing is not None else {})})
                sessions.append((call, i))

        samples = self._run_all("/generate", payloads, self._sample_of, sessions, raw=self.routing_decoder is not None)
        return [samples[i * sp.n:(i + 1) * sp.n] for i in range(len(prompts))]

    def _sample_of(self, out, partial: bool = False) -> Sample:
        """One ``/generate`` answer of one sequence as a :class:`Sample`, its routing with it where the
        fleet asks for routing (r3: the answer's raw body, read by a decoder process); ``partial``:
        :func:`parse_generate_output`'s (an answer cut by an interrupt)."""
        if isinstance(out, bytes):  # (r3: the answer's body, read by a decoder process)
            try:
                out = self.routing_decoder.read(out, "an SGLang server")
            except ValueError as exc:  # (not JSON)
                raise RequestFailed(f"an SGLang server's answer is not JSON: {exc}") from None
        outs = out if isinstance(out, list) else [out]
        if len(outs) != 1:
            raise RequestFailed(f"expected 1 sample, got {len(outs)}")
        return parse_generate_output(outs[0], self.cfg.routing, "an SGLang server", partial=partial)

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

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Push the stream to every reachable server (the fleet's weight sync; ``tensor`` mode
        unless the trainer set another up), servers paused, then one cache flush. Restarted and
        returned servers are gathered first and take requests only once this push reached them."""
        self._refuse_while_generating()
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
            self._follow_healthy()

    def flush_cache(self) -> None:
        self.broadcast("/flush_cache")

    def close(self) -> None:
        self._closing.set()
        self._drop_submitted()
        for s in self.servers:  # a restart still starting sees its process exit and gives up
            stop_server(s)
        self._join_restarts()
        ws, self.weight_sync = getattr(self, "weight_sync", None), None
        if ws is not None and hasattr(ws, "close"):
            ws.close()
        self._stop_router()
        for s in self.servers:
            stop_server(s)
        if getattr(self, "routing_decoder", None) is not None:
            self.routing_decoder.close()
