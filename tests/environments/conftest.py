"""The sandbox tests need Debian's bubblewrap (``bwrap``): missing, they FAIL saying how to install it
(tools/test.sh installs it as root); MTEPO_ALLOW_NO_BWRAP=1 skips them instead (an explicit
opt-out). Helpers: the leftover check every bad-code test makes."""
import os
import shutil

import pytest

from megatron_tepo.environments.processes import processes_in_pid_namespace


def require_bwrap() -> str:
    path = shutil.which("bwrap")
    if path:
        return path
    msg = "bubblewrap (bwrap) not found: run `apt-get install -y bubblewrap` as root (tools/test.sh does)"
    if os.environ.get("MTEPO_ALLOW_NO_BWRAP") == "1":
        pytest.skip(msg + " [skipped: MTEPO_ALLOW_NO_BWRAP=1]")
    pytest.fail(msg, pytrace=False)


@pytest.fixture(scope="session")
def bwrap():
    return require_bwrap()


def _children_named(name: str):
    """This process's live children whose command is ``name``."""
    me, found = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if comm == name and int(rest[1]) == me and rest[0] != "Z":
            found.append(int(pid))
    return found


def _state(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def assert_nothing_left(result):
    """Nothing of the run is left: no process in its sandbox's PID namespace, not even the sandbox's
    PID 1 as a zombie (bwrap's monitor orphans it; the runner's reaper must reap it), no child of ours
    still running bwrap."""
    ns, pid1 = result.info.get("pid_namespace"), result.info.get("child_pid")
    assert ns and pid1, result.info  # the sandbox said where it ran
    assert processes_in_pid_namespace(ns) == []
    assert _state(pid1) != "Z"
    assert _children_named("bwrap") == []
