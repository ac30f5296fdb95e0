"""Tool code in a local process: in Debian's bubblewrap (:class:`BubblewrapSandbox`, the default), or
with no isolation at all (:class:`LocalSubprocessSandbox`, only on an explicit setting).

**bubblewrap.** Each run is a fresh ``bwrap`` sandbox, gone when the run ends:

- namespaces: all of them unshared (user, mount, PID, network, IPC, UTS, cgroup), and no further user
  namespace inside (``--disable-userns``). The network namespace has only its own loopback: no
  connection reaches the host's (127.0.0.1 included) or anything beyond; abstract UNIX sockets are
  per network namespace too.
- files: the system's ``/usr`` read-only (with the ``/bin``, ``/lib``... links or folders of the host,
  and the ``ro_binds`` of the settings), a fresh ``/proc`` showing only the sandbox's processes, a
  minimal ``/dev`` (read-only), and a private ``/tmp`` (a tmpfs of ``tmp_mb``, the working folder and
  ``HOME``, where the code is written as ``/tmp/main.py``) and ``/dev/shm`` of the same size. The
  root is read-only. Nothing else of the host: not ``/work``, ``/root``, ``/home``, the host's
  ``/tmp``, ``/etc``, the checkout or the venvs. What the code writes lives in memory and goes with
  the sandbox.
- environment: empty but for ``PATH``, ``HOME``/``TMPDIR`` (``/tmp``), ``LANG=C.UTF-8``,
  ``PYTHONDONTWRITEBYTECODE`` and one thread for the numeric libraries.
- interpreter: the settings' ``python``, by default the system's ``/usr/bin/python3`` with the
  packages the system installed (not the trainer's venv).
- limits: a bootstrap sets ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_NOFILE`` and
  ``RLIMIT_CORE`` and then ``exec``s the code, so they hold for it and all it starts. The process
  limit holds because the sandbox has its own user namespace (the kernel counts processes per user
  namespace and uid) and its uid maps to a uid other than 0: a trainer running as the host's root
  starts bwrap as ``run_as_uid`` (``nobody``), since the kernel enforces ``RLIMIT_NPROC`` on no
  process of the host's uid 0. A trainer that is root only in a user namespace mapping its uid 0 to
  another host uid (enroot's and pyxis's ``--container-remap-root``: ``0 <uid> 1``, no other uid
  mapped, so no switch to ``run_as_uid`` could work) starts bwrap as itself: the kernel counts the
  sandbox's processes against that host uid (seen here under ``unshare --user --map-root-user`` as
  uid 1000). Where the switch is needed and ``run_as_uid`` is not mapped (a container whose root is
  the host's, with a root-only map), the error names ``run_as_uid``; a container that masks
  ``/proc`` (Docker's default: bwrap's "Can't mount proc") has its own line. ``RLIMIT_NPROC``
  counts per user namespace only from Linux 5.14: on older kernels all the sandboxes (and every
  other process of their uid) share one count, said once in a warning when a sandbox is made
  (:func:`nproc_caveat`).
  Memory is bound per process (``RLIMIT_AS``), so a sandbox holds at most ``processes x memory_mb``
  plus its tmpfs; a cgroup would bound the sum, but clusters rarely delegate one to the job (this
  machine's cgroup v1 is writable by root; its cgroup v2 has no memory controller; neither is relied
  on). The sum of the sandboxes at once is bounded by the launch instead: the fit check refuses more
  than a share of the driver node's memory (``megatron_tepo/launch/fit.py``).
  Output is read as it comes, kept within ``shown_bytes`` per stream, and the run is stopped past
  ``output_bytes``. Wall time: the sandbox's PID 1 is killed, which makes the kernel kill every
  process of its PID namespace; bwrap exits with it (``--die-with-parent`` also kills the sandbox
  when bwrap or the thread that started it dies). A run ends when its main process ends: bwrap's
  PID 1 then exits and takes the rest with it.
- afterwards: where the runner had to kill, it looks for processes left in the sandbox's PID
  namespace (:func:`processes_in_pid_namespace`), kills them and says so in the result's ``info``
  and the log.
- the check at construction: one trial run; if bwrap cannot start here (user namespaces
  forbidden), :class:`~.sandbox.SandboxUnavailable` with one line naming the settings.

Left out: seccomp filters (the namespaces and the dropped capabilities are the isolation); a cgroup;
a persistent interpreter (each run starts Python afresh: a run of ``print(1)`` costs about 0.1 s
here).

**No sandbox** (``kind: none``): the code runs as the trainer's user in a temporary folder, with an
empty environment, ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE`` (``tmp_mb`` per file), the output
cap and the wall time on its process group. It sees the trainer's files and network, its process
count is unbounded (``RLIMIT_NPROC`` would count the trainer's own threads), and a child that leaves
its process group outlives the run. A warning line says so when it is made.

Thread-safe: each run has its own processes, pipes and files; a semaphore holds the runs at
``max_concurrent``. Standard library only.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from megatron_tepo.environments.namespaces import host_uid, nproc_caveat, read_uid_map
from megatron_tepo.environments.sandbox import (OutputCap, SandboxUnavailable, ToolResult, classify_exit,
                                                limit_message)
from megatron_tepo.environments.settings import SandboxConfig

__all__ = ["BubblewrapSandbox", "LocalSubprocessSandbox", "processes_in_pid_namespace", "SANDBOX_ENV", "read_uid_map",
           "host_uid", "nproc_caveat"]

log = logging.getLogger(__name__)

#: The environment tool code sees in the sandbox (``HOME``/``TMPDIR`` are its working folder).
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}

# Run by the tool's interpreter before the code: sets the limits (given as ``name=soft:hard``
# arguments), then execs the rest of the command line, so that the limits hold for the code and
# every process it starts. A failure here is the sandbox's, said with the _BOOT_FAILED prefix.
_BOOT_FAILED = "sandbox-bootstrap:"
_BOOT = (
    "import os, resource, sys\n"
    "try:\n"
    "    n = sys.argv.index('--')\n"
    "    for a in sys.argv[1:n]:\n"
    "        k, v = a.split('=')\n"
    "        s, h = v.split(':')\n"
    "        resource.setrlimit(getattr(resource, k), (int(s), int(h)))\n"
    "    os.execv(sys.argv[n + 1], sys.argv[n + 1:])\n"
    "except Exception as e:\n"
    f"    sys.stderr.write('{_BOOT_FAILED} %s\\n' % e)\n"
    "    os._exit(125)\n"
)

# The run's first process, on the host, between the trainer and the sandbox: a child subreaper
# (PR_SET_CHILD_SUBREAPER) that dies with the thread that started it (PR_SET_PDEATHSIG), starts the
# rest of its command line, waits for it, and then reaps every process orphaned to it before it
# exits with the command's status (128 + N for death by signal N). bwrap's monitor exits as soon as
# it learns the sandbox's status, orphaning the sandbox's PID 1 while the kernel still tears the PID
# namespace down: without a reaper each run left a zombie for the host's init to reap, and an init
# that does not (this machine's) piles up one per tool call. So a run ends when the sandbox is
# gone. It keeps no file open (the pipes' ends are the command's). Arguments: the trainer's pid (if
# the reaper's parent is already another, it exits), 1 to start the command in a new session and
# kill that session when the command ends (the unsandboxed run), then the command.
_REAPER = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.prctl(36, 1, 0, 0, 0)\n"
    "libc.prctl(1, 9, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(125)\n"
    "session = sys.argv[2] == '1'\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    try:\n"
    "        if session:\n"
    "            os.setsid()\n"
    "        os.execv(sys.argv[3], sys.argv[3:])\n"
    "    except OSError as e:\n"
    f"        os.write(2, ('{_BOOT_FAILED} %s: %s\\n' % (sys.argv[3], e)).encode())\n"
    "        os._exit(125)\n"
    "os.closerange(0, os.sysconf('SC_OPEN_MAX'))\n"
    "status = os.waitpid(pid, 0)[1]\n"
    "if session:\n"
    "    try:\n"
    "        os.killpg(pid, 9)\n"
    "    except OSError:\n"
    "        pass\n"
    "while True:\n"
    "    try:\n"
    "        os.waitpid(-1, 0)\n"
    "    except ChildProcessError:\n"
    "        break\n"
    "    except InterruptedError:\n"
    "        pass\n"
    "code = os.waitstatus_to_exitcode(status)\n"
    "os._exit(code if code >= 0 else 128 - code)\n"
)

_CHUNK = 1 << 16


def _pid_namespace(pid: int) -> Optional[int]:
    """The inode of ``pid``'s PID namespace, ``None`` if it is gone (or a zombie) or unreadable."""
    try:
        link = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return int(link[len("pid:["):-1]) if link.startswith("pid:[") else None


