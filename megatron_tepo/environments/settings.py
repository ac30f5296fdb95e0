"""The sandbox's settings: :class:`SandboxConfig`, one typed section for the run config (the choice
of sandbox from them is :func:`~.choice.make_sandbox`).

``kind`` picks the sandbox: ``bubblewrap`` (the default: Debian's bwrap on this machine,
:class:`~.processes.BubblewrapSandbox`), ``remote`` (a SandboxFusion service at ``remote_url``, for
clusters that forbid user namespaces, :class:`~.remote.RemoteSandbox`) or ``none`` (no isolation,
:class:`~.processes.LocalSubprocessSandbox`: an explicit choice, said in a warning line when the
sandbox is made). The limits hold for every kind, as far as it can hold them (the remote service
takes the wall time and the memory; the output is cut on this side). Every check is one line that
names the field (``sandbox.<field>``, or the prefix the caller gives).

Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Tuple

__all__ = ["SANDBOX_KINDS", "SandboxConfig"]

SANDBOX_KINDS = ("bubblewrap", "remote", "none")


@dataclass
class SandboxConfig:
    """Where and under which limits tool code runs.

    - ``kind``: ``bubblewrap`` | ``remote`` | ``none`` (see the module docstring).
    - ``wall_seconds``: the run is stopped (its whole process tree) this long after it started.
    - ``cpu_seconds``: CPU time per process (``RLIMIT_CPU``; whole seconds).
    - ``memory_mb``: address space per process (``RLIMIT_AS``); the remote service's ``memory_limit_MB``.
    - ``processes``: processes and threads in the sandbox (``RLIMIT_NPROC`` inside its own user
      namespace; bubblewrap only).
    - ``output_bytes``: stdout and stderr together; past it the run is stopped.
    - ``shown_bytes``: what is kept of each stream for the model (its head and tail).
    - ``tmp_mb``: the size of the sandbox's private ``/tmp`` (its working folder) and of its ``/dev/shm``.
    - ``python``: the interpreter the code runs under; with bubblewrap it must live under a folder the
      sandbox binds read-only (``/usr``, or one of ``ro_binds``). Default: the system's ``/usr/bin/python3``
      with the packages the system installed (``apt-get install python3-numpy python3-sympy`` ...).
    - ``ro_binds``: more host folders bound read-only at the same path (an interpreter's own tree).
    - ``bwrap``: the bubblewrap executable.
    - ``run_as_uid``: the uid bwrap runs as when the trainer runs as the host's root (``RLIMIT_NPROC``
      binds no process of the host's uid 0, so such a trainer's sandboxes run as this uid; 65534 is
      ``nobody``). A trainer that is root only inside a user namespace mapping uid 0 to another host
      uid (enroot/pyxis ``--container-remap-root``) runs bwrap as itself, and this is not used.
    - ``remote_url``: the SandboxFusion service's base URL (``http://host:8080``; ``/run_code`` is added).
    - ``remote_retries``: tries of one run on a connection error, a time-out, HTTP 429/5xx or the
      service's ``SandboxError``; ``remote_timeout_margin_s``: added to ``wall_seconds`` for one HTTP
      request's time-out.
    - ``max_concurrent``: runs at once per sandbox (the tool pool's size); more wait their turn.
    """
    kind: str = "bubblewrap"
    wall_seconds: float = 20.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    processes: int = 32
    output_bytes: int = 1 << 20
    shown_bytes: int = 4096
    tmp_mb: int = 64
    python: str = "/usr/bin/python3"
    ro_binds: Tuple[str, ...] = ()
    bwrap: str = "bwrap"
    run_as_uid: int = 65534
    remote_url: str = ""
    remote_retries: int = 3
    remote_timeout_margin_s: float = 30.0
    max_concurrent: int = 8

    def check(self, where: str = "sandbox") -> "SandboxConfig":
        """Raises ``ValueError`` with one line naming the first bad field (``{where}.{field}``);
        returns ``self``."""
        def bad(name, why):
            raise ValueError(f"{where}.{name}: {why}, got {getattr(self, name)!r}")

        if self.kind not in SANDBOX_KINDS:
            bad("kind", f"must be one of {', '.join(SANDBOX_KINDS)}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int)):
                bad(f.name, "must be an integer")
            if f.type == "float" and (isinstance(v, bool) or not isinstance(v, (int, float))):
                bad(f.name, "must be a number")
        for name in ("wall_seconds", "cpu_seconds", "memory_mb", "processes", "output_bytes", "shown_bytes",
                     "tmp_mb", "remote_retries", "max_concurrent"):
            if getattr(self, name) <= 0:
                bad(name, "must be > 0")
        if self.run_as_uid <= 0:
            bad("run_as_uid", "must be > 0 (the kernel bounds no process count of uid 0)")
        if self.remote_timeout_margin_s < 0:
            bad("remote_timeout_margin_s", "must be >= 0")
        if self.memory_mb < 64:
            bad("memory_mb", "must be >= 64 (Python itself needs about 30 MB of address space)")
        if self.processes < 2:
            bad("processes", "must be >= 2 (the sandbox's init and the code)")
        if self.shown_bytes > self.output_bytes:
            bad("shown_bytes", f"must be <= output_bytes ({self.output_bytes})")
        if not self.python.startswith("/"):
            bad("python", "must be an absolute path")
        if any(not isinstance(p, str) or not p.startswith("/") for p in self.ro_binds):
            bad("ro_binds", "must be absolute paths")
        if self.kind == "remote" and not self.remote_url.startswith(("http://", "https://")):
            bad("remote_url", "kind 'remote' needs the service's http(s):// URL")
        return self
