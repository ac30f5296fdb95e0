"""The address the SGLang servers reach the trainer at for ``sync_mode: distributed``
(megatron_tepo.rollout.sglang.weight_sync.distributed.sync_master_address): ``TEPO_SYNC_ADDRESS``, else
``rollout.sync_address``, else the address of this host's interface on the route to the first
(non-loopback) server -- not ``gethostbyname(gethostname())``, which is often 127.0.0.1 /
127.0.1.1 (/etc/hosts) or a management NIC."""
import socket

import psutil
import pytest

from megatron_tepo.config import ConfigError, RunConfig, load_config
from megatron_tepo.rollout.sglang.weight_sync.distributed import sync_master_address


def _own_addresses():
    """This host's non-loopback IPv4 addresses."""
    return sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                   if a.family == socket.AF_INET and not a.address.startswith("127.")})


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("TEPO_SYNC_ADDRESS", raising=False)


def test_local_server_gives_loopback():
    assert sync_master_address(["http://127.0.0.1:30000"]) == "127.0.0.1"
    assert sync_master_address(["http://localhost:30000", "http://127.0.0.1:30001"]) == "127.0.0.1"


def test_remote_server_gives_the_interface_on_its_route():
    own = _own_addresses()
    assert own, "this host has no non-loopback IPv4 address: the route test needs one"
    for ip in own:  # a server on this host's own interface: the route's source is that address
        assert sync_master_address([f"http://{ip}:30000"]) == ip
        # a loopback server first does not make the address loopback when another server is remote
        assert sync_master_address(["http://127.0.0.1:30000", f"http://{ip}:30001"]) == ip


def test_the_setting_wins_and_the_environment_over_it(monkeypatch):
    assert sync_master_address(["http://127.0.0.1:1"], "10.1.2.3") == "10.1.2.3"
    monkeypatch.setenv("TEPO_SYNC_ADDRESS", "10.9.9.9")
    assert sync_master_address(["http://127.0.0.1:1"], "10.1.2.3") == "10.9.9.9"


@pytest.mark.parametrize("where", ["setting", "env"])
def test_bad_address_is_one_line_naming_the_field(monkeypatch, where):
    bad = "no such host.invalid"
    if where == "env":
        monkeypatch.setenv("TEPO_SYNC_ADDRESS", bad)
    with pytest.raises(ConfigError) as exc:
        sync_master_address(["http://127.0.0.1:1"], bad if where == "setting" else None)
    msg = str(exc.value)
    assert "\n" not in msg and bad in msg
    assert msg.startswith("TEPO_SYNC_ADDRESS: " if where == "env" else "rollout.sync_address: "), msg


def test_config_field(tmp_path):
    assert RunConfig().rollout.sync_address is None
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  sync_address: 10.0.0.7\n")
    assert load_config([str(cfg)]).rollout.sync_address == "10.0.0.7"
