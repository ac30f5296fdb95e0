"""Colocated launches (issue #34 points 1, 4, 5): ``launch.rollout.placement: colocated`` puts the
SGLang servers on the actor's GPUs; the fit check prices each phase of a step at every offload
level, picks the least that fits and derives the servers' ``mem_fraction_static``; the run config
gets ``rollout.colocated`` and that level (a run config that says otherwise: one line naming both);
the launch sequence releases every server's memory before the trainer starts (lib.sh and the
nemo-run launcher, the same step). The arithmetic: docs/LAUNCH.md ("Colocated layouts")."""
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from megatron_tepo.config import ConfigError, load_config
from megatron_tepo.launch import FitError, check_fit, load_launch, serve_args, shell_vars, write_run_config
from megatron_tepo.launch.memory import GiB, actor_memory, server_memory
from megatron_tepo.launch.sequence import RELEASE_TAGS, job_steps, release_servers

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"
Q14 = MODELS / "qwen3_14b_colocated.yaml"
Q7 = MODELS / "qwen2.5_7b_colocated.yaml"


def _fit(path, *overrides):
    spec = load_launch(path, list(overrides))
    return spec, check_fit(spec.shape(), spec.cfg, spec.launch, raise_error=False)


# ------------------------------------------------------------------------------ the fit check
def test_one_node_14b_fits_with_each_phase_peak(capsys, tmp_path):
    """The issue's acceptance: the one-node Qwen3-14B colocated layout fits, each phase's peak in the
    report; every number by hand (GiB = 2**30 B; the formulas of docs/LAUNCH.md)."""
    from tools.fit_check import cli

    assert cli(["--config", str(Q14), "--write-run-config", str(tmp_path / "run.yaml")]) == 0
    out = capsys.readouterr().out
    # actor TP 4, DP 2 on the 8 GPUs of one node, 3,692,395,520 parameters a GPU:
    w, g, o = 2 * 3_692_395_520, 4 * 3_692_395_520, 12 * 3_692_395_520 / 2  # bf16 weights, fp32 grads, Adam / DP
    spec = load_launch(Q14)
    a = actor_memory(spec.shape(), spec.cfg, spec.launch)
    assert (a.weights, a.grads, a.optimizer, a.dp) == (w, g, o, 2)
    # 4 servers at TP 2: 7,384,366,080 parameters of weights a GPU, 56 x 10,240 tokens x 81,920 B of KV
    s = server_memory(spec.shape(), spec.cfg, spec.launch)
    assert (s.weights, s.kv_cache, s.servers) == (2 * 7_384_366_080, 56 * 10_240 * 81_920, 4)
    # mem_fraction_static: (weights 13.75 + KV 43.75 + released 1.5 GiB) / 80 = 0.7378 -> 0.74
    pool = 0.74 * 80 * GiB
    rollout = w + 4 * GiB + pool + 3 * GiB  # optimizer_grads: the actor keeps its bf16 weights
    training = a.total + 1.5 * GiB
    sync = w + 4 * GiB + 3 * 256 * 2 ** 20 + s.weights + 1.5 * GiB
    assert abs(rollout / GiB - 73.08) < 0.01 and abs(training / GiB - 50.14) < 0.01 and abs(sync / GiB - 26.88) < 0.01
    for line in ["mem_fraction_static 0.74 (derived: 59.2 GiB)",
                 # pinned: what moves, one block a part, and the async save's staging (2x a rank's weights
                 # and optimizer shard: torch's pinned allocator rounds each staged tensor to a power of two)
                 "offload: optimizer_grads (the least that fits): 34.4 GiB per GPU to host and back each step; "
                 f"pinned host memory {8 * (g + o + 2 * (w + o)) / GiB:.1f} GiB per node (with the async save's "
                 f"staging, {2 * (w + o) / GiB:.1f} GiB per GPU) (not checked: not inside the job",
                 f"rollout phase peak {rollout / GiB:.1f} GiB: the actor keeps {w / GiB:.1f} GiB",
                 f"training phase peak {training / GiB:.1f} GiB: the whole actor {a.total / GiB:.1f} GiB",
                 f"sync phase peak {sync / GiB:.1f} GiB", "peak 73.1 GiB of 80 GiB per GPU: fits",
                 "room for 65 sequences per server",
                 # the lesser levels, and why they do not fit: the actor's optimizer (and grads) stay
                 f"offload none: rollout {(a.total - a.reserve + 4 * GiB + pool + 3 * GiB) / GiB:.1f} GiB",
                 f"offload optimizer: rollout {(w + g + 4 * GiB + pool + 3 * GiB) / GiB:.1f} GiB"]:
        assert line in out, (line, out)
    assert "offload none: rollout 110.8 GiB" in out and "does not fit" in out.split("offload optimizer:")[1]
    # what the trainer and the servers get
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.rollout.colocated and cfg.actor.offload == "optimizer_grads" and cfg.rollout.max_staleness == 0
    assert cfg.rollout.sync_mode == "ipc"
    args = serve_args(spec)
    assert "--enable-memory-saver" in args and args[args.index("--mem-fraction-static") + 1] == "0.74"
    v = shell_vars(spec)
    assert (v["FIT_PLACEMENT"], v["FIT_ROLLOUT_NODES"], v["FIT_SERVERS_PER_NODE"], v["FIT_RELEASE_TAGS"]) == (
        "colocated", "0", "4", "weights,kv_cache,cuda_graph")
    assert v["FIT_STEPS"].split() == ["split_nodes", "job_env", "servers", "health", "release", "trainer"]


