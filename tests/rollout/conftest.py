"""SGLang tests need the SGLang CPU venv (tools/install_sglang_cpu.sh). Missing -> the tests FAIL
with that instruction; set MTEPO_ALLOW_NO_SGLANG=1 to skip them instead (explicit opt-out)."""
import os
from pathlib import Path

import pytest

from megatron_tepo.rollout.sglang.server import default_sglang_python


def require_sglang() -> str:
    py = default_sglang_python()
    if Path(py).exists():
        return py
    msg = (f"SGLang CPU venv not found ({py}): run `bash tools/install_sglang_cpu.sh` "
           "(or point MTEPO_SGLANG_PYTHON at a python with sglang)")
    if os.environ.get("MTEPO_ALLOW_NO_SGLANG") == "1":
        pytest.skip(msg + " [skipped: MTEPO_ALLOW_NO_SGLANG=1]")
    pytest.fail(msg, pytrace=False)


@pytest.fixture(scope="session")
def sglang_python():
    return require_sglang()
