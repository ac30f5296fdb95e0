"""The fit check prints its report and nothing else (issue #35): run as a user runs it on a login
node, the console script ``mtepo-fit-check`` in a fresh process with every cache empty (Python's
bytecode, the user's cache folders, torch's and Triton's kernel caches), as on a fresh install,
on every example launch file. No warning line, no library chatter (megatron-core's fall-backs,
torch's "No CUDA runtime"), on stderr or stdout. The oldest stack runs this file too
(tools/test.sh's OLDEST_TESTS)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH_FILES = sorted((REPO / "examples/models").glob("*.yaml"))
NOISE = ("warning", "warn(", "no cuda runtime", "falling back", "traceback")


@pytest.mark.parametrize("launch_file", LAUNCH_FILES, ids=lambda p: p.stem)
def test_the_fit_check_prints_only_its_report_on_a_fresh_install(tmp_path, launch_file):
    script = Path(sys.executable).with_name("mtepo-fit-check")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "megatron_tepo.commands.fit_check"]
    fresh = {k: str(tmp_path / k.lower()) for k in ("HOME", "XDG_CACHE_HOME", "PYTHONPYCACHEPREFIX",
                                                     "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONWARNINGS", "CUDA_"))}
    env.update(fresh, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([*cmd, "--config", str(launch_file), "--gpu-mem-gib", "80"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 2), proc.stderr[-3000:]  # 2: a launch file that does not fit, said in one line
    noise = [line for line in (proc.stdout + proc.stderr).splitlines() if any(n in line.lower() for n in NOISE)]
    assert noise == [], noise
    if proc.returncode == 0:
        assert proc.stderr == "", proc.stderr
        assert proc.stdout.startswith(f"fit check of {launch_file}"), proc.stdout[:300]
    else:
        assert len(proc.stderr.strip().splitlines()) == 1 and "fit check FAILED" in proc.stderr, proc.stderr
