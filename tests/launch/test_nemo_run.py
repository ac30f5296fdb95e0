"""tools/launch_nemo_run.py offline: the rendered sbatch script of the 4-node Qwen3-14B job (node
split, srun lines, torchrun line, run config), the same script executed against stand-in
`scontrol`/`srun` (the split evaluated to host names), and launches that fail before anything is
rendered. The real submission on a local Slurm cluster is tests/slurm/test_nemo_run_local.py."""
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch.gpu_pythons import gpu_pythons, standin_python

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "launch_nemo_run.py"
LAUNCH = ROOT / "examples" / "models" / "qwen3_14b.yaml"
HOSTS = ["gpu01", "gpu02", "gpu03", "gpu04"]

def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TEPO_", "NEMORUN_")) and k not in
           ("MODEL_PATH", "TRAIN_FILES", "OUTPUT_DIR", "ACTOR_NODES", "ROLLOUT_NODES")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **extra})
    return env


def _launch(tmp, *args, pythons=None, launch=LAUNCH):
    """The 14B launch (or ``launch``); ``pythons``: TEPO_PYTHON / MTEPO_SGLANG_PYTHON (default: a GPU job's
    stand-ins, which the launcher's check of the nodes' pythons accepts: tests/launch/gpu_pythons.py)."""
    pythons = gpu_pythons(tmp / "pythons") if pythons is None else pythons
    return subprocess.run([sys.executable, str(TOOL), "--launch", str(launch), "--executor", "slurm",
                           "--account", "acct_rl", "--partition", "gpu", "--nemorun-home", str(tmp / "nemorun"),
                           *args], capture_output=True, text=True, env=_env(**pythons), cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("render")  # not ".../nemo_run*": nemo-run rewrites that
    res = _launch(tmp, "--dryrun", "--monitor-interval", "1", f"train.output_dir={tmp / 'out'}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found = dict(re.findall(r"^(sbatch script|run config): (\S+)$", res.stdout, re.M))
    script = Path(found["sbatch script"])
    return {"tmp": tmp, "script": script, "text": script.read_text(), "run_config": Path(found["run config"]),
            "stderr": res.stderr}


def _sbatch_flags(text):
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", text, re.M))


def _sruns(text):
    """The task srun lines (not nemo-run's `head_node_ip=$(srun ...)`), as argv lists."""
    out = []
    for line in text.splitlines():
        if line.startswith("srun "):
            line = re.sub(r"\s*&\s*pids\[\d+\]=\$!\s*$", "", line)
            out.append(shlex.split(line))
    return out


def _step(argv, name):
    """Split a task srun argv into (srun options, step options, command after `--`)."""
    i = argv.index(name)
    rest = argv[i + 1:]
    j = rest.index("--")
    return argv[:i], rest[:j], rest[j + 1:]


def _opt(words, key):
    """Value of `--key=V` or `--key V` in words."""
    for k, w in enumerate(words):
        if w == key:
            return words[k + 1]
        if w.startswith(key + "="):
            return w.split("=", 1)[1]
    raise AssertionError(f"{key} not in {words}")


def test_sbatch_allocation(rendered):
    flags = _sbatch_flags(rendered["text"])
    assert flags["nodes"] == "4"  # 2 actor + 2 rollout nodes (examples/models/qwen3_14b.yaml)
    assert flags["ntasks-per-node"] == "1"
    assert flags["gpus-per-node"] == "8"
    assert flags["account"] == "acct_rl" and flags["partition"] == "gpu"
    assert "requeue" in flags and flags["signal"] == "B:USR1@120" and "exclusive" in flags


def test_setup_splits_nodes_with_lib_sh(rendered):
    text = rendered["text"]
    assert f"export TEPO_ROOT={ROOT}" in text
    assert 'source "$TEPO_ROOT/slurm/lib.sh"' in text
    assert re.search(r"^tepo_split_nodes 2 2 \|\|", text, re.M)  # actor nodes first, then rollout
    assert "tepo_nccl_env" in text and "tepo_on_preempt" in text
    # the split comes before the srun lines that use it
    assert text.index("tepo_split_nodes") < text.index("step-sglang") < text.index("step-trainer")


def test_srun_lines_place_servers_and_trainer(rendered):
    sruns = _sruns(rendered["text"])
    assert len(sruns) == 2, sruns
    sglang = [a for a in sruns if "step-sglang" in a]
    trainer = [a for a in sruns if "step-trainer" in a]
    assert len(sglang) == 1 and len(trainer) == 1

    srun, step, server = _step(sglang[0], "step-sglang")
    assert _opt(srun, "--nodes") == "2" and _opt(srun, "--ntasks-per-node") == "1"
    assert _opt(srun, "--nodelist") == "$TEPO_ROLLOUT_NODELIST"
    assert _opt(srun, "--gpus-per-node") == "8"
    assert _opt(srun, "--cpus-per-task") == "$TEPO_STEP_CPUS"
    assert _opt(step, "--ports") == "30000,30001,30002,30003"  # 8 GPUs / sglang.tp 2 = 4 servers a node
    assert _opt(step, "--gpus-per-server") == "2" and _opt(step, "--device") == "cuda"
    assert server[1:3] == ["-m", "megatron_tepo.rollout.sglang.server"]
    assert _opt(server, "--tp") == "2" and _opt(server, "--port") == "{port}"
    assert _opt(server, "--max-running-requests") == "64" and _opt(server, "--context-length") == "10240"

    srun, step, torchrun = _step(trainer[0], "step-trainer")
    assert _opt(step, "--device") == "cuda"  # the trainer's own settings: step-trainer sets them (lib.sh's)
    assert _opt(srun, "--nodes") == "2" and _opt(srun, "--ntasks-per-node") == "1"
    assert _opt(srun, "--nodelist") == "$TEPO_ACTOR_NODELIST"
    assert _opt(srun, "--gpus-per-node") == "8"
    assert _opt(srun, "--cpus-per-task") == "$TEPO_STEP_CPUS"
    assert _opt(step, "--done-file") == _opt(_step(sglang[0], "step-sglang")[1], "--done-file")
    assert torchrun[1:3] == ["-m", "torch.distributed.run"]
    assert _opt(torchrun, "--nnodes") == "2"
    assert _opt(torchrun, "--nproc-per-node") == "8"
    assert _opt(torchrun, "--rdzv-backend") == "c10d"
    assert _opt(torchrun, "--rdzv-endpoint") == "$TEPO_RDZV_HOST:29500"
    assert torchrun[torchrun.index("--rdzv-endpoint=$TEPO_RDZV_HOST:29500") + 2] == str(ROOT / "tools" / "train.py")
    assert _opt(torchrun, "--config") == str(rendered["run_config"])


def test_every_srun_step_gets_the_nodes_cpus(rendered):
    """Since Slurm 22.05 a step does not inherit the job's --cpus-per-task: every srun line of the
    script (nemo-run's own `head_node_ip=$(srun ...)` too would be harmless, but the task lines must)
    carries lib.sh's count, set by the setup lines before the first srun."""
    text = rendered["text"]
    sruns = _sruns(text)
    assert len(sruns) == 2
    for argv in sruns:
        srun = argv[:argv.index("step-sglang" if "step-sglang" in argv else "step-trainer")]
        assert _opt(srun, "--cpus-per-task") == "$TEPO_STEP_CPUS", argv
    m = re.search(r"^TEPO_STEP_CPUS=\$\(tepo_cpus_per_node\) \|\| \{.*exit 1; \}$", text, re.M)
    assert m and m.start() < text.index("\nsrun "), text


def test_run_config_is_the_launch_files(rendered):
    from megatron_tepo.config import load_config

    path = rendered["run_config"]
    assert path.is_file() and path.parent.parent.name == "nemo-run"
    cfg = load_config(path)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.actor.sequence_parallel) == (4, 1, True)
    assert cfg.optim.use_distributed_optimizer and cfg.train.resume
    assert cfg.train.output_dir == str(rendered["tmp"] / "out")
    assert "total 38.3 GiB of 80 GiB: fits" in (path.parent / "fit.log").read_text()
    assert "architecture" not in path.read_text() and "launch:" not in path.read_text()


def test_the_32k_context_parallel_job(tmp_path):
    """examples/models/qwen3_14b_32k.yaml (parallel.cp: 2) through nemo-run, as slurm/qwen3_14b_32k_tepo.sh:
    4 nodes, torchrun with 8 processes on each of the 2 actor nodes (16 ranks: TP 4 x CP 2 x DP 2, which
    the trainer makes of them), 2 servers at TP 4 a rollout node with a 34816-token context; the run
    config keeps parallel.cp, the fit log says the CP it assumed. At parallel.cp=1 the launcher stops
    before anything is rendered, naming parallel.cp."""
    from megatron_tepo.config import load_config

    launch = ROOT / "examples" / "models" / "qwen3_14b_32k.yaml"
    res = _launch(tmp_path, "--dryrun", f"train.output_dir={tmp_path / 'out'}", launch=launch)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found = dict(re.findall(r"^(sbatch script|run config): (\S+)$", res.stdout, re.M))
    text = Path(found["sbatch script"]).read_text()
    assert _sbatch_flags(text)["nodes"] == "4" and re.search(r"^tepo_split_nodes 2 2 \|\|", text, re.M)
    sruns = _sruns(text)
    _, step, server = _step(next(a for a in sruns if "step-sglang" in a), "step-sglang")
    assert _opt(step, "--ports") == "30000,30001" and _opt(step, "--gpus-per-server") == "4"
    assert _opt(server, "--tp") == "4" and _opt(server, "--context-length") == "34816"
    srun, _, torchrun = _step(next(a for a in sruns if "step-trainer" in a), "step-trainer")
    assert _opt(srun, "--nodes") == "2" and _opt(srun, "--gpus-per-node") == "8"
    assert (_opt(torchrun, "--nnodes"), _opt(torchrun, "--nproc-per-node")) == ("2", "8")
    run_config = Path(found["run config"])
    cfg = load_config(run_config)
    assert (cfg.parallel.tp, cfg.parallel.cp, cfg.actor.pack_sequences, cfg.rollout.max_new_tokens) == (
        4, 2, True, 32768)
    fit = (run_config.parent / "fit.log").read_text()
    assert "dp=2 cp=2 " in fit and "total 67.3 GiB of 80 GiB: fits" in fit

    res = _launch(tmp_path / "cp1", "--dryrun", f"train.output_dir={tmp_path / 'out1'}", "parallel.cp=1", launch=launch)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "fit check FAILED" in res.stderr and "actor does not fit: 95.9 GiB > 80 GiB per GPU" in res.stderr
    assert "raise parallel.cp (now 1" in res.stderr
    assert not (tmp_path / "cp1" / "nemorun").exists() and not (tmp_path / "out1").exists()  # nothing rendered


def test_the_python_tool_job(tmp_path):
    """examples/models/qwen3_14b_tir.yaml (#52) through nemo-run, as slurm/qwen3_14b_tir_tepo.sh: the 14B
    job's nodes and servers, and the run config carries the environment (the trainer builds the tool
    and its sandbox from it)."""
    from megatron_tepo.config import load_config

    res = _launch(tmp_path, "--dryrun", f"train.output_dir={tmp_path / 'out'}",
                  launch=ROOT / "examples" / "models" / "qwen3_14b_tir.yaml")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found = dict(re.findall(r"^(sbatch script|run config): (\S+)$", res.stdout, re.M))
    assert _sbatch_flags(Path(found["sbatch script"]).read_text())["nodes"] == "4"
    cfg = load_config(Path(found["run config"]))
    assert (cfg.environment.name, cfg.environment.format, cfg.environment.max_turns) == ("python", "qwen3", 6)
    assert cfg.environment.sandbox["kind"] == "bubblewrap" and cfg.rollout.max_new_tokens == 8192


@pytest.mark.parametrize("name, tp, ep", [("qwen3.5_27b", 4, 1), ("qwen3.5_35b_a3b", 2, 8)])
def test_the_qwen3_5_jobs(tmp_path, name, tp, ep):
    """examples/models/qwen3.5_*.yaml (#53) through nemo-run, as slurm/qwen3.5_*_tepo.sh: 4 nodes, the
    fit check passed (its recurrent state priced), the run config the file's layout."""
    from megatron_tepo.config import load_config

    res = _launch(tmp_path, "--dryrun", f"train.output_dir={tmp_path / 'out'}",
                  launch=ROOT / "examples" / "models" / f"{name}.yaml")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found = dict(re.findall(r"^(sbatch script|run config): (\S+)$", res.stdout, re.M))
    assert _sbatch_flags(Path(found["sbatch script"]).read_text())["nodes"] == "4"
    cfg = load_config(Path(found["run config"]))
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.actor.model_builder) == (tp, ep, "auto")
    assert " + recurrent state " in res.stdout + res.stderr


