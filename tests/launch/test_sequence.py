"""The launch sequence once (issue #33 point 5): slurm/lib.sh and the nemo-run launcher run the steps
of megatron_tepo/launch/sequence.py's job_steps, in its order (lib.sh through the fit check's
FIT_STEPS, nemo-run by rendering from the list), and take the nodes' python from one rule,
lib.sh's tepo_python, which the nemo-run launcher runs rather than copies."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tepo.launch import load_launch, shell_vars
from megatron_tepo.launch import nemo_run
from megatron_tepo.launch.sequence import STEPS, job_steps, lib_sh, node_python

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "models" / "tiny_cpu.yaml"
WITH_SERVERS = ("split_nodes", "job_env", "servers", "health", "trainer")


@pytest.mark.parametrize("overrides,want", [
    ([], WITH_SERVERS),
    (["rollout.engine=embedded"], ("split_nodes", "job_env", "trainer")),
], ids=["sglang", "embedded"])
def test_both_launchers_follow_job_steps(tmp_path, overrides, want):
    spec = load_launch(TINY, overrides)
    assert job_steps(spec.cfg, spec.launch) == want and set(want) <= set(STEPS)
    assert shell_vars(spec)["FIT_STEPS"] == " ".join(want)
    # slurm/lib.sh: tepo_main runs FIT_STEPS in order (a dry run of the tiny CPU job)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TEPO_"))}
    env.update(TEPO_ROOT=str(ROOT), TEPO_DRY_RUN="1", TEPO_NODELIST="cpu1", TEPO_RUN_DIR=str(tmp_path / "run"),
               OUTPUT_DIR=str(tmp_path / "out"), MODEL_PATH=str(tmp_path / "model"), OMP_NUM_THREADS="1",
               TEPO_PYTHON=sys.executable)
    res = subprocess.run(["bash", str(ROOT / "slurm" / "local_cpu_tepo.sh"), *overrides], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ran = re.findall(r"\] step (\d+) of (\d+): (\w+)$", res.stderr, re.M)
    assert [name for _, _, name in ran] == list(want) and {n for _, n, _ in ran} == {str(len(want))}
    # the nemo-run launcher: its batch script's setup lines and its tasks, from the same list
    plan = nemo_run.make_plan(str(TINY), overrides)
    assert plan.steps == want
    rendered = re.findall(r"^# step (\w+)$", nemo_run.setup_lines(plan, "/py"), re.M)
    assert rendered == list(want)
    tasks = nemo_run.step_commands(plan, tmp_path, "/py", slurm=True, rdzv_port=29500, health_timeout=60)
    assert [nemo_run.TASK_STEP[role] for role in tasks] == [s for s in want if s in ("servers", "trainer")]


@pytest.mark.parametrize("environ", [{"TEPO_PYTHON": "/opt/venv/bin/python"}, {}], ids=["TEPO_PYTHON", "default"])
def test_both_launchers_take_the_nodes_python_from_tepo_python(environ):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEPO_")}
    env.update(environ)
    lib = lib_sh("tepo_python", environ={**env, "TEPO_ROOT": str(ROOT)})
    assert node_python(env) == lib[0] == environ.get("TEPO_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    assert nemo_run.node_python is node_python and not hasattr(nemo_run, "default_python")  # no copy of the rule
