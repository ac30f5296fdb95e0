"""Partial rollout keeps the fleet's running-request slots full (issue #50 row 5): ``submit()`` sends
one request per sample, and as many are in flight as the servers run at once, read from each
server's ``/server_info`` (SGLang 0.5.23's effective limit, else ``--max-running-requests``), each
server holding its own limit; before, a fixed pool of 64 held a 512-slot fleet to an eighth.
Against stand-in servers (tests/rollout/fake_sglang.py) that hold every ``/generate`` until told."""
import threading
import time

import pytest

from megatron_tepo.rollout.engine import Request, SamplingParams
from megatron_tepo.rollout.sglang.client import running_slots
from megatron_tepo.rollout.sglang.fleet import MAX_PARTIAL_INFLIGHT, FleetConfig, SGLangFleet
from tests.rollout.fake_sglang import FakeSGLang


def test_the_running_request_limit_is_read_as_sglang_reports_it():
    assert running_slots({"max_running_requests": None,
                          "internal_states": [{"effective_max_running_requests_per_dp": 48},
                                              {"effective_max_running_requests_per_dp": 48}]}) == 96  # 2 DP ranks
    assert running_slots({"max_running_requests": 64, "internal_states": [{"max_running_requests": 64}]}) == 64
    assert running_slots({"max_running_requests": None, "internal_states": [{}]}) is None
    assert running_slots({"max_running_requests": True}) is None and running_slots({}) is None


def _inflight(fakes):
    return [f.inflight.get("/generate", 0) for f in fakes]


def test_partial_rollout_keeps_as_many_requests_in_flight_as_the_fleet_has_slots():
    """Two servers of 24 and 56 slots (80 in all, more than the old pool of 64), 200 samples
    submitted: each server holds exactly its own limit (the fleet picks by requests per slot), the
    rest wait in the fleet, and every sample comes back once the servers answer."""
    hold = threading.Event()
    fakes = [FakeSGLang(slots=24, hold=hold), FakeSGLang(slots=56, hold=hold)]
    fleet = SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=300,
                                    step_timeout=600, probe_interval=600))
    try:
        reqs = [Request([3, 4, 5], 2, key=i) for i in range(200)]
        fleet.submit(reqs, SamplingParams(max_new_tokens=2))
        deadline = time.monotonic() + 120  # (generous: a loaded machine; the old code stops at 64)
        while sum(_inflight(fakes)) < 80 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # (none beyond the slots arrives)
        assert _inflight(fakes) == [24, 56], _inflight(fakes)
        assert fleet.partial_inflight() == 80
        hold.set()
        back = []
        deadline = time.monotonic() + 120
        while len(back) < 200 and time.monotonic() < deadline:
            back += fleet.collect(timeout=1.0)
        assert sorted(r.key for r, _ in back) == list(range(200))
        assert all(s.token_ids == [7, 8] for _, s in back)
        assert [f.max_inflight["/generate"] for f in fakes] == [24, 56]
    finally:
        hold.set()
        fleet.close()
        for f in fakes:
            f.close()


def test_the_in_flight_bound_without_a_reported_limit_and_set_by_hand():
    """A server that reports no limit counts as FleetConfig.max_concurrency; the sum is bounded by
    MAX_PARTIAL_INFLIGHT; FleetConfig.partial_inflight sets it instead."""
    fakes = [FakeSGLang(), FakeSGLang(slots=MAX_PARTIAL_INFLIGHT)]
    try:
        fleet = SGLangFleet(FleetConfig(urls=[fakes[0].url], router="none", max_concurrency=12))
        assert fleet.partial_inflight() == 12
        fleet.close()
        fleet = SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none"))
        assert fleet.partial_inflight() == MAX_PARTIAL_INFLIGHT
        fleet.close()
        fleet = SGLangFleet(FleetConfig(urls=[fakes[1].url], router="none", partial_inflight=7))
        assert fleet.partial_inflight() == 7
        fleet.close()
        fleet = SGLangFleet(FleetConfig(urls=[fakes[1].url], router="none", partial_inflight=0))
        with pytest.raises(ValueError, match="FleetConfig.partial_inflight must be >= 1, got 0"):
            fleet.partial_inflight()
        fleet.close()
    finally:
        for f in fakes:
            f.close()


