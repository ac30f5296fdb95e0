"""The health of one SGLang server as a pure state machine: its states, the events that move it,
and the table of allowed transitions.

States:

* ``healthy`` -- takes requests and weight updates.
* ``suspect`` -- a request to it failed, or a probe went unanswered: it takes no new request
  until a probe answers (back to ``healthy``) or fails again (``dead``).
* ``dead`` -- its process exited, its connection was refused, or a suspect failed its probe. In
  launch mode the fleet restarts it (bounded attempts, back-off); in attach mode the job that
  started it does (slurm/lib.sh), and the fleet waits a bounded time for it at the next sync.
* ``restarting`` -- a new process is starting (launch mode).
* ``stale`` -- up again but holding weights older than the fleet's: it takes no request and is
  kept away from the router until a weight sync reaches it (then ``healthy``).

Only ``healthy`` serves. A server is never ``healthy`` after a restart or a return without a
sync in between: the table has no path from ``dead``/``restarting``/``stale`` to ``healthy``
except ``synced``.

Left out: probing, restarting and syncing (the fleet's supervision, ``supervision.py``, does them
and reports the events here).
"""
from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple


class State(str, enum.Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DEAD = "dead"
    RESTARTING = "restarting"
    STALE = "stale"


class Event(str, enum.Enum):
    REQUEST_FAILED = "request_failed"  # a request timed out or got a 5xx
    PROBE_OK = "probe_ok"              # a one-token generation answered in time
    PROBE_FAILED = "probe_failed"      # it did not
    EXITED = "exited"                  # process gone / connection refused
    RESTART = "restart"                # launch mode: a new process is started
    READY = "ready"                    # the new process (or a returned attached server) answers
    START_FAILED = "start_failed"      # the new process did not come up
    SYNCED = "synced"                  # a weight sync reached it
    SYNC_FAILED = "sync_failed"        # a weight sync to it failed


S, E = State, Event
TRANSITIONS: Dict[Tuple[State, Event], State] = {
    (S.HEALTHY, E.REQUEST_FAILED): S.SUSPECT,
    (S.HEALTHY, E.PROBE_OK): S.HEALTHY,
    (S.HEALTHY, E.PROBE_FAILED): S.SUSPECT,
    (S.HEALTHY, E.EXITED): S.DEAD,
    (S.HEALTHY, E.SYNCED): S.HEALTHY,
    (S.HEALTHY, E.SYNC_FAILED): S.DEAD,
    (S.SUSPECT, E.REQUEST_FAILED): S.SUSPECT,
    (S.SUSPECT, E.PROBE_OK): S.HEALTHY,
    (S.SUSPECT, E.PROBE_FAILED): S.DEAD,
    (S.SUSPECT, E.EXITED): S.DEAD,
    (S.SUSPECT, E.SYNCED): S.SUSPECT,   # it got the weights; it still has to answer a probe
    (S.SUSPECT, E.SYNC_FAILED): S.DEAD,
    (S.DEAD, E.REQUEST_FAILED): S.DEAD,
    (S.DEAD, E.PROBE_FAILED): S.DEAD,
    (S.DEAD, E.EXITED): S.DEAD,
    (S.DEAD, E.RESTART): S.RESTARTING,
    (S.DEAD, E.READY): S.STALE,         # attach mode: it came back (restarted by its job)
    (S.RESTARTING, E.READY): S.STALE,
    (S.RESTARTING, E.START_FAILED): S.DEAD,
    (S.RESTARTING, E.EXITED): S.DEAD,
    (S.STALE, E.SYNCED): S.HEALTHY,
    (S.STALE, E.SYNC_FAILED): S.DEAD,
    (S.STALE, E.EXITED): S.DEAD,
    (S.STALE, E.PROBE_FAILED): S.DEAD,
    (S.STALE, E.REQUEST_FAILED): S.STALE,
}

SERVING = frozenset({S.HEALTHY})                            # takes requests
REACHABLE = frozenset({S.HEALTHY, S.SUSPECT, S.STALE})       # a weight sync goes to it


class TransitionError(RuntimeError):
    """An event that the table does not allow in the current state (a bug in the caller)."""


def next_state(state: State, event: Event) -> State:
    """The state after ``event``; an event the table does not list for ``state`` is an error."""
    try:
        return TRANSITIONS[(State(state), Event(event))]
    except KeyError:
        raise TransitionError(f"server health: no transition from {State(state).value!r} on "
                              f"{Event(event).value!r}") from None


@dataclass
class Transition:
    time: float
    old: State
    event: Event
    new: State
    why: str = ""


@dataclass
class ServerHealth:
    """One server's state, its transitions (with times and reasons), and counters the step
    metrics read. Thread-safe: request threads, the probe and the restarter all report here.
    ``on_change(server_health, transition)`` is called for every change of state."""
    state: State = S.HEALTHY
    history: List[Transition] = field(default_factory=list)
    restarts: int = 0           # restarts started (launch mode)
    incarnation: int = 0        # +1 every time it comes back (a new process: new update group, ...)
    on_change: Optional[Callable[["ServerHealth", Transition], None]] = None
    clock: Callable[[], float] = time.monotonic
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fire(self, event: Event, why: str = "") -> State:
        """Apply ``event``; returns the new state."""
        with self._lock:
            old = self.state
            new = next_state(old, event)
            t = Transition(self.clock(), old, Event(event), new, why)
            self.history.append(t)
            self.state = new
            if event == E.RESTART:
                self.restarts += 1
            if new == S.STALE and old in (S.DEAD, S.RESTARTING):
                self.incarnation += 1
        if new != old and self.on_change is not None:
            self.on_change(self, t)
        return new

    def since(self, state: State) -> Optional[float]:
        """When it last entered ``state`` (None: never)."""
        for t in reversed(self.history):
            if t.new == state and t.old != state:
                return t.time
        return None

    @property
    def serving(self) -> bool:
        return self.state in SERVING

    @property
    def reachable(self) -> bool:
        return self.state in REACHABLE


def counter(t: Transition) -> Optional[str]:
    """The step-metric counter a change of state adds one to (None: not counted)."""
    if t.new == S.HEALTHY:
        return "fleet_resynced" if t.old == S.STALE else "fleet_recovered"
    return {S.SUSPECT: "fleet_suspected", S.DEAD: "fleet_died", S.RESTARTING: "fleet_restarts",
            S.STALE: "fleet_returned"}[t.new]


COUNTERS = ("fleet_suspected", "fleet_died", "fleet_restarts", "fleet_returned", "fleet_resynced",
            "fleet_recovered")
