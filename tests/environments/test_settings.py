"""The sandbox's settings and the choice of sandbox: each bad field is one line naming it; ``none``
is the explicit way to run without isolation, and says so once; the unsandboxed run still holds its
wall time on its whole session and leaves no child behind."""
import logging
import os
import textwrap
import uuid

import pytest

from megatron_tepo.environments import SandboxConfig, make_sandbox
from megatron_tepo.environments import processes
from megatron_tepo.environments.processes import LocalSubprocessSandbox
from megatron_tepo.environments.remote import RemoteSandbox

pytestmark = pytest.mark.second_lane  # a few seconds of waits: the first lane has none to spare


@pytest.mark.parametrize("change, message", [
    ({"kind": "docker"}, "sandbox.kind: must be one of bubblewrap, remote, none, got 'docker'"),
    ({"wall_seconds": 0}, "sandbox.wall_seconds: must be > 0, got 0"),
    ({"cpu_seconds": 1.5}, "sandbox.cpu_seconds: must be an integer, got 1.5"),
    ({"wall_seconds": "10"}, "sandbox.wall_seconds: must be a number, got '10'"),
    ({"processes": True}, "sandbox.processes: must be an integer, got True"),
    ({"memory_mb": 16}, "sandbox.memory_mb: must be >= 64 (Python itself needs about 30 MB of address space), got 16"),
    ({"processes": 1}, "sandbox.processes: must be >= 2 (the sandbox's init and the code), got 1"),
    ({"shown_bytes": 2 << 20}, f"sandbox.shown_bytes: must be <= output_bytes ({1 << 20}), got {2 << 20}"),
    ({"max_concurrent": 0}, "sandbox.max_concurrent: must be > 0, got 0"),
    ({"python": "python3"}, "sandbox.python: must be an absolute path, got 'python3'"),
    ({"ro_binds": ("opt",)}, "sandbox.ro_binds: must be absolute paths, got ('opt',)"),
    ({"run_as_uid": 0}, "sandbox.run_as_uid: must be > 0 (the kernel bounds no process count of uid 0), got 0"),
    ({"remote_timeout_margin_s": -1.0}, "sandbox.remote_timeout_margin_s: must be >= 0, got -1.0"),
    ({"kind": "remote"}, "sandbox.remote_url: kind 'remote' needs the service's http(s):// URL, got ''"),
])
def test_a_bad_setting_is_one_line_naming_it(change, message):
    with pytest.raises(ValueError) as e:
        SandboxConfig(**change).check()
    assert str(e.value) == message
    with pytest.raises(ValueError, match="^environment.sandbox."):
        make_sandbox(SandboxConfig(**change), where="environment.sandbox")


def test_the_defaults_are_valid_and_the_choice_follows_kind():
    assert SandboxConfig().check().kind == "bubblewrap"
    assert isinstance(make_sandbox(SandboxConfig(kind="remote", remote_url="http://h:8080")), RemoteSandbox)


def test_no_sandbox_is_explicit_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(processes, "_warned_once", [])
    with caplog.at_level(logging.WARNING, logger="megatron_tepo.environments.processes"):
        sb = make_sandbox(SandboxConfig(kind="none", wall_seconds=60.0))
        make_sandbox(SandboxConfig(kind="none"))
    assert isinstance(sb, LocalSubprocessSandbox)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["sandbox.kind=none: tool code runs WITHOUT a sandbox, as this user: it can read and write "
                        "the trainer's files and reach the network; only its CPU time, memory, file size, output "
                        "and wall time are limited"]
    r = sb.run("import os, sys\nprint(sorted(os.environ), sys.stdin.read())\n1/0", stdin="in")
    assert r.stdout == f"{sorted([*processes.SANDBOX_ENV, 'HOME', 'TMPDIR'])} in\n" and r.exit_code == 1
    assert r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


def _alive_with(token: str):
    """PIDs of live (not zombie) processes whose command line holds ``token``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_no_sandbox_stops_a_hang_and_leaves_no_child(monkeypatch):
    monkeypatch.setattr(processes, "_warned_once", [True])
    sb = make_sandbox(SandboxConfig(kind="none", wall_seconds=3.0))
    token = f"{uuid.uuid4().int % 10 ** 6}.{uuid.uuid4().int % 10 ** 6}"  # a child's unique command line
    code = textwrap.dedent(f"""\
        import subprocess
        subprocess.Popen(["sleep", "{token}"])
        print("started")
        """)
    r = sb.run(code)  # the code exits; its child would sleep on
    assert (r.stdout, r.error) == ("started\n", None)
    assert _alive_with(token) == []
    r = sb.run(code + "import time\ntime.sleep(600)\n")
    assert (r.stdout, r.limit, r.exit_code) == ("started\n", "wall", None)
    assert _alive_with(token) == []