def processes_in_pid_namespace(inode: int) -> List[int]:
    """The host's PIDs of the live processes in the PID namespace ``inode`` (a sandbox's, from its
    result's ``info["pid_namespace"]``): empty once a sandbox is gone."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _pid_namespace(int(name)) == inode:
            found.append(int(name))
    return found


_SAID: set = set()  # the caveats said in this process (once each)
_SAID_LOCK = threading.Lock()


def _say_once(line: Optional[str]) -> None:
    if line is None:
        return
    with _SAID_LOCK:
        if line in _SAID:
            return
        _SAID.add(line)
    log.warning("%s", line)


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3, or not Linux: poll instead
        return None


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> List[int]:
    """``pid``'s child processes."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: every process's parent
        found = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(name))
        return found


class _ProcessSandbox:
    """What both local sandboxes share: the slots, the limits' values for the messages, and one run's
    supervision (:meth:`_execute`: spawn, read the pipes under the output cap and the wall time,
    stop, classify)."""

    def __init__(self, cfg: SandboxConfig, where: str):
        self.cfg = cfg
        self.where = where
        self._slots = threading.BoundedSemaphore(cfg.max_concurrent)
        self._limits = {k: getattr(cfg, k) for k in ("wall_seconds", "cpu_seconds", "memory_mb", "processes",
                                                   "output_bytes", "tmp_mb")}
        self._closed = False

    def run(self, code: str, *, stdin: str = "") -> ToolResult:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.run after close()")
        with self._slots:
            return self._run(code, stdin)

    def close(self) -> None:
        self._closed = True

    # -- hooks --------------------------------------------------------------------------------
    def _run(self, code: str, stdin: str) -> ToolResult:
        raise NotImplementedError

    def _stop(self, proc: subprocess.Popen, info: dict) -> None:
        """Kill the run's whole process tree below the reaper (``proc``), which then reaps it and exits."""
        raise NotImplementedError

    def _after_kill(self, info: dict) -> None:
        """After a kill: look for what is left, kill it, say so in ``info``."""

    def _started(self, info: dict) -> bool:
        """Whether the code was started (else an exit is the sandbox's failure, not the code's)."""
        return True

    def _boot_args(self, nproc: bool) -> List[str]:
        c = self.cfg
        mem = c.memory_mb << 20
        lims = [f"RLIMIT_CPU={c.cpu_seconds}:{c.cpu_seconds + 1}", f"RLIMIT_AS={mem}:{mem}", "RLIMIT_CORE=0:0",
                "RLIMIT_NOFILE=256:256"]
        if nproc:
            lims.append(f"RLIMIT_NPROC={c.processes}:{c.processes}")
        else:
            lims.append(f"RLIMIT_FSIZE={c.tmp_mb << 20}:{c.tmp_mb << 20}")
        return ["-I", "-S", "-c", _BOOT, *lims, "--"]

    # -- one run ------------------------------------------------------------------------------
    def _execute(self, argv: List[str], *, stdin: str, env: Optional[Dict[str, str]], cwd: str,
                 pass_fds: Tuple[int, ...] = (), info_fd: Optional[int] = None,
                 close_after_spawn: Tuple[int, ...] = (), new_session: bool = False, popen_kw=None) -> ToolResult:
        """Runs ``argv`` under the reaper (``_REAPER``; ``new_session``: in a session of its own, killed
        whole when ``argv`` ends) and supervises it to its end. ``info_fd``: the read end of bwrap's
        ``--info-fd`` pipe (closed here); ``close_after_spawn``: this side's copies of what only the
        child needs (the pipe's write end), closed here once the child has them."""
        cfg = self.cfg
        out, err = OutputCap(cfg.shown_bytes), OutputCap(cfg.shown_bytes)
        info: dict = {}
        info_buf = bytearray()
        start = time.monotonic()
        deadline = start + cfg.wall_seconds
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            argv = [self.cfg.python, "-I", "-S", "-c", _REAPER, str(os.getpid()), "1" if new_session else "0", *argv]
            try:
                proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        env=env, cwd=cwd, pass_fds=pass_fds, close_fds=True,
                                        start_new_session=True, **(popen_kw or {}))
            except OSError as e:
                if info_fd is not None:
                    os.close(info_fd)
                return self._failed(f"{argv[0]} did not start: {e}", time.monotonic() - start)
            finally:
                for fd in close_after_spawn:
                    os.close(fd)
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        sel = selectors.DefaultSelector()
        pidfd = _pidfd(proc.pid)
        killed_for = None
        exited = False
        try:
            for fd in streams:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            if info_fd is not None:
                sel.register(info_fd, selectors.EVENT_READ)
            if pidfd is not None:
                sel.register(pidfd, selectors.EVENT_READ)
            total = 0
            while killed_for is None and any(fd in sel.get_map() for fd in streams):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if not exited:
                        killed_for = "wall"
                    break
                for key, _ in sel.select(remaining if pidfd is not None else min(remaining, 0.25)):
                    fd = key.fd
                    if fd == pidfd:
                        sel.unregister(fd)
                        exited = True
                        continue
                    try:
                        data = os.read(fd, _CHUNK)
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(fd)
                        continue
                    if fd == info_fd:
                        info_buf += data
                        info.update(_parse_info(info_buf))
                        continue
                    streams[fd].add(data)
                    total += len(data)
                    if total > cfg.output_bytes:
                        killed_for = "output"
                        break
                if pidfd is None and not exited and proc.poll() is not None:
                    exited = True
            if killed_for is None:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    killed_for = "wall"
            if killed_for is not None:
                self._stop(proc, info)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:  # not seen; the kernel's teardown is prompt
                    proc.kill()
                    proc.wait()
                self._after_kill(info)
        finally:
            sel.close()
            for fd in (pidfd, info_fd):
                if fd is not None:
                    os.close(fd)
            proc.stdout.close()
            proc.stderr.close()
            if proc.returncode is None:  # an exception above: never leave a sandbox behind
                self._stop(proc, info)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        seconds = time.monotonic() - start
        return self._result(proc, out, err, killed_for, info, seconds)

    def _result(self, proc, out: OutputCap, err: OutputCap, killed_for, info: dict, seconds: float) -> ToolResult:
        rc = proc.returncode
        exit_code = None if killed_for else (128 - rc if rc < 0 else rc)
        stderr = err.text(stopped=killed_for == "output")
        stdout = out.text(stopped=killed_for == "output")
        if exit_code == 125 and stderr.startswith(_BOOT_FAILED):
            return self._failed(stderr.strip(), seconds, info)
        if killed_for is None and not self._started(info):
            return self._failed(stderr.strip() or f"exit status {exit_code}", seconds, info)
        limit = killed_for or classify_exit(exit_code, stderr)
        return ToolResult(stdout=stdout, stderr=stderr, exit_code=exit_code, seconds=seconds, limit=limit,
                          error=limit_message(limit, exit_code, self._limits), stdout_cut=out.cut,
                          stderr_cut=err.cut, info=info)

    def _failed(self, why: str, seconds: float, info: Optional[dict] = None) -> ToolResult:
        why = why.strip().splitlines()[0] if why.strip() else "no reason given"
        log.error("%s: the sandbox failed: %s", type(self).__name__, why)
        return ToolResult(stdout="", stderr="", exit_code=None, seconds=seconds, sandbox_failed=True,
                          error=f"Error: the sandbox could not run the code ({why}).", info=info or {})


