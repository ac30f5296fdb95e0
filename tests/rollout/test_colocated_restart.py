"""A colocated server killed mid-run comes back as in disaggregated mode (restart, re-sync), and
in the fleet's memory state: a real SGLang CPU server, launched by the fleet, goes through a
colocated step's phases (generate, release, the actor's turn, weights back, the ``ipc`` sync, the
KV cache back) and is ``kill -9``-ed while its memory is released (the actor's turn). The resume of
its weights finds it dead and goes on, and it is not restarted in the actor's turn (a new process
takes its full memory); the sync restarts it and waits for it, releases on the new process
what the fleet has released (its KV cache and graphs: its weights the fleet holds), pushes the
weights, and only the resume of the KV cache lets it serve. Then it generates what the pushed
weights do (an HF model of them, float32), its own log shows that order with no generation before
it, and its states and the step counters are those of a disaggregated restart.

And the same faults in a whole colocated training run (issue #34's acceptance: a kill mid-run is
survived as in disaggregated mode; test_fleet_recovery.py is the disaggregated one)."""
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.rollout.fleet_recovery_worker import GREEDY_TOKENS, greedy
from tests.rollout.helpers import save_tiny_qwen3, tiny_qwen3

pytestmark = pytest.mark.sglang


def _mtepo_requests(log_path):
    text = Path(log_path).read_text(errors="replace")
    return [(m.group(1), m.group(2), m.group(3)) for m in
            re.finditer(r"^\[mtepo\] ([<>]) (?:GET|POST) (\S+)(?: tags=(\S+))?", text, re.M)
            if m.group(2) not in ("/health", "/server_info", "/get_server_info")]


def test_a_colocated_server_killed_while_released_is_restarted_aligned_and_resynced(tmp_path, sglang_python):
    import requests

    from megatron_tepo.rollout.engine import MEMORY_TAGS
    from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
    from megatron_tepo.rollout.sglang.server import ServerConfig
    from megatron_tepo.rollout.sglang.weight_sync import make_weight_sync

    save_tiny_qwen3(str(tmp_path / "model"), seed=0)
    fleet = SGLangFleet(FleetConfig(num_servers=1, router="none", request_timeout=120, step_timeout=300,
                                    probe_interval=2.0, probe_timeout=10.0, restart_backoff=0.5, server_restarts=1,
                                    server=ServerConfig(model_path=str(tmp_path / "model"), python=sglang_python,
                                                        dtype="float32", startup_timeout=400,
                                                        log_dir=str(tmp_path / "logs"),
                                                        env={"TEPO_SGLANG_LOG_REQUESTS": "1"})))
    try:
        fleet.weight_sync = make_weight_sync("ipc", fleet, wire_dtype=torch.float32)
        s = fleet.servers[0]
        first_log = s.log_path
        prompts = [[3, 4, 5], [7, 8, 9, 10]]
        assert len(fleet.generate(prompts, n=2, max_new_tokens=4)) == 2
        fleet.health_metrics()  # (the counters from here on)

        fleet.release_memory(MEMORY_TAGS)
        os.kill(s.pid, signal.SIGKILL)  # the actor's turn: the server dies with its memory released
        s.proc.wait(timeout=30)
        fleet.resume_memory(("weights",))  # finds it dead: the restart path takes it, no error
        time.sleep(1.0)  # (more than restart_backoff: a restart would have begun by now)
        assert s.state.value == "dead" and s.incarnation == 0  # restarted at the sync, not in the actor's turn
        trained = tiny_qwen3(seed=3)  # what the actor's update made of the weights
        t0 = time.monotonic()
        fleet.update_weights([(n, p.detach()) for n, p in trained.state_dict().items()])
        print(f"sync with the restart: {time.monotonic() - t0:.1f} s")
        assert s.incarnation == 1 and s.log_path != first_log
        assert s.state.value == "healthy" and s.released == {"kv_cache", "cuda_graph"}
        assert fleet.serving_servers() == []  # its KV cache is released: nothing served yet
        fleet.resume_memory(("kv_cache", "cuda_graph"))
        assert fleet.serving_servers() == [s]

        got = [requests.post(s.url + "/generate", headers=s.headers(), timeout=120, json={
            "input_ids": p, "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0.0,
                                                "ignore_eos": True}}).json()["output_ids"] for p in prompts]
        assert got == [greedy(trained, p) for p in prompts]
        assert got != [greedy(tiny_qwen3(seed=0), p) for p in prompts]  # (the start-up weights differ)
        groups = fleet.generate(prompts, n=2, max_new_tokens=4)
        assert [len(g) for g in groups] == [2, 2]

        # the new process's own log: the fleet's released memory released on it, the push, then its
        # KV cache back; no resume of what it held, no generation before its KV cache was back
        reqs = _mtepo_requests(s.log_path)
        memory = [(p, t) for way, p, t in reqs if way == ">" and p.endswith("_memory_occupation")]
        assert memory == [("/release_memory_occupation", "kv_cache,cuda_graph"),
                          ("/resume_memory_occupation", "kv_cache,cuda_graph")], memory
        release = reqs.index((">", "/release_memory_occupation", "kv_cache,cuda_graph"))
        update = reqs.index(("<", "/update_weights_from_tensor", None))
        resume = reqs.index(("<", "/resume_memory_occupation", None))
        assert release < update < resume
        assert not [r for r in reqs[:resume] if r[1] == "/generate"], reqs[:resume]
        # as a disaggregated restart: dead -> restarting -> stale -> healthy (on the sync), counted once
        path = [(t.old.value, t.new.value) for t in s.health.history if t.old != t.new]
        assert path[-4:] == [("healthy", "dead"), ("dead", "restarting"), ("restarting", "stale"),
                             ("stale", "healthy")], path
        counts = fleet.health_metrics()
        assert {k: counts[k] for k in ("fleet_died", "fleet_restarts", "fleet_returned", "fleet_resynced")} == \
            {"fleet_died": 1.0, "fleet_restarts": 1.0, "fleet_returned": 1.0, "fleet_resynced": 1.0}
    finally:
        fleet.close()


