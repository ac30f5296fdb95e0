"""The hang watchdog of one trainer process, and the job's exit-reason file.

A :class:`Watchdog` knows which *phase* the process is in (``generate``: waiting for a step's
rollout or an evaluation; ``collective``: old log-probs, policy updates, a checkpoint; ``sync``: a
weight sync) and the deadline of that phase's progress: ``with watchdog.phase("collective"): ...``
arms it, :meth:`Watchdog.beat` (one policy update done, say) pushes it back. The time-outs are
``fault.watchdog_<phase>_s`` (0: that phase is not watched); outside every phase nothing is
watched. A daemon thread checks the deadline; once it passes, the process

1. writes its exit reason (``{"reason": "watchdog", "requeue": true, ...}``, :func:`write_exit_reason`),
2. prints one line naming the phase, the seconds and the setting to raise, e.g.
   ``watchdog: no progress in phase 'collective' for 1800 s (fault.watchdog_collective_s) on rank 3``,
3. dumps the Python stack of every thread (``faulthandler``) to stderr and to this rank's own
   stacks file (:func:`stacks_path`: ``stacks.rank<r>.txt`` beside the exit-reason file; in the
   shared log the ranks' dumps, written at the same moment, can interleave character by
   character), and
4. kills its child processes and exits with :data:`WATCHDOG_EXIT` (75, ``EX_TEMPFAIL``: try
   again) without running any other cleanup (``os._exit``: a hung collective would block it).

Every rank runs its own watchdog. A rank that blocks in a collective because another one hangs
usually fires too; one that torchrun stops first (SIGTERM to the rest once one rank failed)
still dumps its stacks (``faulthandler`` registered on SIGTERM while a watchdog is open; into the
stacks file when there is one, else stderr). A C call that holds the GIL stops the checking
thread as well: ``faulthandler.dump_traceback_later`` is armed as a backstop at the phase's
time-out + :data:`BACKSTOP_GRACE_S`; it dumps the stacks (to the same place) and exits with
status 1, without the line or the exit-reason file (the job then treats it as a crash, which is
requeued too).

The exit-reason file: ``TEPO_EXIT_REASON_FILE`` (set by slurm/lib.sh, one per attempt); global
rank r > 0 writes ``<file>.rank<r>``. torchrun turns any child's failure into its own exit status
1, so the Slurm script reads this file to tell a retryable failure (``"requeue": true``: the
watchdog) from one that would fail again (``"requeue": false``: a run that stopped updating, a bad
setting or input); no file at all means a crash or a lost node (requeued).

Left out: progress *inside* a single C call (one collective that is slow but alive looks hung
once it outlasts its phase's time-out: size the time-outs for the slowest honest step) and
restarting anything itself (the job requeues).
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from megatron_tepo.config import WATCHDOG_BACKSTOP_S

WATCHDOG_EXIT = 75  # EX_TEMPFAIL: the watchdog stopped a hung process; retry (requeue)
BACKSTOP_GRACE_S = WATCHDOG_BACKSTOP_S  # faulthandler's backstop fires this long after the watchdog should have
PHASES = ("generate", "collective", "sync")
EXIT_REASON_ENV = "TEPO_EXIT_REASON_FILE"


def process_group_timeout_s(fault) -> float:
    """The process groups' time-out for ``fault`` (:meth:`~megatron_tepo.config.FaultConfig.process_group_timeout_s`:
    longer than the longest phase this watchdog guards)."""
    return fault.process_group_timeout_s()


def _rank(rank: Optional[int]) -> int:
    """``rank``, or this process's global rank (env ``RANK``, default 0)."""
    return int(os.environ.get("RANK", "0")) if rank is None else rank


def exit_reason_path(rank: Optional[int] = None) -> Optional[str]:
    """Where this process writes its exit reason (None when ``TEPO_EXIT_REASON_FILE`` is unset):
    the file itself on global rank 0, ``<file>.rank<r>`` on rank r (default: env ``RANK``)."""
    path = os.environ.get(EXIT_REASON_ENV)
    if not path:
        return None
    rank = _rank(rank)
    return path if rank == 0 else f"{path}.rank{rank}"


def stacks_path(rank: Optional[int] = None) -> Optional[str]:
    """This rank's stack-dump file, ``stacks.rank<r>.txt`` in the exit-reason file's folder (None
    when ``TEPO_EXIT_REASON_FILE`` is unset)."""
    path = exit_reason_path(0)
    if path is None:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(path)), f"stacks.rank{_rank(rank)}.txt")


def write_exit_reason(reason: str, requeue: bool, message: str, rank: Optional[int] = None) -> Optional[str]:
    """One JSON line ``{"reason", "requeue", "message", "rank"}`` into :func:`exit_reason_path`
    (nothing when it is unset); returns the path written. Never raises: it runs on the way out."""
    path = exit_reason_path(rank)
    if path is None:
        return None
    rank = _rank(rank)
    line = json.dumps({"reason": reason, "requeue": bool(requeue), "message": message, "rank": rank})
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError as exc:
        print(f"could not write the exit reason to {path}: {exc}", file=sys.stderr, flush=True)
        return None
    return path