def test_the_issues_tp8_arithmetic():
    """The issue's figures at TP 8 (one TP-8 server): the actor needs ~37 GiB a GPU (36.9 with the fused LM head), the server 3.4 GiB
    of weights; offloading the optimizer and gradients moves 27.5 GiB a GPU, 220 GiB pinned a node."""
    spec, report = _fit(Q14, "parallel.tp=8", "launch.sglang.tp=8")
    c = report.colocated
    assert abs(report.actor.total / GiB - 36.95) < 0.01 and abs(report.server.weights / GiB - 3.44) < 0.01
    assert c.least == "none" and c.capacity("none") == 179  # sequences of 10,240 tokens (the issue: ~170)
    og = c.levels["optimizer_grads"]
    assert abs(og.moved / GiB - 27.51) < 0.01 and abs(8 * og.moved / GiB - 220.1) < 0.1
    a = report.actor  # pinned beside it: the async save's staging, at most 2x the rank's weights and optimizer
    assert og.staging == 2 * (a.weights + a.optimizer) and og.host_per_node == 8 * (og.moved + og.staging)
    spec, report = _fit(Q14, "parallel.tp=8", "launch.sglang.tp=8", "train.async_save=false")
    og = report.colocated.levels["optimizer_grads"]
    assert og.staging == 0 and abs(og.host_per_node / GiB - 220.1) < 0.1


@pytest.mark.parametrize("path,overrides,least", [
    (Q7, [], "none"),  # the whole actor fits beside 4 TP-2 servers
    (Q7, ["launch.sglang.tp=1"], "optimizer"),  # 8 TP-1 servers: 14.2 GiB of weights a GPU
    (Q14, [], "optimizer_grads"),
    (Q14, ["launch.sglang.max_running_requests=70"], "all"),  # room for 65 at optimizer_grads, 73 at all
])
def test_the_least_offload_that_fits_is_picked(path, overrides, least):
    spec, report = _fit(path, *overrides)
    c = report.colocated
    assert c.least == c.level == least == spec.cfg.actor.offload and report.colocated_fits
    order = ["none", "optimizer", "optimizer_grads", "all"]
    assert [c.levels[lv].fits for lv in order] == [order.index(lv) >= order.index(least) for lv in order]


@pytest.mark.parametrize("overrides,needle", [
    (["launch.sglang.max_running_requests=80"],
     "no actor.offload level fits, not even all (at all): rollout phase 85.4 GiB > 80 GiB per GPU; "
     "lower launch.sglang.max_running_requests (room for 73 per server at offload all), or raise launch.sglang.tp"),
    (["actor.offload=optimizer"],
     "actor.offload: optimizer does not fit (the least that fits: optimizer_grads): rollout phase 86.8 GiB > 80 GiB "
     "per GPU; set actor.offload: optimizer_grads (or auto)"),
    (["launch.host_mem_gib=750", "actor.offload=all"],
     "actor.offload: all does not fit (the least that fits: optimizer_grads): pinned host memory 770 GiB > "
     "750 GiB per node (launch.host_mem_gib)"),
    (["launch.gpu_mem_gib=48"], "training phase 50.1 GiB"),
])
def test_a_misfit_is_one_line_naming_the_setting(overrides, needle):
    spec = load_launch(Q14, overrides)
    with pytest.raises(FitError) as err:
        check_fit(spec.shape(), spec.cfg, spec.launch)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_an_offload_level_of_the_users_that_fits_is_kept():
    spec, report = _fit(Q14, "actor.offload=all")
    assert spec.cfg.actor.offload == "all" and report.colocated_fits
    assert "offload: all (actor.offload; the least that fits: optimizer_grads)" in report.render()


