"""The launch's checks of the tool sandbox (issue #56 rows 1 and 8): with ``--trainer-python`` (the
job's own fit check, slurm/lib.sh) a tool run's sandbox is made once on this node and runs
``print(1)``, and one that cannot start stops the job before any server (a dry run says it in one
line and goes on)."""
import sys
from pathlib import Path

import pytest

from megatron_tepo.commands.fit_check import cli

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "examples/models/tiny_cpu.yaml")


def _tool_run(tmp_path):
    return ["environment.name=python", f"environment.sandbox.bwrap={tmp_path / 'no' / 'bwrap'}",
            f"train.output_dir={tmp_path / 'out'}"]


def test_the_job_fit_check_refuses_a_sandbox_that_cannot_start(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli(["--config", TINY, "--trainer-python", sys.executable, *_tool_run(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert "fit check FAILED: environment.sandbox.bwrap:" in err[0] and "not found" in err[0], err


def test_a_dry_run_says_the_sandbox_refusal_and_goes_on(tmp_path, capsys):
    assert cli(["--config", TINY, "--trainer-python", sys.executable, "--dry-run", *_tool_run(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "DRY RUN: a real run would stop here: environment.sandbox.bwrap:" in out, out