FAKE_SCONTROL = """#!/bin/bash
# stand-in: `scontrol show hostnames LIST` prints the test's hosts
if [[ "$1 $2" == "show hostnames" ]]; then printf '%s\\n' {hosts}; exit 0; fi
echo "scontrol $*" >> "$FAKE_LOG.scontrol"
"""
FAKE_SRUN = """#!/usr/bin/env python3
# stand-in: record argv and the TEPO_*, NCCL / torch / OMP environment; `hostname --ip-address` answers
import json, os, sys
if sys.argv[-2:] == ["hostname", "--ip-address"]:
    print("10.0.0.1"); sys.exit(0)
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items()
                        if k.startswith(("TEPO_", "NCCL_", "TORCH_NCCL_", "CUDA_", "PYTORCH_", "OMP_"))}}}}) + "\\n")
"""


def test_rendered_script_runs_the_split(rendered, tmp_path):
    """Execute the rendered script with stand-in scontrol/srun: the split evaluates to host names."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL.format(hosts=" ".join(HOSTS)))
    (bin_dir / "srun").write_text(FAKE_SRUN.format())
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "srun.jsonl"
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="77",
               SLURM_JOB_NODELIST="gpu[01-04]", SLURM_JOB_CPUS_PER_NODE="96(x3),64")
    res = subprocess.run(["bash", str(rendered["script"])], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "job exited with code 0" in res.stdout
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2
    by_step = {("sglang" if "step-sglang" in c["argv"] else "trainer"): c for c in calls}
    sg, tr = by_step["sglang"], by_step["trainer"]
    assert _opt(sg["argv"], "--nodelist") == "gpu03,gpu04"
    assert _opt(tr["argv"], "--nodelist") == "gpu01,gpu02"
    # every step: the node's CPUs (lib.sh's tepo_cpus_per_node: the fewest of any node of the job)
    assert _opt(sg["argv"], "--cpus-per-task") == "64" and _opt(tr["argv"], "--cpus-per-task") == "64"
    _, step, torchrun = _step(tr["argv"], "step-trainer")
    assert _opt(torchrun, "--rdzv-endpoint") == "gpu01:29500"
    assert _opt(torchrun, "--rdzv-id") == "77"
    urls = [f"http://{h}:{30000 + i}" for h in ("gpu03", "gpu04") for i in range(4)]
    assert tr["env"]["TEPO_SGLANG_URLS"] == ",".join(urls)
    assert tr["env"]["TEPO_RDZV_HOST"] == "gpu01"
    # one random API key per job, in both steps' environment; on no command line, not in the script
    key = tr["env"]["TEPO_SGLANG_API_KEY"]
    assert re.fullmatch(r"[0-9a-f]{32}", key) and sg["env"]["TEPO_SGLANG_API_KEY"] == key
    assert not any(key in w for c in calls for w in c["argv"]) and key not in rendered["text"]
    assert _opt(step, "--done-file") == str(rendered["run_config"].parent / "done.77.0")
    assert _opt(_step(sg["argv"], "step-sglang")[1], "--log-dir").endswith("/logs/nemo-run.77.0")
    # the job's NCCL network settings reach both steps; the trainer's own (step-trainer sets them
    # before torchrun) reach neither srun, so no SGLang server inherits them
    for c in (sg, tr):
        assert c["env"]["NCCL_IB_TIMEOUT"] == "22"
        assert {k for k in c["env"] if k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF",
                                              "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")} == set()


def test_bad_cpu_count_stops_the_script(rendered, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL.format(hosts=" ".join(HOSTS)))
    (bin_dir / "srun").write_text(FAKE_SRUN.format())
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "srun.jsonl"
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="79",
               SLURM_JOB_NODELIST="gpu[01-04]", TEPO_CPUS_PER_NODE="lots")
    res = subprocess.run(["bash", str(rendered["script"])], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "TEPO_CPUS_PER_NODE: expected a positive CPU count per node, got 'lots'" in res.stderr
    assert not log.exists()  # no task srun ran


def test_too_few_nodes_in_the_allocation_stops_the_script(rendered, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL.format(hosts="gpu01 gpu02 gpu03"))
    (bin_dir / "srun").write_text(FAKE_SRUN.format())
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "srun.jsonl"
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="78",
               SLURM_JOB_NODELIST="gpu[01-03]")
    res = subprocess.run(["bash", str(rendered["script"])], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert res.returncode == 1
    assert "has 3 node(s) but ACTOR_NODES=2 + ROLLOUT_NODES=2" in res.stderr
    assert not log.exists()  # no task srun ran


@pytest.mark.parametrize("override,needle", [
    ("launch.gpu_mem_gib=36", "raise parallel.tp or parallel.pp, or raise launch.actor_nodes"),
    ("parallel.tp=3", "parallel.tp=3 does not divide num_attention_heads=40"),
    ("launch.actor_nodes=0", "launch.actor_nodes: must be >= 1"),
    ("launch.sglang.tp=3", "launch.sglang.tp: 3 must be >= 1 and divide launch.gpus_per_node"),
])
def test_bad_launch_fails_before_rendering(tmp_path, override, needle):
    res = _launch(tmp_path, "--dryrun", f"train.output_dir={tmp_path / 'out'}", override)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "fit check FAILED" in res.stderr and needle in res.stderr
    assert not (tmp_path / "nemorun").exists()  # no experiment, no sbatch script
    assert not (tmp_path / "out").exists()  # no run config


@pytest.mark.parametrize("trainer,sglang,needles", [
    (dict(te=False), dict(sglang=True, cuda=None),
     ["actor.sequence_parallel: true needs Transformer Engine", "set --python (or TEPO_PYTHON) to",
      "has torch 2.6.0+cpu (CPU build): set MTEPO_SGLANG_PYTHON to"]),
    (dict(cuda=None, te=False), dict(sglang=False), ["has torch 2.6.0+cpu (CPU build): set --python (or TEPO_PYTHON)",
                                                     "cannot import sglang: set MTEPO_SGLANG_PYTHON"]),
], ids=["pypi-torch-and-cpu-sglang", "cpu-torch-no-sglang"])
def test_a_cuda_launch_with_cpu_pythons_fails_before_rendering(tmp_path, trainer, sglang, needles):
    """The pythons of the nodes are checked at submission (megatron_tepo/launch/pythons.py): the
    README's test environments (a PyPI torch without Transformer Engine, SGLang's CPU build) are
    refused in one line naming the setting, and nothing is rendered."""
    pythons = {"TEPO_PYTHON": str(standin_python(tmp_path / "venv", **trainer)),
               "MTEPO_SGLANG_PYTHON": str(standin_python(tmp_path / "venv-sglang", **sglang))}
    res = _launch(tmp_path, "--dryrun", f"train.output_dir={tmp_path / 'out'}", pythons=pythons)
    assert res.returncode == 2, res.stdout + res.stderr
    line = next(x for x in res.stderr.splitlines() if "fit check FAILED (nothing rendered or submitted)" in x)
    assert all(n in line for n in needles), line
    assert not (tmp_path / "nemorun").exists() and not (tmp_path / "out").exists()


def test_slurm_needs_an_account(tmp_path):
    res = subprocess.run([sys.executable, str(TOOL), "--launch", str(LAUNCH), "--dryrun"],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "--account is required" in res.stderr


def test_local_executor_dryrun_renders_both_tasks(tmp_path):
    res = subprocess.run([sys.executable, str(TOOL), "--launch", str(ROOT / "examples" / "models" / "tiny_cpu.yaml"),
                          "--executor", "local", "--dryrun", "--nemorun-home", str(tmp_path / "home"),
                          f"train.output_dir={tmp_path / 'out'}"],
                         capture_output=True, text=True, env=_env(COLUMNS="400"), cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    for word in ("'step-sglang'", "'step-trainer'", "'megatron_tepo.rollout.sglang.server'", "'torch.distributed.run'",
                 "'--nproc-per-node=2'", "'--standalone'", "'--device'", "'cpu'"):
        assert word in out, word


def _decoded_files(folder: Path):
    """(path, text) of every file under ``folder``, with nemo-run's zlib+base64 JSON blobs (_TASKS,
    _CONFIG) decoded as well."""
    import base64
    import zlib

    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        text = path.read_bytes().decode(errors="replace")
        yield path, text
        for blob in re.findall(r"eJ[A-Za-z0-9_\-]+=*", text):
            try:
                yield path, zlib.decompress(base64.urlsafe_b64decode(blob)).decode(errors="replace")
            except (ValueError, zlib.error):
                pass


def test_local_executor_writes_no_api_key(tmp_path):
    """nemo-run writes the executors' env_vars to its experiment folder (configs/*_executor.yaml,
    _TASKS) and prints them in a dry run: the key is in none of them; the steps inherit it."""
    key = "f00dfeed" * 4
    home = tmp_path / "home"
    res = subprocess.run([sys.executable, str(TOOL), "--launch", str(ROOT / "examples" / "models" / "tiny_cpu.yaml"),
                          "--executor", "local", "--dryrun", "--nemorun-home", str(home),
                          f"train.output_dir={tmp_path / 'out'}"],
                         capture_output=True, text=True, env=_env(COLUMNS="400", TEPO_SGLANG_API_KEY=key),
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert key not in res.stdout + res.stderr
    files = list(_decoded_files(home))
    executor_yamls = [p for p, _ in files if p.name.endswith("_executor.yaml")]
    assert len(executor_yamls) == 2 and any(p.name == "_TASKS" for p, _ in files), [str(p) for p, _ in files]
    assert any("TEPO_SGLANG_URLS" in t for p, t in files if p.name == "_TASKS")  # decoded: env_vars seen
    for path, text in files + list(_decoded_files(tmp_path / "out")):
        assert key not in text, path
        if path.name.endswith("_executor.yaml") or path.name == "_TASKS":
            assert "TEPO_SGLANG_API_KEY" not in text, path  # not even another key of the user's


def test_local_steps_inherit_the_key_from_the_launcher(tmp_path):
    """What `launch` does before `exp.run` (local_api_key), then a real nemo-run LocalExecutor task:
    it sees the key in its environment, and no file in the experiment folder holds it."""
    probe = tmp_path / "probe.py"
    probe.write_text("import hashlib, os\n"  # (a digest: the key itself must be in no file)
                     "print('KEY=' + hashlib.sha256(os.environ.get('TEPO_SGLANG_API_KEY', 'unset').encode()).hexdigest())\n")
    code = f"""