# ------------------------------------------------------------------- launch file and run config
def _file(tmp_path, launch, **run):
    data = yaml.safe_load(Q14.read_text())
    data["_base_"] = str((MODELS / data["_base_"]).resolve())
    data["launch"] = launch
    for key, section in run.items():
        data[key] = {**data.get(key, {}), **section}
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("launch,run,overrides,needle", [
    ({"sglang": {"placement": "colocated"}}, {}, ["rollout.colocated=false"],
     r"rollout.colocated \(override 'rollout.colocated=false'\): false contradicts launch.sglang.placement: "
     r"colocated \(.*launch.yaml:\d+: the servers and the actor take turns with the GPUs\)"),
    ({"sglang": {"placement": "colocated"}}, {"rollout": {"max_staleness": 1}}, [],
     r"rollout.max_staleness \(.*launch.yaml:\d+\): 1 \(one-step-off generation.*\) contradicts "
     r"launch.sglang.placement: colocated .*: set rollout.max_staleness: 0"),
    ({"sglang": {"placement": "colocated"}}, {"rollout": {"partial_rollout": True, "max_staleness": 2}}, [],
     r"rollout.partial_rollout \(.*launch.yaml:\d+\): true \(partial rollout.*\) contradicts "
     r"launch.sglang.placement: colocated .*: set rollout.partial_rollout: false"),
    ({"actor_nodes": 2, "rollout_nodes": 2}, {"rollout": {"colocated": True}}, [],
     r"rollout.colocated \(.*launch.yaml:\d+\): true, but launch.rollout.placement is separate .*: set "
     r"launch.rollout.placement: colocated, or rollout.colocated: false"),
    ({"sglang": {"placement": "colocated", "mem_fraction_static": 0.8}}, {}, [],
     r"launch.sglang.mem_fraction_static \(.*launch.yaml:\d+\): launch.sglang.placement: colocated derives it"),
    ({"rollout_nodes": 1, "sglang": {"placement": "colocated"}}, {}, [],
     r"launch.rollout_nodes \(.*launch.yaml:\d+\): 1, but launch.sglang.placement: colocated puts the servers on "
     r"the actor's nodes"),
    ({"rollout_nodes": 0}, {}, [],
     r"launch.rollout_nodes: 0 on cuda puts the rollout servers on the actor's GPUs: set launch.rollout.placement: "
     r"colocated"),
    ({"sglang": {"placement": "colocated"}}, {"rollout": {"sync_mode": "distributed"}}, [],
     r"rollout.sync_mode \(.*launch.yaml:\d+\): distributed \(an NCCL group .*\) contradicts launch.sglang.placement: "
     r"colocated .*: set rollout.sync_mode: ipc \(or tensor\)"),
    ({"sglang": {"placement": "together"}}, {}, [],
     r"launch.sglang.placement .*: expected one of 'separate', 'colocated', found 'together'"),
], ids=["colocated-false", "one-step-off", "partial-rollout", "colocated-without-placement", "mem-fraction", "rollout-nodes",
        "rollout-nodes-0-on-cuda", "nccl-sync-on-shared-gpus", "bad-placement"])
