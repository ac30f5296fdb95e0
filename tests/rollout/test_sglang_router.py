"""The fleet behind sglang-router (installed in the SGLang venv by tools/install_sglang_cpu.sh), two
REAL SGLang CPU servers: requests go through the router, which spreads them over both servers and
checks the API key (which reaches it in the environment, on no command line: sglang/launch.py's
router mode); a server killed in the middle of a step costs nothing and is dropped from the
fleet; every server gone gives a clear error within the step time-out. Config errors without
servers. The fault tests come last because they destroy the servers."""
import sys
import time
from pathlib import Path

import pytest
import requests

from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet, use_router
from megatron_tepo.rollout.sglang.client import FleetError
from megatron_tepo.rollout.sglang.options import API_KEY_ENV, SGLANG_LAUNCHER, ServerConfig
from megatron_tepo.rollout.sglang.router import router_command
from tests.rollout.helpers import cmdlines, error_with_all_servers_hung, kill_during_step, save_tiny_qwen3

pytestmark = pytest.mark.sglang


def test_router_setting_errors_name_the_field():
    with pytest.raises(ValueError, match="FleetConfig.router"):
        use_router(FleetConfig(router="nginx"), 2)
    with pytest.raises(ValueError, match="FleetConfig.router_policy"):
        use_router(FleetConfig(router_policy="fastest"), 2)
    # this interpreter (the project's venv) has no sglang_router: required -> error, auto -> no router
    with pytest.raises(FleetError, match="install_sglang_cpu.sh"):
        use_router(FleetConfig(router="sglang_router", server=ServerConfig(python=sys.executable)), 2)
    assert not use_router(FleetConfig(router="auto", server=ServerConfig(python=sys.executable)), 2)
    assert not use_router(FleetConfig(router="auto"), 1)  # one server: nothing to spread


def test_router_command_has_the_key_in_its_environment_only():
    key = "k3y-" + "5" * 28
    urls = ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    base = {"PATH": "/bin", "PYTHONPATH": "/elsewhere", API_KEY_ENV: "a stale key"}
    cmd, env = router_command("/venv/bin/python", urls, 31000, key, "round_robin", 30, base_env=base)
    assert cmd[:3] == ["/venv/bin/python", SGLANG_LAUNCHER, "router"]
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == urls
    assert cmd[cmd.index("--port") + 1] == "31000" and cmd[cmd.index("--policy") + 1] == "round_robin"
    assert not any(key in w or w.startswith("--api-key") for w in cmd), cmd
    assert env[API_KEY_ENV] == key and "PYTHONPATH" not in env and env["PATH"] == "/bin"
    assert base[API_KEY_ENV] == "a stale key"  # copied, not changed
    _, env = router_command("/venv/bin/python", urls, 31000, None, "round_robin", 30, base_env=base)
    assert API_KEY_ENV not in env  # no key: none inherited either


