"""A request's and a generation round's time limits follow the answers they wait for (#50 row 3:
the 32k example kept the 600 s request limit while one 32k answer takes 8-11 minutes):
derived from ``rollout.max_new_tokens`` at ``rollout.decode_floor_tokens_per_s`` where not set,
a set limit shorter than the longest answer refused naming the field, and a round's waves on the
servers' slots checked against the watchdog at launch."""
from pathlib import Path

import pytest

from megatron_tepo.config import ConfigError, from_dict, load_config
from megatron_tepo.launch import FitError, check_fit, load_launch
from megatron_tepo.time_limits import request_limit_s, round_limit_s, waves

ROOT = Path(__file__).resolve().parents[1]


def _rollout(**kw):
    return from_dict({"rollout": kw}).rollout


def test_the_limits_by_hand():
    r = _rollout(max_new_tokens=32768)
    assert request_limit_s(r) == 120 + 32768 / 20 == 1758.4
    assert waves(512, 176) == 3 and waves(512, 512) == 1 and waves(512, None) == 1
    assert round_limit_s(r, 512, 176) == 3 * 1758.4
    assert request_limit_s(_rollout(max_new_tokens=1024)) == 600.0  # (at least 600 s)
    assert request_limit_s(_rollout(max_new_tokens=32768, decode_floor_tokens_per_s=64)) == 120 + 512
    assert request_limit_s(_rollout(max_new_tokens=32768, request_timeout_s=4000)) == 4000.0


def test_a_set_request_limit_shorter_than_the_longest_answer_is_refused_naming_it():
    with pytest.raises(ConfigError) as err:
        from_dict({"rollout": {"max_new_tokens": 32768, "request_timeout_s": 600}})
    msg = str(err.value)
    assert msg.startswith("rollout.request_timeout_s: 600 s is shorter than the longest answer needs") and "\n" not in msg
    assert "rollout.decode_floor_tokens_per_s 20 = 1758 s" in msg
    with pytest.raises(ConfigError, match="rollout.decode_floor_tokens_per_s: must be > 0"):
        from_dict({"rollout": {"decode_floor_tokens_per_s": 0}})


def test_the_32k_example_derives_its_limits_and_passes_its_check():
    spec = load_launch(ROOT / "examples/models/qwen3_14b_32k.yaml")
    r = spec.cfg.rollout
    assert r.request_timeout_s is None and request_limit_s(r) > 32768 / 70 + 120  # (a 32k answer at 50-70 tokens/s)
    report = check_fit(spec.shape(), spec.cfg, spec.launch)
    assert "a request 1758 s" in report.render() and "3 wave(s) of 512 sequences on 176 slots = 5275 s" in report.render()


def test_a_watchdog_shorter_than_a_round_is_refused_at_launch_naming_it():
    spec = load_launch(ROOT / "examples/models/qwen3_14b_32k.yaml")
    spec.cfg.fault.watchdog_generate_s = 3600
    with pytest.raises(FitError) as err:
        check_fit(spec.shape(), spec.cfg, spec.launch)
    assert str(err.value).startswith("fault.watchdog_generate_s: 3600 s is shorter than one sampling round may take")
    assert "4 servers x launch.sglang.max_running_requests" in str(err.value)
    spec.cfg.fault.watchdog_generate_s = 0  # (off: nothing to check against)
    check_fit(spec.shape(), spec.cfg, spec.launch)


def test_the_fleet_gets_the_derived_request_limit(monkeypatch):
    """attach.py hands the fleet the derived limit (not the 600 s default) when none is set."""
    from megatron_tepo.rollout.sglang import attach

    seen = {}

    class Fleet:
        def __init__(self, cfg):
            seen["request"], seen["step"] = cfg.request_timeout, cfg.step_timeout

    monkeypatch.setattr(attach, "SGLangFleet", Fleet)
    monkeypatch.setattr(attach, "weight_sync", lambda *a, **k: None)
    cfg = load_config([str(ROOT / "examples/tiny_tepo/config.yaml")],
                      ["rollout.engine=sglang", "rollout.sglang_urls=[http://127.0.0.1:1]", "rollout.max_new_tokens=32768"])
    from megatron_tepo.rollout.registry import EngineSettings

    attach.attach_fleet(EngineSettings(cfg.rollout, "", 0, 1, cfg.fault))
    assert seen["request"] == 1758.4 and seen["step"] is None  # (the fleet: waves on its slots x that)


def test_a_multi_turn_round_counts_its_turns_and_tool_calls():
    """With an environment a sampling round is its waves x max_turns x (a request + a tool call's wall
    time); the 14B tool example fits its watchdog, and a tighter one is refused naming it."""
    r = _rollout(max_new_tokens=8192)
    assert round_limit_s(r, 512, 512, turns=6, tool_s=30) == 6 * (600 + 30)
    assert round_limit_s(r, 512, 512, turns=1, tool_s=30) == 600  # (one turn: no tool call between)
    spec = load_launch(ROOT / "examples/models/qwen3_14b_tir.yaml")
    assert "x 6 turns x (600 s + 30 s a tool call) = 3780 s" in check_fit(spec.shape(), spec.cfg, spec.launch).render()
    spec.cfg.fault.watchdog_generate_s = 3000
    with pytest.raises(FitError, match=r"x 600 s a request \+ 30 s a tool call, 6 turns = 3780 s"):
        check_fit(spec.shape(), spec.cfg, spec.launch)
