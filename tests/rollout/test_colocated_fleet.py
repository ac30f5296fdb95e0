"""The fleet's colocated mode against fake SGLang servers (attach mode; the same on a real server:
test_colocated_restart.py and tests/trainer/test_colocated_sglang.py): release and resume are
idempotent and send each server only what changes it (SGLang's scheduler dies on a resume of a tag
it holds); a server serves nothing while its memory is released nor from a resume of its weights
until a weight sync reached it, router included; a server that comes back is brought to the
fleet's state; the launcher's ``TEPO_SGLANG_RELEASED`` is the initial state; failures are told
apart (a dead server is left to the restart path, a refusal is an error); the server's request log
(launch.py's middleware) shows what a memory request asks."""
import asyncio

import pytest
import torch

from megatron_tepo.rollout.engine import MEMORY_TAGS
from megatron_tepo.rollout.sglang.client import FleetError
from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
from megatron_tepo.rollout.sglang.health import Event, State
from tests.rollout.fake_sglang import FakeSGLang

MEMORY_ROUTES = ("/pause_generation", "/release_memory_occupation", "/continue_generation",
                 "/resume_memory_occupation")


def _fleet(fakes, **kw):
    kw = {"return_timeout": 5.0, **kw}
    return SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=30, step_timeout=60,
                                   probe_interval=0.2, probe_timeout=1.0, **kw))


def _memory_requests(fake):
    """The memory requests a fake got, as (path, tags)."""
    return [(r["path"], (r["body"] or {}).get("tags")) for r in fake.requests if r["path"] in MEMORY_ROUTES]


@pytest.fixture
def fakes():
    out = [FakeSGLang(), FakeSGLang()]
    yield out
    for f in out:
        f.close()


def test_release_and_resume_send_only_what_changes_and_gate_serving(fakes):
    fleet = _fleet(fakes)
    try:
        assert len(fleet.generate([[1]] * 2, n=1, max_new_tokens=2)) == 2
        fleet.release_memory(MEMORY_TAGS)
        fleet.release_memory(MEMORY_TAGS)  # released already: nothing sent
        fleet.release_memory(("kv_cache",))
        for f in fakes:  # aborted first (SGLang releases only an idle server), continued after
            assert _memory_requests(f) == [("/pause_generation", None), ("/release_memory_occupation", list(MEMORY_TAGS)),
                                           ("/continue_generation", None)]
        assert fleet.serving_servers() == []
        with pytest.raises(FleetError, match="memory is released or their weights await a weight sync"):
            fleet.generate([[1]], n=1, max_new_tokens=2)
        with pytest.raises(FleetError, match="resume_memory"):  # no load into released weights
            fleet.update_weights([("w", torch.ones(2))])

        fleet.resume_memory(("weights",))
        fleet.resume_memory(("weights",))  # held already: nothing sent (a second one kills SGLang's scheduler)
        assert all(s.awaits_weights and s.released == {"kv_cache", "cuda_graph"} for s in fleet.servers)
        fleet.resume_memory(("kv_cache", "cuda_graph"))
        assert all(s.awaits_weights and not s.released for s in fleet.servers)
        assert fleet.serving_servers() == []  # their memory back, their weights garbage: nothing served
        with pytest.raises(FleetError, match="weights await a weight sync"):
            fleet.generate([[1]], n=1, max_new_tokens=2)
        fleet.update_weights([("w", torch.ones(2))])
        assert fleet.serving_servers() == fleet.servers
        fleet.resume_memory(MEMORY_TAGS)  # everything held: nothing sent
        for f in fakes:
            assert [r for r in _memory_requests(f) if r[0].endswith("_memory_occupation")] == [
                ("/release_memory_occupation", list(MEMORY_TAGS)), ("/resume_memory_occupation", ["weights"]),
                ("/resume_memory_occupation", ["kv_cache", "cuda_graph"])]
        assert len(fleet.generate([[1]] * 2, n=1, max_new_tokens=2)) == 2
        with pytest.raises(ValueError, match="unknown memory tag"):
            fleet.release_memory(("optimizer",))
    finally:
        fleet.close()


def test_the_router_is_not_used_while_a_member_is_gated(fakes, monkeypatch):
    import megatron_tepo.rollout.sglang.dispatch as dispatch_mod
    import megatron_tepo.rollout.sglang.fleet as fleet_mod
    from megatron_tepo.rollout.sglang.client import SGLangServer

    routers = []

    def fake_launch_router(cfg, servers, policy, timeout):
        routers.append(FakeSGLang())
        return SGLangServer(routers[-1].url)

    monkeypatch.setattr(fleet_mod, "use_router", lambda cfg, n: True)
    monkeypatch.setattr(dispatch_mod, "launch_router", fake_launch_router)
    fleet = _fleet(fakes)
    try:
        assert fleet._use_router() is fleet.router
        fleet.release_memory(MEMORY_TAGS)
        assert fleet._use_router() is None
        fleet.resume_memory(("weights",))
        fleet.update_weights([("w", torch.ones(2))])
        assert fleet._use_router() is None  # the KV cache is still released
        fleet.resume_memory(("kv_cache", "cuda_graph"))
        assert fleet._use_router() is fleet.router and len(routers) == 1  # the same router: not rebuilt
        fleet.generate([[1]] * 2, n=1, max_new_tokens=2)
        assert routers[0].paths("POST").count("/generate") == 2
    finally:
        fleet.close()
        for r in routers:
            r.close()


