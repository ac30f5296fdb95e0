"""The SGLang command line comes from one place (rollout/sglang/server.py's server_command), used
by launch_server and by the serve command, `python -m megatron_tepo.rollout.sglang.server` (which
slurm/lib.sh runs)."""
import os
import re
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
    cfg = ServerConfig(model_path="/m", python=str(py), host="127.0.0.1", threads_per_server=2,
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
    assert res.stdout.startswith(f"FAKE 1 {LAUNCHER} --model-path /m --host 127.0.0.1 --port 5")


def test_serve_cli_passes_the_key_in_the_environment_only(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "KEY=$TEPO_SGLANG_API_KEY ARGS=$*"\n')
    fake.chmod(0o755)
    res = _serve("--model-path", "/m", "--port", "5", "--device", "cpu", MTEPO_SGLANG_PYTHON=str(fake),
                 TEPO_SGLANG_API_KEY="k-5150")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("KEY=k-5150 ARGS=") and "k-5150" not in res.stdout.split("ARGS=", 1)[1]
    assert "--api-key" not in res.stdout and "k-5150" not in res.stderr


# ---- who can reach a server started by hand (issue #35 point 1) ----
STANDIN = """#!/bin/bash
# stand-in SGLang: serves /health on the --host and --port it is given, says its key and arguments
shift  # (the path of launch.py)
exec {python} -c '
import http.server, os, sys
a = sys.argv[1:]
host, port = a[a.index("--host") + 1], int(a[a.index("--port") + 1])
print("KEY=" + os.environ.get("TEPO_SGLANG_API_KEY", "-") + " ARGS=" + " ".join(a), flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *x):
        pass
http.server.ThreadingHTTPServer((host, port), H).serve_forever()
' "$@"
"""


def _standin(tmp_path) -> Path:
    py = tmp_path / "sglang-python"
    py.write_text(STANDIN.format(python=shlex.quote(sys.executable)))
    py.chmod(0o755)
    return py


def _non_loopback_ip():
    """This machine's address on its route out (a UDP connect sends nothing), else `hostname -I`'s
    first non-loopback one; None when it has none."""
    import ipaddress
    import socket

    candidates = []
    for probe in ("10.255.255.255", "192.0.2.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                candidates.append(s.getsockname()[0])
        except OSError:
            pass
    res = subprocess.run(["hostname", "-I"], capture_output=True, text=True)
    candidates += res.stdout.split()
    for ip in candidates:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            continue
        if addr.version == 4 and not addr.is_loopback and not addr.is_unspecified:
            return ip
    return None


def _reachable(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _serve_until_up(tmp_path, port, *args):
    """The serve command with a stand-in SGLang, up on 127.0.0.1:``port``."""
    import time

    env = {k: v for k, v in os.environ.items() if k != "TEPO_SGLANG_API_KEY"}
    env["MTEPO_SGLANG_PYTHON"] = str(_standin(tmp_path))
    with open(tmp_path / f"serve.{port}.log", "w") as log:  # (the server keeps its own copy of the file)
        proc = subprocess.Popen([sys.executable, "-m", "megatron_tepo.rollout.sglang.server", "--model-path", "/m",
                                 "--port", str(port), "--device", "cpu", *args], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not _reachable("127.0.0.1", port):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"serve.{port}.log").read_text()
        time.sleep(0.1)
    return proc


def test_a_server_started_by_hand_listens_on_loopback_only(tmp_path):
    """The serve command without --host or a key: reachable on 127.0.0.1, not on this machine's
    other address; told --host 0.0.0.0 --allow-open it is (so the probe can see an open server)."""
    from megatron_tepo.net import free_port

    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address (UDP route and `hostname -I` found none): "
                    "nothing to be unreachable from")
    port = free_port()
    proc = _serve_until_up(tmp_path, port)
    try:
        assert not _reachable(ip, port), f"the server answers on {ip}:{port}"
        assert "--host 127.0.0.1" in (tmp_path / f"serve.{port}.log").read_text()
    finally:
        proc.kill()
        proc.wait()
    port = free_port()
    proc = _serve_until_up(tmp_path, port, "--host", "0.0.0.0", "--allow-open")
    try:
        assert _reachable(ip, port)
        log = (tmp_path / f"serve.{port}.log").read_text()
        assert "WARNING: --allow-open: 0.0.0.0 without an API key" in log and "KEY=- " in log
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_another_address_without_a_key_is_refused_in_one_line(tmp_path, host):
    res = _serve("--model-path", "/m", "--port", "5", "--device", "cpu", "--host", host,
                 MTEPO_SGLANG_PYTHON=str(_standin(tmp_path)))
    assert res.returncode == 2 and res.stdout == ""  # nothing started
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"serve: --host {host} is reachable from other machines and no API key is set: "
                               "give one in $TEPO_SGLANG_API_KEY") and "--allow-open" in lines[0]


def test_make_api_key_prints_it_once_and_hands_it_over_in_the_environment(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "KEY=$TEPO_SGLANG_API_KEY ARGS=$*"\n')
    fake.chmod(0o755)
    res = _serve("--model-path", "/m", "--port", "5", "--device", "cpu", "--host", "0.0.0.0", "--make-api-key",
                 MTEPO_SGLANG_PYTHON=str(fake))
    assert res.returncode == 0, res.stderr
    key = re.search(r"serve: API key \(made with --make-api-key.*\): ([0-9a-f]{32})$", res.stderr, re.M).group(1)
    assert res.stderr.count(key) == 1  # printed once, on no command line
    assert res.stdout.startswith(f"KEY={key} ARGS=") and key not in res.stdout.split("ARGS=", 1)[1]


def test_the_launchers_path_binds_every_interface_with_their_key(tmp_path):
    """slurm/lib.sh and the nemo-run launcher pass --host 0.0.0.0 (serve_args) and the job's key in
    the environment: accepted, the key reaches the server in its environment only."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "KEY=$TEPO_SGLANG_API_KEY ARGS=$*"\n')
    fake.chmod(0o755)
    from megatron_tepo.launch import load_launch, serve_args

    args = serve_args(load_launch(ROOT / "examples" / "models" / "tiny_cpu.yaml"))
    assert args[args.index("--host") + 1] == "0.0.0.0"
    res = _serve(*args[2:], "--port", "5", MTEPO_SGLANG_PYTHON=str(fake), TEPO_SGLANG_API_KEY="job-key-1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("KEY=job-key-1 ARGS=") and "--host 0.0.0.0" in res.stdout


@pytest.mark.parametrize("host,want", [("127.0.0.1", True), ("127.0.0.53", True), ("::1", True),
                                       ("localhost", True), ("0.0.0.0", False), ("::", False),
                                       ("10.0.0.7", False), ("no-such-host.invalid", False)])
def test_is_loopback(host, want):
    from megatron_tepo.rollout.sglang.serve import is_loopback

    assert is_loopback(host) is want


def test_the_memory_saver_reaches_sglang_on_cuda_only():
    """A colocated layout's servers start with SGLang's memory saver (the serve command reads the
    flag back); torch_memory_saver is CUDA's, so a CPU server with it is refused in one line."""
    cfg = ServerConfig(model_path="/m", python="/py", device="cuda", enable_memory_saver=True)
    argv, _ = server_command(cfg, 1, None, base_env={})
    assert argv.count("--enable-memory-saver") == 1
    assert ServerConfig.from_argv(cfg.to_argv()).enable_memory_saver and "--enable-memory-saver" in cfg.to_argv()
    assert "--enable-memory-saver" not in server_command(ServerConfig(model_path="/m", python="/py", device="cuda"),
                                                         1, None, base_env={})[0]
    with pytest.raises(ValueError, match="memory saver .* is CUDA's"):
        server_command(ServerConfig(model_path="/m", python="/py", enable_memory_saver=True), 1, None, base_env={})