def _parse_info(buf: bytes) -> dict:
    """bwrap's ``--info-fd`` JSON: ``child-pid`` (the sandbox's PID 1, as the host sees it) and the
    namespaces' inodes; kept as ``child_pid`` and ``pid_namespace``."""
    try:
        d = json.loads(bytes(buf).decode())
    except ValueError:
        return {}
    return {"child_pid": d.get("child-pid"), "pid_namespace": d.get("pid-namespace")}


class BubblewrapSandbox(_ProcessSandbox):
    """Tool code in a fresh bubblewrap sandbox per run (the module docstring says what it isolates and
    how each limit holds). Made by :func:`~.choice.make_sandbox` with ``kind: bubblewrap``; checks
    at once that bwrap runs here."""

    #: The host's top-level system entries the sandbox sees (links copied as links, folders bound
    #: read-only), besides ``/usr``.
    SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

    def __init__(self, cfg: SandboxConfig, where: str = "sandbox"):
        super().__init__(cfg, where)
        bwrap = shutil.which(cfg.bwrap)
        if bwrap is None:
            raise SandboxUnavailable(f"{where}.bwrap: {cfg.bwrap!r} not found: install Debian's bubblewrap "
                                     f"(apt-get install -y bubblewrap), or set {where}.kind=remote")
        self.bwrap = bwrap
        binds = ("/usr",) + tuple(cfg.ro_binds)
        if not os.access(cfg.python, os.X_OK):
            raise SandboxUnavailable(f"{where}.python: {cfg.python} is not an executable file here")
        for path in (cfg.python, os.path.realpath(cfg.python)):
            if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds):
                raise SandboxUnavailable(f"{where}.python: {path} is outside the folders the sandbox binds "
                                         f"({', '.join(binds)}): add its folder to {where}.ro_binds")
        self._popen_kw = {}
        uid_map = read_uid_map()
        if os.geteuid() == 0 and host_uid(0, uid_map) in (0, None):  # RLIMIT_NPROC binds no process of the host's uid 0
            self._popen_kw = dict(user=cfg.run_as_uid, group=cfg.run_as_uid, extra_groups=[])
        self._mounts = self._mount_args(binds)
        runs_as = cfg.run_as_uid if self._popen_kw else os.getuid()
        shown_uid = host_uid(runs_as, uid_map)
        _say_once(nproc_caveat(platform.release(), runs_as if shown_uid is None else shown_uid, where))
        trial = self._run("print('ok')", "")
        if trial.sandbox_failed or trial.stdout != "ok\n":
            why = (trial.error or trial.stderr or trial.stdout).strip().splitlines()
            if why and "Unknown option" in why[0]:
                raise SandboxUnavailable(f"{where}.bwrap: {bwrap} lacks an option the sandbox uses ({why[0]}): "
                                         "bubblewrap >= 0.8 is needed (Debian 12's)")
            if self._popen_kw and host_uid(cfg.run_as_uid, uid_map) is None:
                raise SandboxUnavailable(
                    f"{where}.run_as_uid: this user namespace maps no uid {cfg.run_as_uid} (uid_map "
                    f"{' | '.join(uid_map or ['unreadable'])!r}), and a root trainer whose uid 0 is the host's runs "
                    f"bwrap as it ({why[0] if why else 'no output'}): set {where}.run_as_uid to a mapped uid other "
                    f"than 0, start the container with more uids mapped, or as a non-root user (or remapped root: "
                    f"enroot/pyxis --container-remap-root), or set {where}.kind=remote")
            if why and "Can't mount proc" in why[0]:
                raise SandboxUnavailable(
                    f"{where}.kind=bubblewrap: bwrap cannot mount /proc here ({why[0]}): the container masks "
                    "/proc (Docker's default, containers/bubblewrap#505): start it with --security-opt "
                    f"systempaths=unconfined (and seccomp/AppArmor that allow user namespaces), or set {where}.kind=remote")
            as_uid = (f", or set {where}.run_as_uid to a uid this machine maps (bwrap runs as uid "
                      f"{cfg.run_as_uid} under a root trainer)") if self._popen_kw else ""
            raise SandboxUnavailable(
                f"{where}.kind=bubblewrap: bwrap cannot start a sandbox here ({why[0] if why else 'no output'}): "
                "allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0; "
                "kernel.unprivileged_userns_clone=1 on Debian kernels; kernel.apparmor_restrict_unprivileged_userns=0 "
                f"on Ubuntu 24.04){as_uid}, or set {where}.kind=remote")

    def _mount_args(self, binds) -> List[str]:
        args: List[str] = []
        for b in binds:
            args += ["--ro-bind", b, b]
        for top in self.SYSTEM_LINKS:
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        size = str(self.cfg.tmp_mb << 20)
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                 "--size", size, "--perms", "1777", "--tmpfs", "/tmp"]
        return args

    def _run(self, code: str, stdin: str) -> ToolResult:
        cfg = self.cfg
        with tempfile.TemporaryFile() as code_file:
            code_file.write(code.encode("utf-8"))
            code_file.flush()
            code_file.seek(0)
            env_args: List[str] = []
            for k, v in {**SANDBOX_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
                env_args += ["--setenv", k, v]
            info_r, info_w = os.pipe()
            argv = [self.bwrap, *self._mounts,
                    "--file", str(code_file.fileno()), "/tmp/main.py", "--remount-ro", "/",
                    "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "1000", "--gid", "1000",
                    "--hostname", "sandbox", "--die-with-parent", "--new-session", "--chdir", "/tmp",
                    "--info-fd", str(info_w), "--clearenv", *env_args,
                    "--", cfg.python, *self._boot_args(nproc=True), cfg.python, "-u", "/tmp/main.py"]
            return self._execute(argv, stdin=stdin, env={}, cwd="/", pass_fds=(code_file.fileno(), info_w),
                                 info_fd=info_r, close_after_spawn=(info_w,), popen_kw=self._popen_kw)

    def _stop(self, proc: subprocess.Popen, info: dict) -> None:
        # The sandbox's PID 1 first: its death makes the kernel kill its whole PID namespace, and
        # bwrap, its parent, reaps it and exits (killing bwrap first would orphan PID 1 to the host's
        # init). bwrap itself where the sandbox never started.
        pid, ns = info.get("child_pid"), info.get("pid_namespace")
        if pid and ns and _pid_namespace(pid) == ns:
            _kill(pid)
        else:  # bwrap has not said where the sandbox is yet: bwrap, whose death kills the sandbox
            for child in _children(proc.pid):
                _kill(child)

    def _started(self, info: dict) -> bool:
        return bool(info.get("child_pid"))  # bwrap says where the sandbox is before it runs the code

    def _after_kill(self, info: dict) -> None:
        ns = info.get("pid_namespace")
        if not ns:
            return
        left = processes_in_pid_namespace(ns)
        for pid in left:
            _kill(pid)
        info["leftover"] = len(left)
        if left:
            log.error("sandbox: %d processes were left in PID namespace %s after the run was stopped; killed",
                      len(left), ns)


_WARNED = threading.Lock()
_warned_once: List[bool] = []


class LocalSubprocessSandbox(_ProcessSandbox):
    """Tool code as a plain child process, WITHOUT isolation (the module docstring says what still
    holds). Only on an explicit ``kind: none``; says so in a warning line, once per process."""

    def __init__(self, cfg: SandboxConfig, where: str = "sandbox"):
        super().__init__(cfg, where)
        if not os.access(cfg.python, os.X_OK):
            raise SandboxUnavailable(f"{where}.python: {cfg.python} is not an executable file here")
        with _WARNED:
            if not _warned_once:
                _warned_once.append(True)
                log.warning("%s.kind=none: tool code runs WITHOUT a sandbox, as this user: it can read and write "
                            "the trainer's files and reach the network; only its CPU time, memory, file size, "
                            "output and wall time are limited", where)

    def _run(self, code: str, stdin: str) -> ToolResult:
        cfg = self.cfg
        folder = tempfile.mkdtemp(prefix="mtepo-tool-")
        try:
            main = os.path.join(folder, "main.py")
            with open(main, "w", encoding="utf-8") as f:
                f.write(code)
            argv = [cfg.python, *self._boot_args(nproc=False), cfg.python, "-u", main]
            return self._execute(argv, stdin=stdin, env={**SANDBOX_ENV, "HOME": folder, "TMPDIR": folder},
                                 cwd=folder, new_session=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _stop(self, proc: subprocess.Popen, info: dict) -> None:
        for child in _children(proc.pid):  # the code's session (the reaper kills it too when the code ends)
            _killpg(child)
            _kill(child)