def test_a_server_that_comes_back_is_brought_to_the_fleets_state(fakes):
    """An attached server whose job restarted it holds all its memory and its start-up weights: the
    fleet releases on it what it has released (and resumes nothing it holds), and it serves only
    after the sync reached it."""
    a, b = fakes
    fleet = _fleet(fakes)
    try:
        fleet.release_memory(MEMORY_TAGS)
        back = fleet.servers[1]
        back.health.fire(Event.EXITED, "test: its job restarted it")
        back.health.fire(Event.READY, "test: it answers again")  # a new incarnation
        assert back.state == State.STALE and not back.released
        seen = len(b.requests)
        fleet.resume_memory(("weights",))
        # it holds everything: the KV cache and graphs released, no resume of what it holds
        assert _memory_requests_after(b, seen) == [("/pause_generation", None),
                                                   ("/release_memory_occupation", ["kv_cache", "cuda_graph"]),
                                                   ("/continue_generation", None)]
        assert not back.awaits_weights  # its start-up weights, not garbage; but stale
        fleet.update_weights([("w", torch.ones(2))])
        assert back.state == State.HEALTHY and back not in fleet.serving_servers()
        fleet.resume_memory(("kv_cache", "cuda_graph"))
        assert fleet.serving_servers() == fleet.servers
    finally:
        fleet.close()


def test_a_sync_opens_the_restart_gate_while_it_waits_for_a_dead_attached_server(fakes, tmp_path):
    """Colocated, attached servers (their job restarts them: slurm/lib.sh): ``FleetConfig.restart_gate``
    exists only while a weight sync waits for a dead server to come back, never in the actor's turn;
    the server's job restarts it then (here: the frozen fake thaws when the gate appears) and the
    sync reaches it. A sync with nothing dead leaves the gate shut."""
    import threading
    import time

    a, b = fakes
    gate = tmp_path / "logs" / "restart.gate"
    fleet = SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=30, step_timeout=60,
                                    probe_interval=0.2, probe_timeout=1.0, return_timeout=60.0,
                                    restart_gate=str(gate)))
    seen = {}

    def its_job():  # restarts the server once the gate is open
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["text"] = gate.read_text() if gate.exists() else None
        b.thaw()

    try:
        fleet.release_memory(MEMORY_TAGS)
        b.freeze()  # its probe hangs: gone until its job restarts it
        back = fleet.servers[1]
        back.health.fire(Event.EXITED, "test: its process exited")
        fleet.resume_memory(("weights",))
        assert back.state == State.DEAD and not gate.exists()  # the actor's turn: no restart
        job = threading.Thread(target=its_job)
        job.start()
        fleet.update_weights([("w", torch.ones(2))])
        job.join()
        assert seen["text"] and "a weight sync waits for dead servers" in seen["text"], seen
        assert not gate.exists()  # shut again after the sync
        assert back.state == State.HEALTHY and back.incarnation == 1
        fleet.resume_memory(("kv_cache", "cuda_graph"))
        assert fleet.serving_servers() == fleet.servers
        fleet.release_memory(MEMORY_TAGS)
        fleet.resume_memory(("weights",))
        stop, opened = threading.Event(), []
        watch = threading.Thread(target=lambda: [opened.append(gate.exists()) or time.sleep(0.005)
                                                 for _ in iter(stop.is_set, True)])
        watch.start()
        fleet.update_weights([("w", torch.ones(2))])  # nothing dead: the gate stays shut
        stop.set()
        watch.join()
        assert opened and not any(opened) and not gate.exists()
    finally:
        b.thaw()
        fleet.close()


def _memory_requests_after(fake, n):
    return [(r["path"], (r["body"] or {}).get("tags")) for r in fake.requests[n:] if r["path"] in MEMORY_ROUTES]


def test_a_dead_server_is_left_to_the_restart_path_a_refusal_is_an_error(fakes):
    a, b = fakes
    fleet = _fleet(fakes)
    try:
        b.close()  # connection refused: dead, nothing to free
        fleet.release_memory(MEMORY_TAGS)
        assert fleet.servers[1].state == State.DEAD and fleet.servers[0].released == set(MEMORY_TAGS)
        a.missing.add("/resume_memory_occupation")  # an answer other than success
        with pytest.raises(FleetError, match="memory release/resume failed.*resume_memory_occupation"):
            fleet.resume_memory(("weights",))
        assert fleet.servers[0].state == State.HEALTHY  # a refusal is not a death
    finally:
        fleet.close()


