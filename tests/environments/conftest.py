"""The sandbox tests need Debian's bubblewrap (``bwrap``): missing, they FAIL saying how to install it
(tools/test.sh installs it as root); MTEPO_ALLOW_NO_BWRAP=1 skips them instead (an explicit
opt-out). Helpers: the leftover check every bad-code test makes, and runs at once beside a hang."""
import os
import shutil

import pytest

import threading
from concurrent.futures import ThreadPoolExecutor

from megatron_tepo.environments.processes import _children, processes_in_pid_namespace


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
    found = []
    for pid in _children(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name and _state(pid) != "Z":
                    found.append(pid)
        except OSError:
            pass
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


HANG = "import time\nprint('sleeping', flush=True)\ntime.sleep(3600)\n"

#: code that starts as many sleeping children as it can (up to 200) and says how many, and why it stopped
SLEEPING_CHILDREN = """\
import os, time
n = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        n += 1
except OSError as e:
    print("stopped:", e.strerror)
print("children:", n)
"""


def beside_a_hang(sb, quick: int = 4):
    """Runs :data:`HANG` and ``quick`` runs of ``print(i * i)`` from threads at once, the quick ones
    started once the hang's thread is: (the results, hang first; the order in which they came back)."""
    order, lock, started = [], threading.Lock(), threading.Event()

    def one(i):
        if i == 0:
            started.set()
            r = sb.run(HANG)
        else:
            started.wait()
            r = sb.run(f"print({i} * {i})")
        with lock:
            order.append(i)
        return r

    with ThreadPoolExecutor(quick + 1) as pool:
        results = list(pool.map(one, range(quick + 1)))
    return results, order
