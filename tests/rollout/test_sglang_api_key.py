"""A REAL SGLang CPU server started by the fleet requires its API key, and the key is on no command
line: not in ``/proc/<pid>/cmdline`` of the server or of any process it starts (scheduler,
detokenizer), nor in its start-up log. It reaches SGLang through the environment
(``TEPO_SGLANG_API_KEY``, read inside the server by megatron_tepo/rollout/sglang/launch.py)."""
from pathlib import Path

import pytest
import requests

from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
from megatron_tepo.rollout.sglang.server import ServerConfig
from tests.rollout.helpers import cmdlines, save_tiny_qwen3

pytestmark = pytest.mark.sglang


@pytest.mark.timeout(600)
def test_key_required_and_never_on_a_command_line(sglang_python, tmp_path):
    model = tmp_path / "model"
    save_tiny_qwen3(str(model), seed=0, scale=0.07)
    logs = tmp_path / "logs"
    fleet = SGLangFleet(FleetConfig(num_servers=1, router="none", server=ServerConfig(
        model_path=str(model), python=sglang_python, log_dir=str(logs), startup_timeout=300)))
    try:
        server = fleet.servers[0]
        key = server.api_key
        assert key and len(key) >= 32
        seen = cmdlines(server.pid)
        assert len(seen) >= 2, seen  # the launcher and SGLang's scheduler process at least
        for pid, cmd in seen.items():
            assert key not in cmd and "--api-key" not in cmd, (pid, cmd)
        assert any("rollout/sglang/launch.py" in c for c in seen.values()), seen
        body = {"input_ids": [5, 17, 33], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        assert requests.get(server.url + "/health", timeout=30).status_code == 200  # probes need no key
        assert requests.post(server.url + "/generate", json=body, timeout=60).status_code == 401
        bad = requests.post(server.url + "/generate", json=body, headers={"Authorization": "Bearer wrong"},
                            timeout=60)
        assert bad.status_code == 401
        ok = requests.post(server.url + "/generate", json=body, headers={"Authorization": f"Bearer {key}"},
                           timeout=60)
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2, ok.text[:300]
        log = Path(server.log_path).read_text(errors="replace")
        assert "server_args=" in log and key not in log, log[-2000:]
    finally:
        fleet.close()