import os, sys
import megatron_tepo.launch.nemo_run as lnr
env = {{}}
lnr.local_api_key(env)
assert len(env["TEPO_SGLANG_API_KEY"]) == 32, env
kept = {{"TEPO_SGLANG_API_KEY": "users-own-key"}}
lnr.local_api_key(kept)
assert kept == {{"TEPO_SGLANG_API_KEY": "users-own-key"}}, kept
os.environ.pop("TEPO_SGLANG_API_KEY", None)
lnr.local_api_key()
print("LAUNCHER=" + os.environ["TEPO_SGLANG_API_KEY"], flush=True)
import nemo_run as run
with run.Experiment("keyprobe", executor=None, log_level="WARN") as exp:
    exp.add(run.Script(path={str(probe)!r}, entrypoint=sys.executable), executor=run.LocalExecutor(), name="probe")
    exp.run(sequential=True, detach=False, tail_logs=False)
print("EXPDIR=" + exp._exp_dir, flush=True)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(NEMORUN_HOME=str(tmp_path / "home")), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    key = re.search(r"^LAUNCHER=([0-9a-f]{32})$", res.stdout, re.M).group(1)
    logs = [p for p in (tmp_path / "home").rglob("*.out")] + [p for p in (tmp_path / "home").rglob("*.log")]
    seen = [t for p in logs for t in re.findall(r"KEY=(\S+)", p.read_text(errors="replace"))]
    assert seen and set(seen) == {hashlib.sha256(key.encode()).hexdigest()}, (seen, [str(p) for p in logs], res.stdout[-2000:])
    files = list(_decoded_files(tmp_path / "home"))
    assert any(p.name == "_TASKS" for p, _ in files), [str(p) for p, _ in files]
    for path, text in files:
        assert key not in text, path