def test_a_run_config_that_contradicts_the_launch_is_one_line_naming_both(tmp_path, launch, run, overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_launch(_file(tmp_path, launch, **run), overrides)
    assert re.search(needle, str(err.value)) and "\n" not in str(err.value), str(err.value)


def test_a_disaggregated_launch_takes_partial_rollout():
    spec = load_launch(MODELS / "qwen3_14b.yaml", ["rollout.partial_rollout=true", "rollout.max_staleness=2"])
    assert not spec.launch.colocated and spec.cfg.rollout.partial_rollout and spec.cfg.rollout.max_staleness == 2
    check_fit(spec.shape(), spec.cfg, spec.launch)  # (the mode changes nothing the fit check prices)


def test_cpu_colocated_keeps_the_run_configs_offload_and_no_memory_saver():
    """The tiny CPU job colocated (an override of its launch file): the servers beside the trainer
    take turns too; no GPU arithmetic, so the run config's offload stays (auto) and SGLang's memory
    saver, a CUDA library, is not asked for (a CPU server's release frees nothing)."""
    spec = load_launch(MODELS / "tiny_cpu.yaml", ["launch.sglang.placement=colocated"])
    assert spec.launch.colocated and spec.launch.rollout_nodes == 0 and spec.cfg.rollout.colocated
    assert spec.cfg.actor.offload == "auto" and "--enable-memory-saver" not in serve_args(spec)
    assert "release" in job_steps(spec.cfg, spec.launch)
    # as written (placement separate): servers beside the trainer, no turns, no release step
    plain = load_launch(MODELS / "tiny_cpu.yaml")
    assert plain.launch.shares_actor_nodes and not plain.launch.colocated and not plain.cfg.rollout.colocated
    assert "release" not in job_steps(plain.cfg, plain.launch) and shell_vars(plain)["FIT_RELEASE_TAGS"] == ""
    # the embedded engine generates inside the trainer: nothing to start or release
    embedded = load_launch(MODELS / "tiny_cpu.yaml", ["launch.sglang.placement=colocated", "rollout.engine=embedded"])
    assert job_steps(embedded.cfg, embedded.launch) == ("split_nodes", "job_env", "trainer")


def test_release_tags_are_the_engines_memory_tags():
    from megatron_tepo.rollout.engine import MEMORY_TAGS

    assert RELEASE_TAGS == MEMORY_TAGS


# ------------------------------------------------------------------------- the release step
class _Recorder(BaseHTTPRequestHandler):
    calls = []  # (path, body, Authorization)
    refuse = False

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        type(self).calls.append((self.path, body, self.headers.get("Authorization")))
        code = 400 if type(self).refuse and self.path == "/release_memory_occupation" else 200
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "not idle"}' if code != 200 else b"{}")

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def standin_servers():
    """Two stand-in SGLang servers that record what they are sent."""
    handler = type("Recorder", (_Recorder,), {"calls": [], "refuse": False})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield handler, [f"http://127.0.0.1:{s.server_port}" for s in servers]
    for s in servers:
        s.shutdown()


