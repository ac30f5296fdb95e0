"""The SGLang command line comes from one place (rollout/sglang/server.py's server_command), used
by launch_server and by the serve command, `python -m megatron_tepo.rollout.sglang.server` (which
slurm/lib.sh runs)."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tepo.rollout.sglang import launch, server
from megatron_tepo.rollout.sglang.server import ServerConfig, server_command

ROOT = Path(__file__).resolve().parents[2]
CPU_FLAGS = ["--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
             "--sleep-on-idle"]


LAUNCHER = str(ROOT / "megatron_tepo" / "rollout" / "sglang" / "launch.py")


def test_cpu_command_and_env():
    cfg = ServerConfig(model_path="/m", python="/py", threads_per_server=3, env={"X": "1"})
    base = {"PYTHONPATH": "/somewhere", "OMP_NUM_THREADS": "8", "KEEP": "k"}
    argv, env = server_command(cfg, 1234, "key-1f2e", base_env=base)
    assert argv[:2] == ["/py", LAUNCHER]
    assert argv[2:] == ["--model-path", "/m", "--host", "127.0.0.1", "--port", "1234",
                        "--dtype", "bfloat16", "--device", "cpu", "--mem-fraction-static", "0.5",
                        "--skip-server-warmup", "--max-total-tokens", "4096", *CPU_FLAGS]
    assert env == {"KEEP": "k", "OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "SGLANG_USE_CPU_ENGINE": "1",
                   "CUDA_VISIBLE_DEVICES": "", "X": "1", "TEPO_SGLANG_API_KEY": "key-1f2e"}
    assert base["OMP_NUM_THREADS"] == "8" and "PYTHONPATH" in base  # pure: the input is not touched


def test_api_key_never_in_argv():
    """The key goes to the server in its environment (ps shows a command line to every user)."""
    cfg = ServerConfig(model_path="/m", python="/py", device="cuda")
    argv, env = server_command(cfg, 1, "sekret-77", base_env={})
    assert not any("sekret-77" in a for a in argv) and "--api-key" not in argv
    assert env["TEPO_SGLANG_API_KEY"] == "sekret-77"
    # no key: none inherited from the caller's environment either
    argv, env = server_command(cfg, 1, None, base_env={"TEPO_SGLANG_API_KEY": "stale"})
    assert "TEPO_SGLANG_API_KEY" not in env and "--api-key" not in argv


def test_launcher_takes_the_key_from_the_environment():
    assert launch.sglang_argv(["--port", "1"], {"TEPO_SGLANG_API_KEY": "k9"}) == [
        "--port", "1", "--api-key", "k9"]
    assert launch.sglang_argv(["--port", "1"], {"TEPO_SGLANG_API_KEY": ""}) == ["--port", "1"]
    for bad in (["--api-key", "k"], ["--api-key=k"]):
        with pytest.raises(SystemExit, match="TEPO_SGLANG_API_KEY"):
            launch.sglang_argv(bad, {})


def test_cuda_command():
    cfg = ServerConfig(model_path="/m", python="/py", device="cuda", tp=2, mem_fraction_static=0.85,
                      max_total_tokens=None, max_running_requests=64, context_length=10240, skip_warmup=False,
                      extra_args=["--foo"])
    argv, env = server_command(cfg, 30000, None, base_env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert argv[2:] == ["--model-path", "/m", "--host", "127.0.0.1", "--port", "30000", "--dtype", "bfloat16",
                        "--device", "cuda", "--mem-fraction-static", "0.85", "--tp-size", "2",
                        "--max-running-requests", "64", "--context-length", "10240", "--foo"]
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(ValueError, match="device"):
        server_command(ServerConfig(model_path="/m", device="tpu"), 1)


def test_launch_server_uses_server_command(tmp_path, monkeypatch):
    seen = {}

    class FakePopen:
        pid = 4242

        def __init__(self, cmd, env, **kw):
            seen.update(cmd=cmd, env=env)

    monkeypatch.setattr(server.subprocess, "Popen", FakePopen)
    cfg = ServerConfig(model_path="/m", python=sys.executable, log_dir=str(tmp_path))
    launched = server.launch_server(cfg)
    port = int(launched.url.rsplit(":", 1)[1])
    assert (seen["cmd"], seen["env"]) == server_command(cfg, port, launched.api_key)


def _serve(*args, **env):
    full = {k: v for k, v in os.environ.items() if k != "TEPO_SGLANG_API_KEY"}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "megatron_tepo.rollout.sglang.server", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120)


def test_serve_cli_prints_the_shared_command(tmp_path):
    py = tmp_path / "python"
    res = _serve("--model-path", "/m", "--port", "31000", "--device", "cpu", "--threads", "2", "--print",
                 "--", "--log-level", "warning", MTEPO_SGLANG_PYTHON=str(py), TEPO_SGLANG_API_KEY="sekret")
    assert res.returncode == 0, res.stderr
    env_line, cmd_line = res.stdout.splitlines()
    cfg = ServerConfig(model_path="/m", python=str(py), host="0.0.0.0", threads_per_server=2,
                      extra_args=["--log-level", "warning"])
    want, _ = server_command(cfg, 31000, "sekret")
    assert shlex.split(cmd_line) == want
    assert "SGLANG_USE_CPU_ENGINE=1" in env_line and "OMP_NUM_THREADS=2" in env_line
    assert "sekret" not in res.stdout + res.stderr and "TEPO_SGLANG_API_KEY=***" in env_line


def test_serve_cli_cuda_defaults(tmp_path):
    res = _serve("--model-path", "/m", "--port", "1", "--tp", "4", "--print", MTEPO_SGLANG_PYTHON="/sg/python")
    argv = shlex.split(res.stdout.splitlines()[1])
    assert argv[0] == "/sg/python" and "--tp-size" in argv and argv[argv.index("--tp-size") + 1] == "4"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.85" and "torch_native" not in argv


def test_serve_cli_execs_sglang_python(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "FAKE $SGLANG_USE_CPU_ENGINE $*"\n')
    fake.chmod(0o755)
    res = _serve("--model-path", "/m", "--port", "5", "--device", "cpu", MTEPO_SGLANG_PYTHON=str(fake))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"FAKE 1 {LAUNCHER} --model-path /m --host 0.0.0.0 --port 5")


def test_serve_cli_passes_the_key_in_the_environment_only(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "KEY=$TEPO_SGLANG_API_KEY ARGS=$*"\n')
    fake.chmod(0o755)
    res = _serve("--model-path", "/m", "--port", "5", "--device", "cpu", MTEPO_SGLANG_PYTHON=str(fake),
                 TEPO_SGLANG_API_KEY="k-5150")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("KEY=k-5150 ARGS=") and "k-5150" not in res.stdout.split("ARGS=", 1)[1]
    assert "--api-key" not in res.stdout and "k-5150" not in res.stderr