def test_a_calls_time_limit_is_its_waves_on_the_fleets_slots():
    """#50 row 3: a generate() call's deadline, where none is set, is its sequences' waves on the
    servers' slots x a request's limit (the 32k example: 3 waves of 512 on 176 slots); set, it wins."""
    fakes = [FakeSGLang(slots=24), FakeSGLang(slots=56)]
    try:
        fleet = SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=100))
        assert fleet.slots() == 80
        assert (fleet.call_timeout(80), fleet.call_timeout(81), fleet.call_timeout(512)) == (100.0, 200.0, 700.0)
        fleet.close()
        fleet = SGLangFleet(FleetConfig(urls=[fakes[0].url], router="none", request_timeout=100, step_timeout=50))
        assert fleet.call_timeout(512) == 50.0
        fleet.close()
    finally:
        for f in fakes:
            f.close()


def test_the_turns_of_an_episode_go_to_the_server_that_holds_its_prefix():
    """#52: requests submitted under one key (a multi-turn episode's turns; an interrupted request
    resumed) go to the server its last request went to, while that one serves and has a free slot,
    so its prefix cache serves the next turn's prefill; a new key goes by load. (Without it the
    least-served server took every other turn.)"""
    fakes = [FakeSGLang(slots=8), FakeSGLang(slots=8)]
    fleet = SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=60, probe_interval=600))
    try:
        params = SamplingParams(max_new_tokens=2)
        for key, first in (("a", 10), ("a", 10), ("a", 10), ("a", 10), ("b", 11)):  # episode a's 4 turns, then b's
            fleet.submit([Request([first, 4, 5], 2, key=key)], params)
            back, deadline = [], time.monotonic() + 60
            while not back and time.monotonic() < deadline:
                back = fleet.collect(timeout=0.5)
            assert len(back) == 1
        served = [[b["input_ids"][0] for b in f.bodies("/generate")] for f in fakes]
        assert sorted(served) == [[10] * 4, [11]], served  # a kept its server; b went to the less loaded one
    finally:
        fleet.close()
        for f in fakes:
            f.close()


def test_generate_sends_no_more_sequences_than_each_server_has_slots_and_fills_them():
    """#56 row 3: a step with more sequences than the fleet's slots (6 groups of n=4, 24 sequences,
    on servers of 3 and 5 slots) sends each server exactly its slots' worth, one request a sequence;
    the rest wait in the fleet, where no request's own time limit runs, and take a slot as one frees.
    (Before, generate sent every group of n at once, 64 at a time: the servers queued them, each
    request's clock running in the queue.) Every sample comes back in its group."""
    hold = threading.Event()
    fakes = [FakeSGLang(slots=3, hold=hold), FakeSGLang(slots=5, hold=hold)]
    fleet = SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=300,
                                    step_timeout=600, probe_interval=600))
    out = {}
    step = threading.Thread(target=lambda: out.update(groups=fleet.generate([[3, 4, i] for i in range(6)], n=4,
                                                                           max_new_tokens=2)), daemon=True)
    try:
        step.start()
        deadline = time.monotonic() + 120  # (generous: a loaded machine)
        while sum(f.sequences for f in fakes) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # (none beyond the slots arrives)
        assert [f.sequences for f in fakes] == [3, 5], [f.sequences for f in fakes]
        hold.set()
        step.join(timeout=120)
        assert not step.is_alive()
        groups = out["groups"]
        assert [len(g) for g in groups] == [4] * 6 and all(s.token_ids == [7, 8] for g in groups for s in g)
        assert [f.max_sequences for f in fakes] == [3, 5]
        bodies = [b for f in fakes for b in f.bodies("/generate")]
        assert len(bodies) == 24 and all(b["sampling_params"]["n"] == 1 for b in bodies)
        assert sorted(b["input_ids"][2] for b in bodies) == sorted(list(range(6)) * 4)
    finally:
        hold.set()
        fleet.close()
        for f in fakes:
            f.close()
