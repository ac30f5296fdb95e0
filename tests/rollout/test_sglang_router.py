"""The fleet behind sglang-router (installed in the SGLang venv by tools/install_sglang_cpu.sh), two
REAL SGLang CPU servers: requests go through the router, which spreads them over both servers and
checks the API key; a server killed in the middle of a step costs nothing and is dropped from the
fleet; every server gone gives a clear error within the step time-out. Config errors without
servers. The fault tests come last because they destroy the servers."""
import sys
import time

import pytest
import requests

from megatron_tepo.rollout.sglang_fleet import FleetConfig, FleetError, SGLangFleet, use_router
from tests.rollout.helpers import error_with_all_servers_hung, kill_during_step, save_tiny_qwen3

pytestmark = pytest.mark.sglang


def test_router_setting_errors_name_the_field():
    with pytest.raises(ValueError, match="FleetConfig.router"):
        use_router(FleetConfig(router="nginx"), 2)
    with pytest.raises(ValueError, match="FleetConfig.router_policy"):
        use_router(FleetConfig(router_policy="fastest"), 2)
    # this interpreter (the project's venv) has no sglang_router: required -> error, auto -> no router
    with pytest.raises(FleetError, match="install_sglang_cpu.sh"):
        use_router(FleetConfig(router="sglang_router", python=sys.executable), 2)
    assert not use_router(FleetConfig(router="auto", python=sys.executable), 2)
    assert not use_router(FleetConfig(router="auto"), 1)  # one server: nothing to spread


@pytest.fixture(scope="module")
def fleet(sglang_python, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    save_tiny_qwen3(str(path), seed=0, scale=0.07)
    cfg = FleetConfig(model_path=str(path), num_servers=2, python=sglang_python, router="auto",
                      router_policy="round_robin", log_dir=str(tmp_path_factory.mktemp("logs")),
                      request_timeout=60, step_timeout=120, startup_timeout=240)
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
    before = [_generate_lines(s.log_path) for s in fleet.servers]
    prompts = [[i + 3, i + 4, i + 5] for i in range(8)]
    groups = fleet.generate(prompts, n=2, temperature=1.0, max_new_tokens=6)
    assert len(groups) == 8 and fleet.routed == 8
    for g in groups:
        assert len(g) == 2 and all(len(s.token_ids) == 6 and len(s.log_probs) == 6 for s in g)
    time.sleep(0.5)  # (the servers' access log lines)
    served = [_generate_lines(s.log_path) - b for s, b in zip(fleet.servers, before)]
    assert all(n > 0 for n in served) and sum(served) == 8, served  # round robin: both, nothing twice
    assert all(s.served == 0 for s in fleet.servers)  # nothing went around the router


def test_routed_server_killed_mid_step(fleet):
    victim = fleet.servers[0]

    def wait_for_victim(step):
        time.sleep(1.5)  # round robin: the victim holds half of the step's requests by now
        assert step.is_alive(), "the step ended before the victim could be killed"

    kill_during_step(fleet, victim, wait_for_victim, join_timeout=240)
    # dropped after the step (the weight sync must not push to it)
    assert not victim.alive and fleet.servers[1].alive
    assert [s.url for s in fleet.alive_servers()] == [fleet.servers[1].url]


def test_routed_all_servers_gone_clear_error_within_timeout(fleet):
    assert "sglang-router" in error_with_all_servers_hung(fleet, health_timeout=2.0)
