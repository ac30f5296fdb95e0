"""The trainer tests' shared runs: the main job's short run (6 steps, the loop's arithmetic as the
tests pin it), made once per session and compared by several tests on this machine."""
import json

import pytest

from tests.trainer.test_loop import MAIN_JOB_SHORT_RUN, _run


@pytest.fixture(scope="session")
def main_job_short_run(tmp_path_factory):
    """``(out, proc, metrics rows)`` of ``examples/tiny_tepo/run.py`` with MAIN_JOB_SHORT_RUN's
    overrides (the engine and the actor apart, synchronous)."""
    out = tmp_path_factory.mktemp("main_job") / "run"
    proc = _run(["examples/tiny_tepo/run.py", *MAIN_JOB_SHORT_RUN, f"train.output_dir={out}", "--eval-size", "50"],
                600, MTEPO_FAST_PATHS="0")
    return out, proc, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