def test_release_servers_posts_the_fleets_calls_with_the_key(standin_servers):
    handler, urls = standin_servers
    release_servers(urls, "k-3e1", log=lambda msg: None)
    bearer = "Bearer k-3e1"
    one = [("/pause_generation", {"mode": "abort"}, bearer),
           ("/release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]}, bearer),
           ("/continue_generation", {}, bearer)]
    assert handler.calls == one + one
    handler.refuse = True
    with pytest.raises(RuntimeError, match=r"release: http://127.0.0.1:\d+/release_memory_occupation: HTTP 400"):
        release_servers(urls, "k-3e1", log=lambda msg: None)


def test_lib_sh_release_step_exports_what_it_released(standin_servers, tmp_path):
    """slurm/lib.sh's tepo_step_release: the servers of TEPO_SGLANG_URLS released with the key of the
    environment (on no command line), then TEPO_SGLANG_RELEASED for the trainer's step."""
    handler, urls = standin_servers
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TEPO_"))}
    env.update(TEPO_ROOT=str(ROOT), TEPO_PYTHON=sys.executable, TEPO_SGLANG_URLS=",".join(urls),
               TEPO_SGLANG_API_KEY="k-77", FIT_RELEASE_TAGS="weights,kv_cache,cuda_graph", LOG_DIR=str(tmp_path))
    script = f'source "{ROOT}/slurm/lib.sh"; tepo_step_release; bash -c \'echo "R=$TEPO_SGLANG_RELEASED"\''
    res = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "R=weights,kv_cache,cuda_graph"
    assert [c[0] for c in handler.calls].count("/release_memory_occupation") == 2
    assert {c[2] for c in handler.calls} == {"Bearer k-77"}
    assert f"released weights,kv_cache,cuda_graph on {urls[1]}" in (tmp_path / "release.log").read_text()
    handler.refuse = True
    res = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "R=" not in res.stdout
    assert "releasing the SGLang servers' memory failed" in res.stderr and "HTTP 400" in res.stderr


def test_nemo_run_step_trainer_releases_once_before_torchrun(standin_servers, tmp_path):
    """The nemo-run launcher's trainer task: after the health wait node 0 releases every server, then
    starts torchrun with TEPO_SGLANG_RELEASED; another node releases nothing (its torchrun waits at
    the rendezvous for node 0's)."""
    handler, urls = standin_servers
    show = "import os; print('RELEASED=' + os.environ.get('TEPO_SGLANG_RELEASED', '-'))"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TEPO_"))}
    env.update(OMP_NUM_THREADS="1", TEPO_SGLANG_API_KEY="k-9")
    for node, calls in (("1", 0), ("0", 3 * len(urls))):
        res = subprocess.run([sys.executable, str(ROOT / "tools" / "launch_nemo_run.py"), "step-trainer", "--urls",
                              ",".join(urls), "--health-timeout", "30", "--done-file", str(tmp_path / "done"),
                              "--device", "cpu", "--release", ",".join(RELEASE_TAGS), "--",
                              sys.executable, "-c", show], env=dict(env, SLURM_NODEID=node),
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "RELEASED=weights,kv_cache,cuda_graph" in res.stdout
        assert len(handler.calls) == calls, handler.calls


def test_nemo_run_renders_the_colocated_job(tmp_path):
    """The nemo-run equivalent of slurm/qwen3_14b_tepo_colocated.sh, rendered offline: one node, both
    tasks on the actor node with its 8 GPUs (--overlap), the release before torchrun."""
    from megatron_tepo.launch import nemo_run

    plan = nemo_run.make_plan(str(Q14), [])
    assert (plan.total_nodes, plan.server_nodes, plan.servers_per_node) == (1, 1, 4)
    assert plan.steps == ("split_nodes", "job_env", "servers", "health", "release", "trainer")
    assert re.findall(r"^# step (\w+)$", nemo_run.setup_lines(plan, "/py"), re.M) == list(plan.steps)
    cmds = nemo_run.step_commands(plan, tmp_path, "/py", slurm=True, rdzv_port=29500, health_timeout=60)
    trainer = cmds["trainer"]
    assert trainer[trainer.index("--release") + 1] == "weights,kv_cache,cuda_graph"
    assert trainer.index("--release") < trainer.index("torch.distributed.run")
    sglang = cmds["sglang"]
    assert "--enable-memory-saver" in sglang and sglang[sglang.index("--mem-fraction-static") + 1] == "0.74"
    assert sglang[sglang.index("--gpus-per-server") + 1] == "2" and "30000,30001,30002,30003" in sglang
    for role in ("sglang", "trainer"):
        args = nemo_run.srun_args(plan, role)
        assert "--nodes=1" in args and "--gpus-per-node=8" in args and "--overlap" in args, args
    assert nemo_run.srun_args(plan, "sglang")[2] == '--nodelist="$TEPO_ROLLOUT_NODELIST"'
    # the setup's node split: the rollout hosts are the actor hosts (rollout_nodes 0)
    split = next(line for line in nemo_run.setup_lines(plan, "/py").splitlines() if line.startswith("tepo_split"))
    assert split.startswith("tepo_split_nodes 1 0 ")


def test_separate_layouts_are_unchanged():
    """The 4-node layout: no release step, no memory saver, the file's mem_fraction_static."""
    spec = load_launch(MODELS / "qwen3_14b.yaml")
    assert not spec.launch.colocated and "release" not in job_steps(spec.cfg, spec.launch)
    args = serve_args(spec)
    assert "--enable-memory-saver" not in args and args[args.index("--mem-fraction-static") + 1] == "0.85"
    assert not spec.cfg.rollout.colocated and spec.cfg.actor.offload == "auto"
    assert check_fit(spec.shape(), spec.cfg, spec.launch).colocated is None


def test_write_run_config_of_the_7b(tmp_path):
    spec = load_launch(Q7)
    cfg = load_config(write_run_config(spec, tmp_path / "run.yaml"))
    assert cfg.rollout.colocated and cfg.actor.offload == "none"
    assert shlex.join(serve_args(spec)).count("--enable-memory-saver") == 1


def test_the_host_memory_check_reads_the_node_inside_the_job_and_says_which_figure(tmp_path):
    """Issue #40 row 6: the pinned host memory is checked by default: against launch.host_mem_gib when
    set (0: not checked), else, inside the job, the job's memory per node or the node's MemTotal; a dry
    run (or a login node) checks nothing and says so."""
    from megatron_tepo.launch.fit import node_host_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2113487872 kB\nMemFree:        1 kB\n")
    L = load_launch(Q14).launch
    job = {"SLURM_JOB_ID": "7"}
    assert node_host_memory(L, job, str(meminfo)).bytes == 2113487872 * 1024
    assert "MemTotal of" in node_host_memory(L, job, str(meminfo)).source
    assert node_host_memory(L, {**job, "SLURM_MEM_PER_NODE": "1048576"}, str(meminfo)).bytes == 2 ** 40
    assert node_host_memory(L, {**job, "TEPO_DRY_RUN": "1"}, str(meminfo)).bytes == 0
    assert node_host_memory(L, {}, str(meminfo)).source.startswith("not checked: not inside the job")
    L = load_launch(Q14, ["launch.host_mem_gib=512"]).launch
    assert node_host_memory(L, job, str(meminfo)).bytes == 512 * GiB  # the setting wins
    L = load_launch(Q14, ["launch.host_mem_gib=0"]).launch
    assert node_host_memory(L, job, str(meminfo)).bytes == 0  # turned off