def test_a_colocated_training_run_survives_a_server_killed_generating_and_one_killed_released(
        tiny, tmp_path, sglang_python):
    """The same faults in a whole colocated run (fleet_recovery_worker.py with ``"colocated": true``:
    ``train()``, the Megatron actor, two launched servers, the ``ipc`` sync): server 0 ``kill -9``-ed
    in step 2 as it generates, server 1 in step 3 once it has released its memory. As in the
    disaggregated run (test_fleet_recovery.py): each comes back through dead -> restarting -> stale
    -> healthy on its sync, serves the actor's weights after it, and every step is logged once. Unlike
    there, the restart waits for the step's weight sync (a server killed as it generates too): a new
    process takes its full memory, which only that phase has room for beside the actor."""
    import json

    from tests.rollout.test_fleet_recovery import _generate_before_first_load, _run, _transitions, deaths_counted_in_time

    out = tmp_path / "run"
    res, log = _run(tiny, out, sglang_python, colocated=True)
    assert set(res["faults"]) == {"kill", "kill_released"}, res["faults"]
    for server in res["servers"]:
        path = _transitions(server)  # (its changes of state: a probe finding it healthy may land anywhere)
        dead = path.index(next(t for t in path if t[2] == "dead"))
        assert path[dead][1] == "exited", path
        assert [t[2] for t in path[dead:]] == ["dead", "restarting", "stale", "healthy"], path
        assert path[-1] == ("stale", "synced", "healthy"), path
        assert server["restarts"] == 1 and server["incarnation"] == 1

        # its new process: started at the step's weight sync (the one phase with room for it beside
        # the actor), so the fleet's released KV cache released on it, then the push, then its KV
        # cache back; no generation before
        assert _generate_before_first_load(server["log_path"]) == 0, server["log_path"]
        reqs = _mtepo_requests(server["log_path"])
        memory = [(p, t) for way, p, t in reqs if way == ">" and p.endswith("_memory_occupation")]
        assert memory[:2] == [("/release_memory_occupation", "kv_cache,cuda_graph"),
                              ("/resume_memory_occupation", "kv_cache,cuda_graph")], memory  # (weights: held)
        update = reqs.index(("<", "/update_weights_from_tensor", None))
        resumes = [i for i, r in enumerate(reqs) if r[:2] == ("<", "/resume_memory_occupation")]
        assert resumes and resumes[-1] > update, reqs
        first_generate = next((i for i, r in enumerate(reqs) if r[1] == "/generate"), len(reqs))
        cache_back = next(i for i in resumes if i > update)
        assert first_generate > cache_back, reqs[:first_generate + 1]

    # after each step's sync every serving server generates what the actor's weights do; each
    # restarted server is checked in the step that lost it
    assert all(r["got"] == r["want"] for r in res["checks"] if "got" in r), res["checks"]
    back = {(r["server"], r["step"]) for r in res["checks"] if "got" in r and r["incarnation"] == 1}
    assert (0, 2) in back and (1, 3) in back, res["checks"]

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all("engine_release_s" in r and "actor_onload_s" in r for r in rows)  # (it ran colocated)
    total = {k: sum(r[k] for r in rows) for k in ("fleet_died", "fleet_restarts", "fleet_returned", "fleet_resynced")}
    assert total == {"fleet_died": 2, "fleet_restarts": 2, "fleet_returned": 2, "fleet_resynced": 2}, total
    # (a step's counts are read after its rollout: the server lost in step 3's actor turn is step 4's;
    # the one killed as it generates in step 2 is step 2's or, when it answered first, step 3's)
    assert deaths_counted_in_time([r["fleet_died"] for r in rows], [2, 3]), rows
    assert rows[-1]["fleet_healthy"] == 2
