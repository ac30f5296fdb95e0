"""Server health: the state machine as a table (pure), and the fleet's use of it against fake
SGLang servers (attach mode): a frozen server found dead by its probes while the step completes
on the other, an attached server that comes back served only after a weight sync reached it, one
that does not come back within the return time-out left behind, and every change counted once
in the step metrics. The same with real servers, launch mode and a training run:
test_fleet_recovery.py."""
import threading

import pytest
import torch

from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
from megatron_tepo.rollout.sglang.health import (COUNTERS, REACHABLE, SERVING, TRANSITIONS, Event, ServerHealth,
                                                 State, Transition, TransitionError, counter, next_state)
from tests.rollout.fake_sglang import FakeSGLang

S, E = State, Event


# ---------------------------------------------------------------- the table
def test_every_listed_transition_and_nothing_else():
    for (state, event), new in TRANSITIONS.items():
        assert next_state(state, event) == new
    unlisted = [(s, e) for s in S for e in E if (s, e) not in TRANSITIONS]
    assert unlisted  # the table is not total: these are caller bugs
    for s, e in unlisted:
        with pytest.raises(TransitionError, match=f"from '{s.value}' on '{e.value}'"):
            next_state(s, e)


def test_only_a_sync_makes_a_returned_server_healthy():
    """From dead, restarting or stale, every path to healthy passes through ``synced`` from stale."""
    into_healthy = {(s, e) for (s, e), new in TRANSITIONS.items() if new == S.HEALTHY and s != S.HEALTHY}
    assert into_healthy == {(S.SUSPECT, E.PROBE_OK), (S.STALE, E.SYNCED)}
    # and nothing leads from dead / restarting / stale back to suspect (which a probe would heal)
    assert not [k for k, new in TRANSITIONS.items() if new == S.SUSPECT and k[0] in (S.DEAD, S.RESTARTING, S.STALE)]
    assert SERVING == {S.HEALTHY} and S.STALE in REACHABLE and S.DEAD not in REACHABLE


def test_restart_cycle_counts_and_incarnation():
    clock = iter(range(100))
    seen = []
    h = ServerHealth(clock=lambda: float(next(clock)), on_change=lambda _, t: seen.append(counter(t)))
    for ev in (E.REQUEST_FAILED, E.PROBE_FAILED, E.RESTART, E.START_FAILED, E.RESTART, E.READY, E.SYNCED):
        h.fire(ev, "why")
    assert h.state == S.HEALTHY and h.restarts == 2 and h.incarnation == 1
    assert seen == ["fleet_suspected", "fleet_died", "fleet_restarts", "fleet_died", "fleet_restarts",
                    "fleet_returned", "fleet_resynced"]
    assert set(seen) <= set(COUNTERS)
    assert h.since(S.STALE) == 5.0 and h.since(S.HEALTHY) == 6.0
    assert [t.event for t in h.history][-1] == E.SYNCED and isinstance(h.history[0], Transition)


def test_no_change_no_callback():
    calls = []
    h = ServerHealth(on_change=lambda *a: calls.append(a))
    h.fire(E.PROBE_OK)
    h.fire(E.SYNCED)
    assert h.state == S.HEALTHY and not calls and len(h.history) == 2


# ---------------------------------------------------------------- the fleet, fake servers
def _fleet(fakes, **kw):
    cfg = FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=60, step_timeout=120,
                      probe_interval=0.2, probe_timeout=1.0, return_timeout=kw.pop("return_timeout", 30.0), **kw)
    return SGLangFleet(cfg)


def _weights():
    return [("w", torch.ones(4))]


@pytest.fixture
def two_fakes():
    fakes = [FakeSGLang(), FakeSGLang(delays={"/generate": 0.2})]
    yield fakes
    for f in fakes:
        f.close()


def test_frozen_server_dead_by_probe_and_step_completes(two_fakes):
    a, b = two_fakes
    fleet = _fleet(two_fakes)
    try:
        b.freeze()  # accepts connections, answers /health, generates nothing
        groups = fleet.generate([[1, 2]] * 8, n=1, max_new_tokens=2)
        assert len(groups) == 8 and all(g[0].token_ids == [7, 8] for g in groups)
        frozen = fleet.servers[1]
        assert frozen.state == S.DEAD and fleet.servers[0].state == S.HEALTHY
        # found by the generation probe, not by the request time-out (60 s)
        why = [t.why for t in frozen.health.history if t.new == S.DEAD][0]
        assert "one-token generation" in why, frozen.health.history
        assert b.paths("GET").count("/health_generate") >= 2
        m = fleet.health_metrics()
        assert m["fleet_died"] == 1 and m["fleet_suspected"] == 1 and m["fleet_healthy"] == 1
        m2 = fleet.health_metrics()  # each change counted once
        assert m2["fleet_died"] == 0 and m2["fleet_suspected"] == 0 and set(COUNTERS) <= set(m2)
    finally:
        b.thaw()
        fleet.close()


def test_attached_server_back_serves_only_after_the_sync(two_fakes):
    a, b = two_fakes
    fleet = _fleet(two_fakes)
    port = int(b.url.rsplit(":", 1)[1])
    back = None
    try:
        b.close()  # its job lost it: connection refused
        fleet.generate([[1]] * 4, n=1, max_new_tokens=2)
        assert fleet.servers[1].state == S.DEAD
        back = FakeSGLang(port=port)  # slurm/lib.sh restarted it at the same address
        fleet.generate([[1]] * 4, n=1, max_new_tokens=2)  # still dead to the fleet: no request to it
        assert back.paths("POST").count("/generate") == 0
        fleet.update_weights(_weights())
        s = fleet.servers[1]
        assert s.state == S.HEALTHY and s.incarnation == 1
        paths = back.paths()
        first_load = paths.index("/update_weights_from_tensor")
        assert "/generate" not in paths[:first_load]  # nothing served before its weights
        fleet.generate([[1]] * 8, n=1, max_new_tokens=2)
        assert back.paths("POST").count("/generate") > 0  # and served after
        m = fleet.health_metrics()
        assert (m["fleet_died"], m["fleet_returned"], m["fleet_resynced"], m["fleet_healthy"]) == (1, 1, 1, 2)
    finally:
        fleet.close()
        if back is not None:
            back.close()


