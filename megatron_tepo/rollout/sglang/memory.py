"""The fleet's colocated mode (:class:`ColocatedMemory`, a part of
:class:`~megatron_tepo.rollout.sglang.fleet.SGLangFleet`): the servers share the actor's GPUs,
and give their memory back while the actor trains.

``release_memory`` / ``resume_memory`` post ``/release_memory_occupation`` /
``/resume_memory_occupation`` with the tags to every live server and return once every one has
answered (its memory is free, or taken back). The fleet keeps what it has released (its state)
and, per server incarnation, what that process has released (``SGLangServer.released``), and sends
each server only what changes it: releasing what is released, or resuming what is held, posts
nothing (SGLang itself would stop at a resume of a tag it holds, a ``KeyError`` in its scheduler).
A release first aborts whatever the server still runs (``/pause_generation``, mode abort; SGLang
asserts the server is idle) and lets it continue after. A server serves only when it holds all
its memory and valid weights: from a resume of its weights (their content is garbage) until a
weight sync has reached it, and while any of its memory is released, it is not picked and the
router is not used (``dispatch.py``). A server that comes back (restarted or returned: a new
process, all its memory held, its start-up weights) is brought to the fleet's state at the next
memory call or weight sync, whichever comes first (what the fleet has released is released on
it; a restart of the fleet's own does so as soon as the new process answers, so as to give the
GPU back to the actor: ``supervision.py``), and it is stale until a sync reached it, as always.
A release first waits for restarts under way. The initial state of attached servers a launcher
released before the trainer started: ``FleetConfig.released``.

Owns: ``_released`` (what the fleet has released), ``_colocated`` (set from the first release, or
by ``FleetConfig.released``; supervision reads it to defer restarts to a weight sync) and
``_memory_lock`` (one alignment at a time). Uses, beside the fleet's ``cfg`` and ``servers``:
``alive_servers`` and ``_describe_all`` (``dispatch.py``), ``_join_restarts`` and ``_probe_round``
(``supervision.py``).

Left out: when the phases release and resume (the trainer's colocated step, ``trainer/step.py``); restarts deferred to
a weight sync and the restart gate (``supervision.py``).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional, Sequence

from megatron_tepo.rollout.engine import MEMORY_TAGS
from megatron_tepo.rollout.sglang.client import FleetError, RequestFailed, SGLangServer
from megatron_tepo.rollout.sglang.health import Event


def memory_tags(tags: Iterable[str]) -> frozenset:
    """``tags`` as a set of :data:`~megatron_tepo.rollout.engine.MEMORY_TAGS` (an unknown one is an error)."""
    tags = frozenset([tags] if isinstance(tags, str) else tags)
    unknown = sorted(tags - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}: expected some of {MEMORY_TAGS}")
    return tags


class ColocatedMemory:
    """The fleet's part that releases and resumes its servers' memory (see the module docstring for
    what it owns)."""

    def _init_memory(self, released: Iterable[str]) -> None:
        """``released``: what the attached servers had released when the fleet attached."""
        self._memory_lock = threading.Lock()  # one memory alignment at a time (a restart's and the phases')
        self._released = memory_tags(released)  # what the fleet has released (colocated mode)
        self._colocated = bool(self._released)  # (or from the first release_memory on)
        for s in self.servers:
            s.set_memory(self._released, False)

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
