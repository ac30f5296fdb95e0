"""bubblewrap under the uid maps of clusters' containers (issue #56 row 7). A trainer that is root
only in a user namespace mapping its uid 0 to another host uid (enroot's and pyxis's
``--container-remap-root``: ``0 <uid> 1``, nothing else mapped) runs its sandboxes as itself, and
the process limit holds there (the kernel counts against the host uid); imitated here with
``setpriv`` to uid 1000 and ``unshare --user --map-root-user``. A root-only map of the host's root
(no uid to switch to) names ``run_as_uid``; Docker's masked ``/proc`` has its own line. And the
process limit's kernel caveat (row 8): counted per user namespace only from Linux 5.14."""
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from megatron_tepo.environments import SandboxConfig, SandboxUnavailable, make_sandbox
from tests.environments.conftest import SLEEPING_CHILDREN

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.second_lane  # (the first lane has no time to spare)

# what the child runs: the sandbox's check, then as many sleeping children as it can start (argv[1])
CHILD = """
import json, sys
from megatron_tepo.environments import SandboxConfig, make_sandbox
from megatron_tepo.environments.choice import check_sandbox
cfg = SandboxConfig(processes=8, memory_mb=256, wall_seconds=60.0)
try:
    check_sandbox(cfg)
except Exception as e:
    print(json.dumps({"unavailable": str(e)}))
    sys.exit(0)
sb = make_sandbox(cfg)
r = sb.run(sys.argv[1])
print(json.dumps({"map": open("/proc/self/uid_map").read().split(), "stdout": r.stdout, "error": r.error}))
"""


def _in_namespace(prefix):
    """CHILD's answer, run under ``prefix`` (a command line that enters the namespace) with a copy of
    the package's standard-library part that any uid can read."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("needs root, unshare and setpriv (util-linux) to make the uid map")
    folder = Path(tempfile.mkdtemp(prefix="mtepo-userns-", dir="/tmp"))
    try:
        (folder / "megatron_tepo").mkdir()
        shutil.copy(REPO / "megatron_tepo/__init__.py", folder / "megatron_tepo")
        shutil.copytree(REPO / "megatron_tepo/environments", folder / "megatron_tepo/environments",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for p in (folder, *folder.rglob("*")):
            p.chmod(0o755)
        proc = subprocess.run([*prefix, "/usr/bin/python3", "-B", "-c", CHILD, SLEEPING_CHILDREN], capture_output=True, text=True,
                              timeout=300, cwd=folder, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                                            "PYTHONPATH": str(folder)})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_remapped_root_trainer_runs_sandboxes_whose_process_count_is_bounded(bwrap):
    got = _in_namespace(["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups",
                         "unshare", "--user", "--map-root-user"])
    assert "unavailable" not in got, got["unavailable"]
    assert got["map"] == ["0", "1000", "1"]  # root inside, uid 1000 outside, nothing else mapped
    assert got["stdout"].startswith("stopped: Resource temporarily unavailable\n"), got
    assert int(got["stdout"].split("children:")[1]) <= 8 - 2 and got["error"] is None


def test_a_root_only_map_of_the_hosts_root_names_run_as_uid(bwrap):
    got = _in_namespace(["unshare", "--user", "--map-root-user"])  # the host's root, only uid 0 mapped
    msg = got.get("unavailable", "")
    assert msg.startswith("sandbox.run_as_uid: this user namespace maps no uid 65534 (uid_map '0 0 1')"), got
    assert "\n" not in msg and msg.endswith("or set sandbox.kind=remote")


def test_host_uid_reads_the_map():
    from megatron_tepo.environments.processes import host_uid

    assert host_uid(0, ["0 1000 1"]) == 1000 and host_uid(65534, ["0 1000 1"]) is None
    assert host_uid(65534, ["0 0 4294967295"]) == 65534 and host_uid(5, ["0 100000 65536"]) == 100005
    assert host_uid(0, None) is None


def test_a_masked_proc_has_its_own_line(bwrap, tmp_path):
    """What bwrap says under plain Docker, whose /proc is masked (containers/bubblewrap#505)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for p in (folder, *folder.parents):
        if p.stat().st_uid == os.getuid() and p != Path("/"):
            p.chmod(p.stat().st_mode | 0o711)
    masked = folder / "bwrap"
    masked.write_text("#!/bin/sh\necho 'bwrap: Can'\"'\"'t mount proc on /newroot/proc: Operation not permitted' >&2\nexit 1\n")
    masked.chmod(0o755)
    with pytest.raises(SandboxUnavailable) as e:
        make_sandbox(SandboxConfig(bwrap=str(masked)), where="environment.sandbox")
    msg = str(e.value)
    assert "\n" not in msg and "Can't mount proc on /newroot/proc" in msg
    assert "the container masks /proc" in msg and "systempaths=unconfined" in msg and "user.max_user_namespaces" not in msg
    assert msg.endswith("or set environment.sandbox.kind=remote")


def test_the_process_limit_caveat_is_said_once_on_kernels_before_5_14(bwrap, monkeypatch, caplog):
    """RLIMIT_NPROC counts per user namespace only from Linux 5.14: on an older kernel (the release
    injected here, whatever this machine runs) making a sandbox says so once, naming the field."""
    from megatron_tepo.environments import processes

    from megatron_tepo.environments.processes import nproc_caveat

    assert nproc_caveat("5.14.0-284.11.1.el9_2.x86_64", 65534) is None and nproc_caveat("6.1.0-18-amd64", 0) is None
    assert nproc_caveat("weird", 0) is None
    line = nproc_caveat("4.18.0-553.el8_10.x86_64", 65534, "environment.sandbox")
    assert line.startswith("environment.sandbox.processes: on Linux 4.18.0-553.el8_10.x86_64 (< 5.14) RLIMIT_NPROC "
                           "counts every process and thread of uid 65534")
    monkeypatch.setattr(processes, "_SAID", set())
    monkeypatch.setattr(processes.platform, "release", lambda: "5.4.0-150-generic")
    with caplog.at_level("WARNING", logger=processes.__name__):
        for _ in range(2):
            make_sandbox(SandboxConfig(), where="environment.sandbox").close()
    said = [r.getMessage() for r in caplog.records if "RLIMIT_NPROC" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("environment.sandbox.processes: on Linux 5.4.0-150-generic (< 5.14)")
    caplog.clear()
    monkeypatch.setattr(processes, "_SAID", set())
    monkeypatch.setattr(processes.platform, "release", lambda: "5.15.0-1-generic")
    with caplog.at_level("WARNING", logger=processes.__name__):
        make_sandbox(SandboxConfig()).close()
    assert not [r for r in caplog.records if "RLIMIT_NPROC" in r.getMessage()]