def test_attached_server_that_stays_down_is_left_behind(two_fakes):
    a, b = two_fakes
    fleet = _fleet(two_fakes, return_timeout=1.0)
    try:
        b.close()
        fleet.generate([[1]] * 4, n=1, max_new_tokens=2)
        fleet.update_weights(_weights())  # waits up to 1 s for it, then goes on with the other
        assert fleet.servers[1].state == S.DEAD and fleet.servers[0].state == S.HEALTHY
        assert a.paths().count("/update_weights_from_tensor") == 1
        fleet.update_weights(_weights())
        assert a.paths().count("/update_weights_from_tensor") == 2
    finally:
        fleet.close()


def test_monitor_leaves_idle_servers_alone(two_fakes):
    """Between steps nothing is probed (a weight sync pauses the servers: a probe then would
    declare them dead); a sync waits for a probe round still under way."""
    fleet = _fleet(two_fakes)
    try:
        fleet.generate([[1]] * 2, n=1, max_new_tokens=2)
        fleet.update_weights(_weights())
        assert all(s.state == S.HEALTHY for s in fleet.servers)
        before = sum(f.paths().count("/health_generate") for f in two_fakes)
        stop = threading.Event()
        stop.wait(1.0)  # five probe intervals with no step running
        after = sum(f.paths().count("/health_generate") for f in two_fakes)
        assert after == before
    finally:
        fleet.close()


def test_fleet_config_from_the_fault_section():
    from megatron_tepo.config import load_config
    from megatron_tepo.rollout.registry import EngineSettings
    from megatron_tepo.rollout.sglang import attach

    fakes = [FakeSGLang()]
    try:
        cfg = load_config([], ["rollout.engine=sglang", f"rollout.sglang_urls=[{fakes[0].url}]", "rollout.sync_mode=tensor",
                               "fault.probe_timeout_s=7", "fault.server_return_timeout_s=9", "fault.server_restarts=5",
                               "fault.restart_backoff_s=2"])
        fleet = attach.attach_fleet(EngineSettings(cfg.rollout, "unused", 0, 1, cfg.fault))
        try:
            c = fleet.cfg
            assert (c.probe_timeout, c.return_timeout, c.server_restarts, c.restart_backoff) == (7, 9, 5, 2)
        finally:
            fleet.close()
    finally:
        fakes[0].close()
    with pytest.raises(ValueError, match="fault.probe_timeout_s: must be > 0"):
        load_config([], ["fault.probe_timeout_s=0"])


def test_router_stands_only_in_front_of_the_healthy_servers(two_fakes, monkeypatch):
    """With sglang-router: from a server's death the router is bypassed; a returned server goes
    behind a rebuilt router only after the weight sync reached it."""
    import megatron_tepo.rollout.sglang.dispatch as dispatch_mod
    import megatron_tepo.rollout.sglang.fleet as fleet_mod
    import megatron_tepo.rollout.sglang.supervision as supervision_mod
    from megatron_tepo.rollout.sglang.client import SGLangServer

    a, b = two_fakes
    routers, events = [], []

    def fake_launch_router(cfg, servers, policy, timeout):
        front = FakeSGLang()
        routers.append(front)
        events.append(("router", tuple(s.url for s in servers)))
        return SGLangServer(front.url)

    monkeypatch.setattr(fleet_mod, "use_router", lambda cfg, n: True)
    monkeypatch.setattr(dispatch_mod, "launch_router", fake_launch_router)
    for mod in (fleet_mod, dispatch_mod, supervision_mod):  # (the fleet's parts that stop a server)
        monkeypatch.setattr(mod, "stop_server", lambda s: events.append(("stop", s.url)))
    port = int(b.url.rsplit(":", 1)[1])
    fleet = _fleet(two_fakes)
    back = None
    try:
        assert events == [("router", (a.url, b.url))]
        fleet.generate([[1]] * 4, n=1, max_new_tokens=2)
        assert routers[0].paths("POST").count("/generate") == 4  # routed
        b.close()
        fleet.servers[1].health.fire(E.EXITED, "test: its job lost it")
        fleet.generate([[1]] * 4, n=1, max_new_tokens=2)
        assert routers[0].paths("POST").count("/generate") == 4  # bypassed: the router still lists it
        assert a.paths("POST").count("/generate") == 4
        back = FakeSGLang(port=port)
        fleet.update_weights(_weights())
        assert fleet.servers[1].state == S.HEALTHY
        # the new router (over both) came after the returned server's weight load
        assert events[-1] == ("router", (a.url, b.url)) and ("stop", routers[0].url) in events
        assert len(routers) == 2 and back.paths().index("/update_weights_from_tensor") >= 0
        loaded_at = next(r["end"] for r in back.requests if r["path"] == "/update_weights_from_tensor")
        assert all(r["start"] > loaded_at for r in routers[1].requests)
        fleet.generate([[1]] * 4, n=1, max_new_tokens=2)
        assert routers[1].paths("POST").count("/generate") == 4
    finally:
        fleet.close()
        for f in routers + ([back] if back else []):
            f.close()