def test_local_executor_refuses_a_multi_node_layout(tmp_path):
    res = subprocess.run([sys.executable, str(TOOL), "--launch", str(LAUNCH), "--executor", "local", "--dryrun",
                          "--nemorun-home", str(tmp_path / "home"), f"train.output_dir={tmp_path / 'out'}"],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert res.returncode == 2 and "needs launch.actor_nodes=1" in res.stderr
    assert not (tmp_path / "home").exists()


# ---- the two steps' end-of-job protocol (what runs on the nodes), with stand-in commands ----
def _health_server():
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _step_cmd(*args):
    return [sys.executable, str(TOOL), *args]


def test_step_trainer_waits_for_health_and_records_its_status(tmp_path):
    srv = _health_server()
    done = tmp_path / "done.1.0"
    try:
        res = subprocess.run(_step_cmd("step-trainer", "--urls", f"http://127.0.0.1:{srv.server_port}",
                                       "--health-timeout", "30", "--done-file", str(done), "--",
                                       sys.executable, "-c", "raise SystemExit(3)"),
                             capture_output=True, text=True, env=_env(), timeout=120)
    finally:
        srv.shutdown()
    assert res.returncode == 3, res.stderr
    assert done.read_text().strip() == "3"
    assert "all SGLang servers healthy" in res.stderr


@pytest.mark.parametrize("device,user,want", [
    ("cuda", {}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                  "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "OMP_NUM_THREADS": "3"},
     {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "3", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}),
    ("cpu", {}, {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": None,
                 "PYTORCH_CUDA_ALLOC_CONF": None}),
])
def test_step_trainer_gives_torchrun_the_trainers_settings(tmp_path, device, user, want):
    """slurm/lib.sh's tepo_trainer_env, set by the trainer's step only (the setup lines export none
    of them: no server inherits them); the user's values win."""
    srv = _health_server()
    env = {k: v for k, v in _env(**user).items() if k in user or k not in want}
    show = "import json, os, sys; print('ENV=' + json.dumps({k: os.environ.get(k) for k in sys.argv[1:]}))"
    try:
        res = subprocess.run(_step_cmd("step-trainer", "--urls", f"http://127.0.0.1:{srv.server_port}",
                                       "--health-timeout", "30", "--done-file", str(tmp_path / "done"),
                                       "--device", device, "--", sys.executable, "-c", show, *want),
                             capture_output=True, text=True, env=env, timeout=120)
    finally:
        srv.shutdown()
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.split("ENV=", 1)[1]) == want


