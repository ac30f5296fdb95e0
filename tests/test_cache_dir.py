"""megatron_tepo.cache_dir.build_once: one process builds, any others asking at the same time wait
and read its result; a failed build leaves nothing behind."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_tepo.cache_dir import build_once

REPO = Path(__file__).resolve().parents[1]

BUILDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from megatron_tepo.cache_dir import build_once

    def build(tmp):
        tmp.mkdir()
        time.sleep(1.0)  # long enough for the other process to ask meanwhile
        (tmp / "config.json").write_text(str(os.getpid()))
        with open(Path(sys.argv[2]), "a") as log:
            log.write(f"built {os.getpid()}\\n")

    out = build_once(Path(sys.argv[1]), build)
    print((out / "config.json").read_text())
""")


def test_two_processes_at_once_build_it_once_and_read_the_same(tmp_path):
    out, log = tmp_path / "cache" / "entry", tmp_path / "builds.log"
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(out), str(log)], stdout=subprocess.PIPE, text=True,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}) for _ in range(2)]
    answers = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(log.read_text().splitlines()) == 1  # one build
    assert answers[0] == answers[1] == (out / "config.json").read_text()
    assert sorted(p.name for p in out.parent.iterdir()) == ["entry", "entry.lock"]  # no temporary left


def test_a_failed_build_leaves_nothing_and_a_later_one_builds(tmp_path):
    out = tmp_path / "entry"

    def broken(tmp):
        tmp.mkdir()
        (tmp / "half").write_text("x")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_once(out, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.lock"]
    assert build_once(out, lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("{}"))) == out
    assert build_once(out, broken) == out  # built: not asked again