def test_router_launcher_parses_with_sglang_routers_parser(sglang_python):
    """sglang/launch.py's router mode hands sglang_router's parser the key of the environment (and
    refuses one on the command line), in the SGLang venv, without starting a router."""
    import subprocess

    probe = (f"import runpy, sys; m = runpy.run_path({SGLANG_LAUNCHER!r}, run_name='probe'); "
             "from sglang_router.launch_router import parse_router_args; import os; "
             "a = parse_router_args(m['sglang_argv'](sys.argv[1:], os.environ)); "
             "print(a.api_key, a.worker_urls, a.policy)")
    env = {"PATH": "/usr/bin:/bin", "TEPO_SGLANG_API_KEY": "sekrit-42"}
    res = subprocess.run([sglang_python, "-c", probe, "--worker-urls", "http://h:1", "--policy", "random"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["sekrit-42", "['http://h:1']", "random"], res.stdout
    res = subprocess.run([sglang_python, SGLANG_LAUNCHER, "router", "--worker-urls", "http://h:1",
                          "--api-key", "x"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode != 0 and "--api-key on the command line is refused" in res.stderr, res.stderr


@pytest.fixture(scope="module")
def fleet(sglang_python, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    save_tiny_qwen3(str(path), seed=0, scale=0.07)
    cfg = FleetConfig(num_servers=2, router="auto", router_policy="round_robin", request_timeout=60,
                      step_timeout=120, server_restarts=0,  # the fleet shrinks here; restarts: test_fleet_recovery.py
                      server=ServerConfig(model_path=str(path), python=sglang_python,
                                          log_dir=str(tmp_path_factory.mktemp("logs")), startup_timeout=240))
    f = SGLangFleet(cfg)
    yield f
    f.close()


def _generate_lines(path):
    with open(path, errors="replace") as f:
        return sum("POST /generate" in line for line in f)


def test_groups_go_through_the_router_to_both_servers(fleet):
    assert fleet.router is not None and fleet.router.url.startswith("http://127.0.0.1:")
    key = fleet.router.api_key
    assert key and {s.api_key for s in fleet.servers} == {key}  # one key: the router passes it on
    assert requests.post(fleet.router.url + "/generate", json={"input_ids": [1, 2]}, timeout=10).status_code == 401
    assert requests.post(fleet.router.url + "/generate", json={"input_ids": [1, 2]}, timeout=10,
                         headers={"Authorization": "Bearer wrong"}).status_code == 401
    # the key is on no command line that `ps` shows: not the one the router was exec'd with (which
    # /proc/<pid>/cmdline shows until sglang_router's setproctitle("sglang::router") overwrites
    # it, seconds later), nor what it shows now, nor any process the router starts
    argv = [str(w) for w in fleet.router.proc.args]
    assert not any(key in w or w.startswith("--api-key") for w in argv), argv
    assert argv[1].endswith("rollout/sglang/launch.py") and argv[2] == "router", argv
    seen = cmdlines(fleet.router.proc.pid)
    for pid, cmd in seen.items():
        assert key not in cmd and "--api-key" not in cmd, (pid, cmd)
    assert key not in Path(fleet.router.log_path).read_text(errors="replace")
    before = [_generate_lines(s.log_path) for s in fleet.servers]
    prompts = [[i + 3, i + 4, i + 5] for i in range(8)]
    groups = fleet.generate(prompts, n=2, temperature=1.0, max_new_tokens=6)
    assert len(groups) == 8 and fleet.routed == 16  # one request a sequence (#56 row 3): 8 prompts x n=2
    for g in groups:
        assert len(g) == 2 and all(len(s.token_ids) == 6 and len(s.log_probs) == 6 for s in g)
    time.sleep(0.5)  # (the servers' access log lines)
    served = [_generate_lines(s.log_path) - b for s, b in zip(fleet.servers, before)]
    assert all(n > 0 for n in served) and sum(served) == 16, served  # round robin: both, nothing twice
    assert all(s.served == 0 for s in fleet.servers)  # nothing went around the router


def _prefills(path, start):
    """``(count, end)``: the "Prefill batch" lines SGLang logged in ``path`` after byte ``start``."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read()
    return text.count(b"Prefill batch"), start + len(text)


def test_requests_through_the_router_are_interrupted_with_their_partial_responses(fleet):
    """Partial rollout behind sglang-router: the router passes a server's aborted answer through
    (HTTP 200, no retry); the aborts go to each server directly (the router has no such route)."""
    from megatron_tepo.rollout.engine import FINISH_ABORT, Request, SamplingParams

    routed = fleet.routed
    reqs = [Request([i + 3, i + 4, i + 5], 480, key=i) for i in range(4)]
    starts = [Path(s.log_path).stat().st_size for s in fleet.servers]
    fleet.submit(reqs, SamplingParams(max_new_tokens=480))
    deadline = time.monotonic() + 120
    while sum(_prefills(s.log_path, b)[0] for s, b in zip(fleet.servers, starts)) == 0:  # (one reached a server)
        assert time.monotonic() < deadline, "no request reached a server"
        time.sleep(0.05)
    time.sleep(0.3)
    back = fleet.interrupt()
    assert sorted(r.key for r, _ in back) == [0, 1, 2, 3]
    assert all(len(s.token_ids) == len(s.log_probs) and not s.meta.get("error") for _, s in back)
    cut = [s for _, s in back if s.finish_reason == FINISH_ABORT]
    assert cut and any(s.token_ids for s in cut)  # cut mid-response, tokens and log-probs kept
    assert fleet.routed - routed == 4  # every answer came through the router
    assert fleet.collect() == []  # nothing left running


def test_routed_server_killed_mid_step(fleet):
    victim = fleet.servers[0]
    start = Path(victim.log_path).stat().st_size  # (before the step: its prefills come after)

    def wait_for_victim(step):  # kill the victim once the router has given it requests of this step (its
        deadline = time.monotonic() + 120  # log shows their prefill; each then decodes 160 tokens)
        seen, end = 0, start
        while not seen and step.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
            got, end = _prefills(victim.log_path, end)
            seen += got
        seen += _prefills(victim.log_path, end)[0]
        assert seen, "no request of the step reached the victim"

    kill_during_step(fleet, victim, wait_for_victim, join_timeout=240)
    # dropped after the step (the weight sync must not push to it)
    assert not victim.alive and fleet.servers[1].alive
    assert [s.url for s in fleet.alive_servers()] == [fleet.servers[1].url]


def test_routed_all_servers_gone_clear_error_within_timeout(fleet):
    assert "sglang-router" in error_with_all_servers_hung(fleet, health_timeout=2.0)

