"""The fleet's interruptible generation (:class:`Interruptible`, a part of
:class:`~megatron_tepo.rollout.sglang.fleet.SGLangFleet`): partial rollout's ``submit`` /
``collect`` / ``interrupt`` of the :class:`~megatron_tepo.rollout.engine.RolloutEngine`.

Each sample is one request (``prompt + token_ids``, its remaining tokens), sent as ``generate``'s
are (``dispatch.py``: through the router where there is one, retried elsewhere), the request's key
its session (without the router, a multi-turn episode's next turn goes to the server of its last,
which holds its prefix, while that server has a free slot). As many are in
flight as the servers have running-request slots (each server's ``/server_info``, read at the
first submit: 0.5.23's effective limit per DP rank, else its ``--max-running-requests``, else
``FleetConfig.max_concurrency``), summed over the fleet and bounded by
:data:`MAX_PARTIAL_INFLIGHT` (``FleetConfig.partial_inflight`` sets it instead), so that the fleet
stays full; the rest wait here, one waiting thread each. An interrupt aborts every request on
every server until all have answered, each with its tokens so far and their log-probs; a weight
update refuses to run while any is generating. With routing replay (``FleetConfig.routing``: r3) each
request asks for its routing as ``generate``'s do (a multi-turn episode's turn is one request whose
input is the whole episode so far, ``rollout/episode.py``); an answer cut by an interrupt comes back
without it.

Owns: ``_partial_cv``, ``_partial_pool``, ``_partial_running``, ``_partial_done`` and
``_interrupting``. Uses, beside the fleet's ``cfg`` and ``servers``: ``_run_one``, ``call_timeout``,
``slots`` and ``alive_servers`` (``dispatch.py``), ``_step_running`` (``supervision.py``), ``_sample_of``
and ``routing_decoder`` (``fleet.py``: an answer read as a sample, its routing decoded).

Left out: the groups in flight, the staleness bound and a request's resumption (the driver's
rollout buffer, ``trainer/partial.py``; ``engine.Request``); the routing of an interrupted request
(its answer has none: partial rollout with r3 is refused in the config).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_tepo.rollout.engine import FINISH_ABORT, Request, Sample, SamplingParams, validate_prompts
from megatron_tepo.rollout.sglang.client import RequestFailed
from megatron_tepo.rollout.sglang.routing import ROUTING_REQUEST

log = logging.getLogger(__name__)

#: the most requests :meth:`SGLangFleet.submit` keeps in flight, whatever the servers' slots (one
#: waiting thread each)
MAX_PARTIAL_INFLIGHT = 4096


def _session_key(key):
    """A submitted request's key as a session (None when it is not hashable)."""
    try:
        hash(key)
    except TypeError:
        return None
    return key


class Interruptible:
    """The fleet's part that runs submitted requests (see the module docstring for what it owns)."""

    interruptible = True

    def _init_interruptible(self) -> None:
        # the requests submitted and not yet handed back
        self._partial_cv = threading.Condition()
        self._partial_pool: Optional[ThreadPoolExecutor] = None
        self._partial_running: Dict[int, Tuple[Request, Any]] = {}
        self._partial_done: List[Tuple[Request, Sample]] = []
        self._interrupting = threading.Event()

    def submit(self, requests: Sequence[Request], params: SamplingParams) -> None:
        """Each request as one ``/generate`` of one sample (``prompt + token_ids``, its remaining
        tokens), through the router where there is one, retried as :meth:`generate`'s are;
        :meth:`partial_inflight` of them in flight at once (the fleet's running-request slots), the
        rest waiting here."""
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
                           "return_logprob": True, "logprob_start_len": -1,
                           **(ROUTING_REQUEST if self.cfg.routing is not None else {})}
                if not self._partial_running:
                    self._step_running(+1)  # (the monitor probes the servers that hold requests)
                self._partial_running[id(r)] = (r, self._partial_pool.submit(self._run_partial, r, payload))

    def partial_inflight(self) -> int:
        """How many requests :meth:`submit` (and ``generate`` and ``score``: ``dispatch.py``'s ``_run_all``)
        keep in flight: ``FleetConfig.partial_inflight`` if set,
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
                                lambda out: self._sample_of(out, partial=self._interrupting.is_set()),
                                session=_session_key(r.key), raw=self.routing_decoder is not None)
        except Exception as exc:  # noqa: BLE001 -- cut by an interrupt, or failed: handed back either way
            seg = Sample([], [], FINISH_ABORT, meta={} if self._interrupting.is_set() else
                         {"error": f"{type(exc).__name__}: {exc}"})
        with self._partial_cv:
            if self._partial_running.pop(id(r), None) is not None:
                self._partial_done.append((r, seg))
                if not self._partial_running:
                    self._step_running(-1)
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

    def _refuse_while_generating(self) -> None:
        """A weight update's precondition: no submitted request is generating."""
        with self._partial_cv:
            if self._partial_running:
                raise RuntimeError(f"SGLangFleet.update_weights: {len(self._partial_running)} submitted requests are "
                                   f"generating; interrupt() them first (no token is generated under weights being "
                                   f"written)")

    def _drop_submitted(self) -> None:
        """On close: the requests still waiting here are not sent."""
        pool = getattr(self, "_partial_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
