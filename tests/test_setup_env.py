"""tools/setup_env.sh picks the interpreter and the megatron-core that goes with it, and says so
(checked with MTEPO_SETUP_PLAN=1: the choice only, nothing installed)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "setup_env.sh"


def plan(tmp_path, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("MTEPO_PYTHON", "MTEPO_MCORE")}
    full.update(MTEPO_SETUP_PLAN="1", MTEPO_VENV=str(tmp_path / "venv"), **env)
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=60)


def _runs(py: str) -> bool:
    try:
        return subprocess.run([py, "-c", "pass"], capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def test_python311_gets_the_oldest_megatron_core(tmp_path):
    if not _runs("python3.11"):
        pytest.skip("no python3.11 here")
    proc = plan(tmp_path, MTEPO_PYTHON="python3.11")
    assert proc.returncode == 0, proc.stderr
    assert "Python 3.11 (python3.11) with megatron-core==0.16.1" in proc.stderr
    assert not (tmp_path / "venv").exists()  # a plan installs nothing


def test_default_prefers_python312_with_megatron_core_019(tmp_path):
    proc = plan(tmp_path)
    assert proc.returncode == 0, proc.stderr
    has312 = _runs("python3.12") or any(Path(p).exists() for p in _pyenv_312())
    if has312:
        assert "Python 3.12 (" in proc.stderr and "with megatron-core>=0.19,<0.20" in proc.stderr, proc.stderr
    else:
        assert "with megatron-core" in proc.stderr, proc.stderr


def _pyenv_312():
    pyenv = shutil.which("pyenv")
    if not pyenv:
        return []
    root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
    return sorted(str(p) for p in Path(root, "versions").glob("3.12*/bin/python3.12"))


def test_an_interpreter_that_does_not_run_is_one_clear_error(tmp_path):
    proc = plan(tmp_path, MTEPO_PYTHON=str(tmp_path / "no-such-python"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not run" in lines[0], proc.stderr


def test_mcore_override(tmp_path):
    proc = plan(tmp_path, MTEPO_PYTHON="python3", MTEPO_MCORE="megatron-core==0.18.0")
    assert proc.returncode == 0 and "with megatron-core==0.18.0 in" in proc.stderr, proc.stderr