def _kill_children() -> None:
    """SIGKILL every descendant of this process: ``os._exit`` runs no cleanup, and a child left
    behind (megatron's checkpoint manager, a reward pool) would keep the Slurm step's output open,
    so the step, and the job, would never end."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 -- no psutil: the multiprocessing children at least
        import multiprocessing

        children = multiprocessing.active_children()
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()


class Watchdog:
    """The phase/deadline state of one process, and (``start=True``) the thread that acts on it.

    ``timeouts``: seconds per phase (:data:`PHASES`; 0 or missing: not watched). ``clock``: a
    monotonic clock (tests inject one and call :meth:`overdue` themselves with ``start=False``,
    which starts no thread and touches no process-wide ``faulthandler`` state)."""

    def __init__(self, timeouts: Dict[str, float], rank: int = 0, *, clock: Callable[[], float] = time.monotonic,
                 start: bool = True, grace_s: float = BACKSTOP_GRACE_S):
        unknown = set(timeouts) - set(PHASES)
        if unknown:
            raise ValueError(f"watchdog: unknown phase(s) {sorted(unknown)}; the phases are {list(PHASES)}")
        for name, seconds in timeouts.items():
            if not seconds >= 0:  # (NaN too)
                raise ValueError(f"fault.watchdog_{name}_s: expected seconds >= 0 (0: off), got {seconds}")
        self.timeouts = {p: float(timeouts.get(p, 0.0)) for p in PHASES}
        self.rank = rank
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stack: List[str] = []  # the phases entered, innermost last
        self._deadline: Optional[float] = None
        self._closed = threading.Event()
        self._thread = None
        self._active = start and any(self.timeouts.values())
        self._stacks = None  # this rank's stacks file, open while watching (faulthandler needs an fd)
        if self._active:
            on = [t for t in self.timeouts.values() if t > 0]
            self._poll = max(0.05, min(1.0, min(on) / 10))
            path = stacks_path(rank)
            if path is not None:
                try:
                    self._stacks = open(path, "a", encoding="utf-8")
                except OSError as exc:
                    print(f"watchdog: cannot open {path} ({exc}); stacks go to stderr only", file=sys.stderr)
            self._thread = threading.Thread(target=self._watch, name="mtepo-watchdog", daemon=True)
            self._thread.start()
            with contextlib.suppress(AttributeError, RuntimeError, ValueError):  # (no SIGTERM on some platforms)
                faulthandler.register(signal.SIGTERM, file=self._dump_file, all_threads=True, chain=True)

    @property
    def _dump_file(self):
        """Where the signal-time dumps go: the stacks file, else stderr."""
        return self._stacks if self._stacks is not None else sys.stderr

    @classmethod
    def from_config(cls, fault, rank: int = 0, **kwargs) -> "Watchdog":
        """From ``cfg.fault`` (:class:`~megatron_tepo.config.FaultConfig`)."""
        return cls({p: getattr(fault, f"watchdog_{p}_s") for p in PHASES}, rank, **kwargs)

    # -- the state -------------------------------------------------------------------------
    @property
    def current(self) -> Optional[str]:
        """The innermost phase entered and not left (None: outside every phase)."""
        return self._stack[-1] if self._stack else None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Watch ``name`` from now: no :meth:`beat` for its time-out -> the process stops. Phases
        nest; leaving one re-arms the enclosing phase with a fresh deadline."""
        if name not in PHASES:
            raise ValueError(f"watchdog: unknown phase {name!r}; the phases are {list(PHASES)}")
        with self._lock:
            self._stack.append(name)
            self._arm()
        try:
            yield
        finally:
            with self._lock:
                self._stack.pop()
                self._arm()

    def beat(self) -> None:
        """Progress in the current phase: its deadline starts again."""
        with self._lock:
            self._arm()

    def overdue(self) -> Optional[Tuple[str, float]]:
        """(phase, its time-out) when the current phase's deadline has passed, else None."""
        with self._lock:
            if self._deadline is None or self._clock() < self._deadline:
                return None
            return self.current, self.timeouts[self.current]

    def _arm(self) -> None:  # (under the lock)
        timeout = self.timeouts[self.current] if self.current else 0.0
        self._deadline = self._clock() + timeout if timeout > 0 else None
        if self._active and not self._closed.is_set():
            if self._deadline is None:
                faulthandler.cancel_dump_traceback_later()
            else:
                faulthandler.dump_traceback_later(timeout + self.grace_s, exit=True, file=self._dump_file)

    # -- the thread ------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed.wait(self._poll):
            late = self.overdue()
            if late is not None:
                self.expire(*late)

    def message(self, phase: str, timeout: float) -> str:
        return (f"watchdog: no progress in phase '{phase}' for {timeout:g} s (fault.watchdog_{phase}_s) "
                f"on rank {self.rank}")

    def expire(self, phase: str, timeout: float) -> None:
        """Stop the process: the exit reason, the line, every thread's stack, ``WATCHDOG_EXIT``."""
        line = self.message(phase, timeout)
        write_exit_reason("watchdog", True, line, self.rank)
        try:
            also = f" (and are in {self._stacks.name})" if self._stacks is not None else ""
            print(f"{line}; the Python stacks of this process (pid {os.getpid()}) follow{also}", file=sys.stderr,
                  flush=True)
            if self._stacks is not None:
                with contextlib.suppress(Exception):
                    self._stacks.write(f"{line}; pid {os.getpid()}\n")
                    self._stacks.flush()
                    faulthandler.dump_traceback(file=self._stacks, all_threads=True)
                    self._stacks.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            _kill_children()
        finally:
            os._exit(WATCHDOG_EXIT)

    def close(self) -> None:
        """Stop watching (the thread ends; the backstop and the SIGTERM dump are removed)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._active:
            faulthandler.cancel_dump_traceback_later()
            with contextlib.suppress(AttributeError, RuntimeError, ValueError):
                faulthandler.unregister(signal.SIGTERM)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
            if self._stacks is not None:  # (an empty one: nothing was dumped)
                with contextlib.suppress(OSError):
                    empty = self._stacks.tell() == 0
                    self._stacks.close()
                    if empty:
                        os.remove(self._stacks.name)

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
