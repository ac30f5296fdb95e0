"""What every sandbox gives back and the rules they share: :class:`ToolResult`, the :class:`Sandbox`
protocol, the output cap (:class:`OutputCap`) and the messages the model reads.

A sandbox runs one piece of Python code, alone (nothing carries over from one call to the next),
and answers a :class:`ToolResult`: stdout and stderr, each cut to a byte budget with a marker that
says how much was cut; the exit status; which limit was hit, if any (``wall``, ``cpu``, ``memory``,
``processes``, ``output``, ``disk``); the seconds it took; and an error message fit to show the model
(``None`` when the code ran and exited 0). ``sandbox_failed`` says that the sandbox itself failed
(bwrap did not start, the remote service did not answer): a trainer's metric, never the model's doing.

Which limit was hit is read from what the kernel and Python leave behind, since rlimits (unlike a
cgroup) report nothing themselves: wall and output are the runner's own kills; ``cpu`` is death by
``SIGXCPU`` (``RLIMIT_CPU``'s soft limit); ``memory`` a ``MemoryError`` as the last line of stderr
(``RLIMIT_AS``); ``processes`` a failed fork, process spawn or thread start (``EAGAIN``,
``RLIMIT_NPROC``); ``disk`` ``ENOSPC`` on the sandbox's sized tmpfs (``EFBIG`` past ``RLIMIT_FSIZE``
without a sandbox). A program that catches these errors itself and exits 1 is
reported as exiting 1.

Standard library only. The implementations: :mod:`.processes` (bubblewrap, and the unsandboxed
local run), :mod:`.remote` (a SandboxFusion service); the settings: :mod:`.settings`; the choice:
:mod:`.choice`.
"""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

__all__ = ["LIMITS", "ToolResult", "Sandbox", "SandboxUnavailable", "OutputCap", "classify_exit", "limit_message"]

#: The limits a run can hit, in the words :attr:`ToolResult.limit` uses.
LIMITS = ("wall", "cpu", "memory", "processes", "output", "disk")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (bwrap missing, user namespaces forbidden, no service URL); the
    message is one line naming the setting to change. A user error for the command-line tools
    (``megatron_tepo/cli.py``: exit status 2, and a Slurm job is not requeued for it)."""


@dataclass(frozen=True)
class ToolResult:
    """One run of tool code. ``stdout``/``stderr`` are decoded UTF-8 (undecodable bytes replaced),
    already cut to the sandbox's ``shown_bytes`` each (head and tail kept, a marker between);
    ``stdout_cut``/``stderr_cut`` count the bytes left out (a lower bound when the run was stopped for
    its output). ``exit_code``: the process's status (128 + N for death by signal N), ``None`` when
    the sandbox stopped it or never started it. ``limit``: one of :data:`LIMITS` or ``None``.
    ``error``: the one line the model is shown besides the output, ``None`` on success.
    ``info``: what the sandbox says about the run, for logs and tests (bubblewrap: the sandbox's
    ``pid_namespace`` and ``child_pid``, ``leftover`` processes it had to kill after the run)."""
    stdout: str
    stderr: str
    exit_code: Optional[int]
    seconds: float
    limit: Optional[str] = None
    error: Optional[str] = None
    stdout_cut: int = 0
    stderr_cut: int = 0
    sandbox_failed: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


@runtime_checkable
class Sandbox(Protocol):
    """Runs Python code alone and says what happened. ``run`` is thread-safe: the episode runner
    calls it from a bounded pool of threads, many at once; a sandbox holds at most its
    ``max_concurrent`` runs at a time and queues the rest (the wall limit counts from a run's start,
    not its wait). ``close`` frees what the sandbox holds (idempotent)."""

    def run(self, code: str, *, stdin: str = "") -> ToolResult: ...

    def close(self) -> None: ...


class OutputCap:
    """One output stream, read in chunks and kept within ``shown`` bytes: its first ``shown // 2``
    bytes and its last ``shown - shown // 2``, with the count of what fell between. Never holds more
    than ``shown`` bytes plus one chunk, whatever the program prints."""

    def __init__(self, shown: int):
        self.shown = shown
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.shown // 2 - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            keep = self.shown - self.shown // 2
            self.tail += data
            if len(self.tail) > keep:
                del self.tail[:len(self.tail) - keep]

    @property
    def cut(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def text(self, stopped: bool = False) -> str:
        """The kept bytes as text; where bytes were cut, ``[... N bytes cut ...]`` between head and
        tail (``at least N`` when the program was stopped before it finished printing)."""
        head = bytes(self.head).decode("utf-8", errors="replace")
        tail = bytes(self.tail).decode("utf-8", errors="replace")
        if self.cut == 0 and not (stopped and self.tail):
            return head + tail
        n = f"at least {self.cut}" if stopped else str(self.cut)
        sep = "" if head.endswith("\n") or not head else "\n"
        return f"{head}{sep}[... {n} bytes cut ...]\n{tail}"


_LAST_LINE = re.compile(r"([^\n]*)\n*\Z")


def _last_line(text: str) -> str:
    m = _LAST_LINE.search(text)
    return m.group(1) if m else ""


def classify_exit(exit_code: Optional[int], stderr: str) -> Optional[str]:
    """Which limit an ended run hit, read from its exit status and the end of its stderr (see the
    module docstring); ``None`` when none did."""
    if exit_code is None or exit_code == 0:
        return None
    if exit_code == 128 + signal.SIGXCPU:
        return "cpu"
    last = _last_line(stderr)
    if last.startswith("MemoryError") or "Cannot allocate memory" in last:
        return "memory"
    if "No space left on device" in stderr or "File too large" in stderr:
        return "disk"
    if "can't start new thread" in stderr or ("Resource temporarily unavailable" in stderr and any(
            w in stderr for w in ("fork", "Popen", "spawn", "Thread", "_execute_child"))):
        return "processes"
    return None


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


#: a limit's name -> what the model reads when its code hit it (filled from the limits' values)
LIMIT_LINES = {
    "wall": "ran longer than its time limit ({wall_seconds:g} s) and was stopped.",
    "cpu": "used more than its CPU time limit ({cpu_seconds:g} s) and was stopped.",
    "memory": "ran out of memory (limit {memory_mb} MB).",
    "processes": "tried to run more than {processes} processes or threads.",
    "output": "printed more than {output_bytes} bytes and was stopped.",
    "disk": "wrote more than {tmp_mb} MB of files.",
}


def limit_message(limit: Optional[str], exit_code: Optional[int], limits: Mapping[str, Any]) -> Optional[str]:
    """The line the model reads about how its code ended: a limit it hit (with the limit's value from
    ``limits``: ``wall_seconds``, ``cpu_seconds``, ``memory_mb``, ``processes``, ``output_bytes``,
    ``tmp_mb``), else its exit status or killing signal; ``None`` for a clean exit."""
    if limit in LIMIT_LINES:
        return "Error: the code " + LIMIT_LINES[limit].format(**limits)
    if exit_code is None or exit_code == 0:
        return None
    if exit_code > 128:
        return f"Error: the code was killed by {_signal_name(exit_code - 128)}."
    return f"Error: the code exited with status {exit_code}."
