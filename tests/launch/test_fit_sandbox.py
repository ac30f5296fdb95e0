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


TIR = str(REPO / "examples/models/qwen3_14b_tir.yaml")
OLD_SIZES = ["environment.tool_workers=64", "environment.sandbox.max_concurrent=64", "environment.sandbox.processes=64",
             "environment.sandbox.memory_mb=2048"]  # the 14B tool example's sandboxes before issue #56


def test_the_fit_check_refuses_sandboxes_that_can_take_too_much_of_the_node(capsys):
    with pytest.raises(SystemExit) as exc:
        cli(["--config", TIR, "launch.host_mem_gib=1024", *OLD_SIZES])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert "fit check FAILED: environment.sandbox: the tool sandboxes can take 8200.0 GiB of the driver's node at " \
           "once, more than 25% of its 1024.0 GiB (launch.host_mem_gib)" in err[0], err
    for field in ("environment.tool_workers=64", "environment.sandbox.max_concurrent=64",
                  "environment.sandbox.processes=64", "environment.sandbox.memory_mb=2048",
                  "environment.sandbox.tmp_mb=64"):
        assert field in err[0], (field, err)


def test_the_14b_tool_example_fits_a_node_of_784_gib(capsys):
    for gib in (784, 1024, 2048):
        assert cli(["--config", TIR, f"launch.host_mem_gib={gib}"]) == 0
    out = capsys.readouterr().out
    assert "tool sandboxes: 32 at once x 6.12 GiB = 196.0 GiB on the driver's node (at most 25% of 784.0 GiB" in out
    with pytest.raises(SystemExit):  # (the share is what decides)
        cli(["--config", TIR, "launch.host_mem_gib=780"])
    # a SandboxFusion service's memory is not the node's
    assert cli(["--config", TIR, "launch.host_mem_gib=1024", *OLD_SIZES, "environment.sandbox.kind=remote",
                "environment.sandbox.remote_url=http://sandbox:8080"]) == 0
