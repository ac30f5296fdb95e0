"""Colocated mode on a real SGLang CPU server (issue #34's acceptance, engine half): a TP=2 actor
(torchrun, gloo, 2 processes; colocated_sglang_worker.py) attached to one real server, 3 steps, the
weights handed over by the ``ipc`` sync (shared-memory handles on CPU, the code path of CUDA IPC).

* The server's own log (its requests, logged by megatron_tepo/rollout/sglang/launch.py) shows every
  step's memory phases in order -- release of its weights, KV cache and CUDA graphs, resume of its
  weights, the weight update (by ``/update_weights_from_tensor``, no update group), resume of its KV
  cache -- and no generation from a release until the resume of the KV cache (so none between a
  weight resume and the end of its sync).
* After each sync the server holds the actor's HF export (an HF model loaded with the exported
  weights, float32 on both sides): its prompt log-probs equal the HF model's and its greedy output
  too; and each step's export differs from the one before (by digest) when the step updated.
* The metrics equal those of the same run disaggregated (``rollout.colocated=false``, the same
  seed, the same server), every key but the timings and the colocated phases' own.
"""
import json
import re
from pathlib import Path

import pytest

from megatron_tepo.rollout.sglang.server import stop_server
from tests.dist_utils import REPO, torchrun
from tests.rollout.conftest import require_sglang

pytestmark = [pytest.mark.sglang, pytest.mark.distributed]

TIMINGS = {"time", "step_s", "sync_s", "rollout_s", "train_s", "tokens_per_s"}
MEMORY = {"engine_release_s", "engine_resume_s", "actor_onload_s", "actor_offload_s", "actor_onload_gb",
          "actor_offload_gb"}
STEPS = 3


@pytest.fixture
def start_server(tiny, tmp_path):
    """A fresh real SGLang CPU server per run (float32, the tiny model, a fixed random seed: the two
    runs sample alike), every request in its log."""
    from megatron_tepo.rollout.sglang.server import ServerConfig, launch_server, wait_ready

    sglang_python, started = require_sglang(), []

    def start():
        s = launch_server(ServerConfig(model_path=str(tiny / "model"), python=sglang_python, dtype="float32",
                                       startup_timeout=400, log_dir=str(tmp_path / "sglang_logs"),
                                       extra_args=("--random-seed", "1234"),
                                       # (and launch.py's cache emptying wrapped around its scheduler's release, as
                                       # on a colocated GPU server: a no-op on CPU, the wrapper on the real path)
                                       env={"TEPO_SGLANG_LOG_REQUESTS": "1", "TEPO_SGLANG_EMPTY_CACHE_ON_RELEASE": "1"}))
        started.append(s)
        wait_ready([s], 400)
        return s

    yield start
    for s in started:
        stop_server(s)


def _run(tiny, tmp_path, server, colocated):
    out = tmp_path / ("colocated" if colocated else "separate")
    args = json.dumps({"tiny": str(tiny), "out": str(out), "colocated": colocated, "steps": STEPS})
    try:
        res = torchrun(REPO / "tests/trainer/colocated_sglang_worker.py", 2, args, tmp_path=out, timeout=900,
                       env={"TEPO_SGLANG_URLS": server.url, "TEPO_SGLANG_API_KEY": server.api_key})[0]
    finally:
        stop_server(server)  # (the cores for the next one)
    return res, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _requests(log_text):
    """The server's requests as ``(">" arrived | "<" answered, path, tags)``, in the log's order
    (the memory requests of one server come one at a time: an answer is its last arrival's)."""
    out, tags_of = [], {}
    for m in re.finditer(r"^\[mtepo\] ([<>]) (?:GET|POST) (\S+)(?: tags=(\S+))?", log_text, re.M):
        way, path, tags = m.groups()
        if path in ("/health", "/server_info", "/get_server_info"):
            continue
        if way == ">":
            tags_of[path] = tags
        out.append((way, path, tags if way == ">" else tags_of.get(path)))  # (the answer: its request's tags)
    return out


def _phases(reqs):
    """The memory phases and weight updates the server answered, as one list of names."""
    names = {("/release_memory_occupation", "weights,kv_cache,cuda_graph"): "release",
             ("/resume_memory_occupation", "weights"): "resume_weights",
             ("/resume_memory_occupation", "kv_cache,cuda_graph"): "resume_cache",
             ("/update_weights_from_tensor", None): "update"}
    out = []
    for way, path, tags in reqs:
        name = names.get((path, tags))
        if way == "<" and name and (not out or out[-1] != name):  # (a sync of several buckets: one update)
            out.append(name)
    return out


def test_colocated_tp2_on_a_real_server_equals_the_separate_run(tiny, tmp_path, start_server):
    separate, separate_rows = _run(tiny, tmp_path, start_server(), colocated=False)
    server = start_server()
    res, rows = _run(tiny, tmp_path, server, colocated=True)
    reqs = _requests(Path(server.log_path).read_text(errors="replace"))

    # 1. the memory phases, in order: the start (release, weights back, first sync, cache back), then
    #    every step (generation, release, weights back, the sync, cache back)
    assert res["sync_mode"] == "IpcSync"
    phases = _phases(reqs)
    assert phases[:4 * (STEPS + 1)] == ["release", "resume_weights", "update", "resume_cache"] * (STEPS + 1), phases
    assert phases[4 * (STEPS + 1):] in ([], ["release"]), phases  # (the run may hand the actor its GPUs back)
    assert not [r for r in reqs if "weights_update_group" in r[1] or r[1] == "/update_weights_from_distributed"]
    #    no generation from a release until the KV cache is back (every phase logged when answered)
    gated, generated_in_gate = False, []
    for way, path, tags in reqs:
        if path == "/release_memory_occupation" and way == ">":
            gated = True
        elif path == "/resume_memory_occupation" and tags == "kv_cache,cuda_graph" and way == "<":
            gated = False
        elif path == "/generate" and gated:
            generated_in_gate.append((way, path))
    assert not generated_in_gate, generated_in_gate
    assert sum(1 for r in reqs if r[:2] == (">", "/generate")) > STEPS  # (the check can fail: it generates)

    # 2. after each sync the server holds the actor's HF export: the same log-probs (float32 on both
    #    sides: rounding apart) and the same greedy output; and the weights moved at every update
    #    (not "the greedy answers changed", which a correct run need not show after a few updates)
    assert [c["step"] for c in res["checks"]] == list(range(1, STEPS + 1))
    for c in res["checks"]:
        assert c["got"] == c["want"], c
        assert c["lp_gap"] < 1e-3, c
    assert all(r["updates"] > 0 for r in rows)
    digests = [c["digest"] for c in res["checks"]]
    assert len(set(digests)) == STEPS, digests

    # 3. the metrics are the separate run's, but for the timings and the memory phases' own keys
    assert [r["step"] for r in rows] == [r["step"] for r in separate_rows] == list(range(1, STEPS + 1))
    for new, old in zip(rows, separate_rows):
        assert set(new) - set(old) == MEMORY, set(new) ^ set(old)
        same = {k: v for k, v in old.items() if k not in TIMINGS}
        assert {k: new[k] for k in same} == pytest.approx(same, rel=1e-6, abs=1e-9), new["step"]
    assert all(r["updates"] > 0 for r in rows)
    assert [c["got"] for c in separate["checks"]] == [c["got"] for c in res["checks"]]
