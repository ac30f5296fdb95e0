"""The fleet's supervision of its servers (:class:`Supervision`, a part of
:class:`~megatron_tepo.rollout.sglang.fleet.SGLangFleet`): their changes of state, probes, the
monitor thread, restarts, the health metrics, and the recovery that a weight sync begins with.

Health (the states and their table: ``health.py``). A failed request makes its server
*suspect* (:meth:`Supervision._mark_failed`); while a step runs, a monitor thread probes every
suspect server and every server that holds requests, every ``probe_interval`` seconds, with a real
one-token generation (:meth:`SGLangServer.probe`, ``probe_timeout``): two failed probes in a row, a
refused connection or an exited process make it *dead*, and the requests it still holds are moved
at once (a frozen server is found within about ``2 x (probe_interval + probe_timeout)``, not after
the request time-out). A dead server the fleet launched is restarted in the background
(``server_restarts`` attempts, the k-th after ``restart_backoff x 2^(k-1)`` s) on a new port; an
attached one is restarted by whoever started it (slurm/lib.sh), and the next weight sync waits up
to ``return_timeout`` for it to answer again. Either way it comes back *stale*: it takes no
request, and is not put behind the router, until a weight sync has reached it (the fleet's
``update_weights`` first gathers the servers here -- :meth:`Supervision._gather_for_sync` waits
for restarting servers and for returning ones -- then pushes to every reachable one, then
:meth:`Supervision._after_sync` marks the stale ones healthy and the router is rebuilt over the
healthy set). Every change of state is logged and counted; :meth:`Supervision.health_metrics`
hands the counts since its last call to the step metrics.

Colocated mode (the servers share the actor's GPUs): a dead server is restarted only at the next
weight sync, whose phase has room for a starting server (at any other moment its new process
would take its full memory beside the actor): the fleet's own restarts start there, and for
attached servers the fleet creates ``FleetConfig.restart_gate`` while the sync waits for them to
come back (slurm/lib.sh restarts a server only while it exists). A restart of the fleet's own is
brought to the fleet's memory state as soon as the new process answers (``memory.py``), so as to
give the GPU back to the actor.

Owns: ``_closing`` (set by the fleet's ``close``), ``_counts``, ``_restarters``, ``_deferred``,
``_steps_running`` (counted through :meth:`Supervision._step_running` by the calls that hold
requests), ``_probe_round`` (held by a monitor round, and by the fleet's weight sync and memory
calls), ``_waited_for`` and ``_monitor``. Uses, beside the fleet's ``cfg``, ``servers`` and
``_lock``: the server lists (``dispatch.py``), and colocated mode's ``_colocated`` and ``_align``
(``memory.py``).

Left out: the state table (``health.py``), the probe itself (``client.py``), starting and stopping
a process (``server.py``), choosing a server and moving requests (``dispatch.py``), the push
itself (``weight_sync/``).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

from megatron_tepo.rollout.sglang.client import FleetError, RequestFailed, SGLangServer
from megatron_tepo.rollout.sglang.health import COUNTERS, Event, State, counter
from megatron_tepo.rollout.sglang.server import launch_server, stop_server, wait_ready

log = logging.getLogger(__name__)


class Supervision:
    """The fleet's part that keeps its servers alive (see the module docstring for what it owns)."""

    def _init_supervision(self) -> None:
        self._closing = threading.Event()
        self._counts: Dict[str, int] = {}
        self._restarters: List[threading.Thread] = []
        self._deferred: List[SGLangServer] = []  # colocated: dead servers restarted at the next weight sync
        self._steps_running = 0
        self._probe_round = threading.Lock()  # held by a monitor round and by a weight sync
        self._waited_for: Dict[int, int] = {}  # attached server id -> incarnation whose return was awaited

    def _start_monitor(self) -> None:
        self._monitor = threading.Thread(target=self._watch, name="sglang-health", daemon=True)
        self._monitor.start()

    def _step_running(self, delta: int) -> None:
        """A call that holds requests began (+1) or ended (-1): a ``generate`` or ``score`` call, or
        the submitted requests while any is in flight. The monitor probes only while one runs."""
        with self._lock:
            self._steps_running += delta

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