def test_the_launchers_released_tags_are_the_initial_state(fakes, monkeypatch):
    from megatron_tepo.config import RolloutConfig
    from megatron_tepo.rollout.registry import engine_factory

    check = engine_factory("sglang").check
    monkeypatch.setenv("TEPO_SGLANG_URLS", ",".join(f.url for f in fakes))
    monkeypatch.setenv("TEPO_SGLANG_RELEASED", "weights, kv_cache,cuda_graph")
    check(RolloutConfig(engine="sglang", colocated=True))
    with pytest.raises(ValueError, match="TEPO_SGLANG_RELEASED=.*rollout.colocated is false"):
        check(RolloutConfig(engine="sglang"))
    monkeypatch.setenv("TEPO_SGLANG_RELEASED", "weights,optimizer")
    with pytest.raises(ValueError, match=r"TEPO_SGLANG_RELEASED='weights,optimizer': unknown memory tag\(s\) \['optimizer'\]"):
        check(RolloutConfig(engine="sglang", colocated=True))

    fleet = _fleet(fakes, released=("weights", "kv_cache", "cuda_graph"))
    try:
        assert fleet.serving_servers() == []
        fleet.release_memory(MEMORY_TAGS)  # what the launcher released is not released again
        fleet.resume_memory(("weights",))
        for f in fakes:
            assert _memory_requests(f) == [("/resume_memory_occupation", ["weights"])]
    finally:
        fleet.close()


def test_the_servers_request_log_names_a_memory_requests_tags(capsys):
    """launch.py's middleware: ``[mtepo] > POST /path tags=...`` on arrival, ``< ... status`` when
    answered; the body reaches SGLang's app whole."""
    from megatron_tepo.rollout.sglang.launch import LOGGED_ROUTES, RequestLog

    seen = {}

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        seen[scope["path"]] = body
        await send({"type": "http.response.start", "status": 200})
        await send({"type": "http.response.body", "body": b"null"})

    async def request(mw, path, chunks):
        queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

        async def receive():
            return queue.pop(0)

        async def send(message):
            pass

        await mw({"type": "http", "method": "POST", "path": path}, receive, send)

    mw = RequestLog(app)
    asyncio.run(request(mw, "/resume_memory_occupation", [b'{"tags": ["wei', b'ghts"]}']))
    asyncio.run(request(mw, "/release_memory_occupation", [b"{}"]))
    asyncio.run(request(mw, "/generate", [b'{"input_ids": [1]}']))  # not logged by default
    asyncio.run(request(RequestLog(app, routes=None), "/generate", [b"{}"]))
    out = capsys.readouterr().out.splitlines()
    assert out == ["[mtepo] > POST /resume_memory_occupation tags=weights",
                   "[mtepo] < POST /resume_memory_occupation 200",
                   "[mtepo] > POST /release_memory_occupation tags=all",
                   "[mtepo] < POST /release_memory_occupation 200",
                   "[mtepo] > POST /generate", "[mtepo] < POST /generate 200"]
    assert seen["/resume_memory_occupation"] == b'{"tags": ["weights"]}'
    assert "/resume_memory_occupation" in LOGGED_ROUTES and "/generate" not in LOGGED_ROUTES


def test_no_request_that_generates_reaches_a_server_while_its_memory_is_released(fakes):
    """Issue #40 row 2: a generation on a server whose KV cache and weights are released writes into
    unmapped memory and kills its scheduler. SGLang 0.5.23's ``/health`` generates (unless told not
    to), so the fleet's liveness checks use a route that does not, through a whole colocated step, a
    weight sync that finds a server dead and waits for it, and that server's restart by its job."""
    import threading
    import time

    a, b = fakes
    fleet = _fleet(fakes, return_timeout=60.0)
    try:
        # a colocated step: generate, release everything, weights back, the sync, the cache back
        assert len(fleet.generate([[1]] * 2, n=1, max_new_tokens=2)) == 2
        fleet.release_memory(MEMORY_TAGS)
        fleet.resume_memory(("weights",))
        fleet.update_weights([("w", torch.ones(2))])
        fleet.resume_memory(("kv_cache", "cuda_graph"))
        assert len(fleet.generate([[1]] * 2, n=1, max_new_tokens=2)) == 2
        # the next step: server b dies while released; the sync waits for its job to restart it
        fleet.release_memory(MEMORY_TAGS)
        b.freeze()
        fleet.servers[1].health.fire(Event.EXITED, "test: its process exited")
        fleet.resume_memory(("weights",))

        def its_job():
            time.sleep(0.5)
            b.restart()

        job = threading.Thread(target=its_job)
        job.start()
        fleet.update_weights([("w", torch.ones(2))])
        job.join()
        assert fleet.servers[1].state == State.HEALTHY and fleet.servers[1].incarnation == 1
        fleet.resume_memory(("kv_cache", "cuda_graph"))
        assert len(fleet.generate([[1]] * 4, n=1, max_new_tokens=2)) == 4
        assert {"/generate"} <= set(a.paths()) and {"/generate"} <= set(b.paths())  # (the check can fail)
        assert a.generated_while_released == [] and b.generated_while_released == [], (
            a.generated_while_released, b.generated_while_released)
        assert any(p in ("/model_info", "/get_model_info") for p in a.paths())  # (the liveness checks ran)
    finally:
        b.thaw()
        fleet.close()