def test_step_trainer_gives_up_on_unhealthy_servers(tmp_path):
    done = tmp_path / "done"
    res = subprocess.run(_step_cmd("step-trainer", "--urls", "http://127.0.0.1:9", "--health-timeout", "1",
                                   "--done-file", str(done), "--", sys.executable, "-c", "print('ran')"),
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert res.returncode == 1 and "not healthy after 1s" in res.stderr and "ran" not in res.stdout
    assert done.read_text().strip() == "1"  # the servers' step stops too


def test_step_sglang_stops_with_the_trainers_status(tmp_path):
    done = tmp_path / "done"
    proc = subprocess.Popen(_step_cmd("step-sglang", "--ports", "40001,40002", "--gpus-per-server", "1",
                                      "--device", "cpu", "--done-file", str(done), "--log-dir", str(tmp_path / "logs"),
                                      "--poll", "0.2", "--", sys.executable, "-c",
                                      "import sys, time; print('port', sys.argv[1], flush=True); time.sleep(600)",
                                      "{port}"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    logs = tmp_path / "logs"
    deadline = time.monotonic() + 90  # the step imports the fleet's code (torch) before it starts them
    while [p.read_text().strip() for p in sorted(logs.glob("sglang.*.log"))] != ["port 40001", "port 40002"]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)[1]
        time.sleep(0.2)
    time.sleep(1)
    assert proc.poll() is None  # the stand-in servers keep running
    done.write_text("5\n")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err
    assert "the trainer finished with status 5: stopping the servers" in err


def _gone(pid: int) -> bool:
    """No such process, or a zombie (killed, waiting for whoever reaps orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def test_step_sglang_stops_each_servers_process_group(tmp_path):
    """The SGLang fleet's stop_server: TERM to a server's whole process group, KILL after the grace.
    A stand-in server that ignores TERM, and a worker it forked that ignores it too, are both gone
    when the step returns."""
    done, pids = tmp_path / "done", tmp_path / "pids"
    worker = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    server = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"w = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
              f"open({str(pids)!r} + '.tmp', 'w').write(f'{{os.getpid()}} {{w.pid}}'); "
              f"os.replace({str(pids)!r} + '.tmp', {str(pids)!r}); time.sleep(600)")
    proc = subprocess.Popen(_step_cmd("step-sglang", "--ports", "40005", "--gpus-per-server", "1", "--device", "cpu",
                                      "--done-file", str(done), "--log-dir", str(tmp_path / "logs"), "--poll", "0.2",
                                      "--grace", "1", "--", sys.executable, "-c", server),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 90
    while not pids.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)[1]
        time.sleep(0.2)
    server_pid, worker_pid = map(int, pids.read_text().split())
    assert not _gone(server_pid) and not _gone(worker_pid)
    done.write_text("0\n")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert _gone(server_pid) and _gone(worker_pid), err


def test_step_sglang_fails_when_a_server_dies(tmp_path):
    res = subprocess.run(_step_cmd("step-sglang", "--ports", "40003", "--gpus-per-server", "1", "--device", "cpu",
                                   "--done-file", str(tmp_path / "done"), "--log-dir", str(tmp_path / "logs"),
                                   "--poll", "0.2", "--", sys.executable, "-c",
                                   "import sys; print('boom', flush=True); sys.exit(2)", "{port}"),
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert res.returncode == 1
    assert "server 0 exited with status 2" in res.stderr and "boom" in res.stderr
