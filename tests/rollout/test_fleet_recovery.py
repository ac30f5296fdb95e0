"""A real training run on a launched fleet of two real SGLang CPU servers survives losing them
(fleet_recovery_worker.py runs it): ``kill -9`` of server 0 in step 2 and SIGSTOP of server 1 in
step 3. Each time the step completes on the other server; the lost one is restarted, gets the
current weights, and only then serves: its greedy output equals the actor's (float32 on both
sides), its own access log shows no generation before its weight load, and the frozen server is
found dead by the generation probe within the configured bound, long before the request
time-out. The metrics hold every step exactly once and count every change of state once.

And a resumed run re-syncs: it continues that run from its checkpoints, its servers start from
other weights, and at its first generation they already generate what the resumed actor does."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import REPO

pytestmark = pytest.mark.sglang


def _run(tiny, out, sglang_python, router="none", phase="faults", steps=4, server_model=None, colocated=False):
    out.mkdir(parents=True, exist_ok=True)
    args = {"tiny": str(tiny), "out": str(out), "python": sglang_python, "router": router, "phase": phase,
            "steps": steps, "server_model": str(server_model) if server_model else None, "colocated": colocated}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MTEPO_RESULT_DIR": str(out)}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(REPO / "tests/rollout/fleet_recovery_worker.py"), json.dumps(args)],
                          env=env, capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "rank0.json").read_text()), proc.stdout + proc.stderr


def _transitions(server):
    """A server's changes of state as ``(old, event, new)``, in order. The events that leave a state
    as it was (a probe that finds a healthy server healthy, a sync to a healthy one) are left out:
    when they land depends on the machine's load, not on the code."""
    return [(old, event, new) for _, old, event, new, _ in server["history"] if old != new]


def deaths_counted_in_time(died_per_step, fault_steps):
    """Each death is counted once, in the step that lost its server or the next, never before: the
    deaths counted by the end of step k are at most the faults injected up to step k and at least
    those injected up to step k - 1. (Which of the two steps counts it depends on the machine's
    load: a server killed as its request runs may answer the request first, and then it is found
    by the next probe or sync.)"""
    counted = 0
    for k, died in enumerate(died_per_step, start=1):
        counted += died
        if not sum(f < k for f in fault_steps) <= counted <= sum(f <= k for f in fault_steps):
            return False
    return counted == len(fault_steps)


def _generate_before_first_load(log_path):
    """POST /generate lines in a server's access log before its first weight load."""
    n = 0
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if "POST /update_weights_from_tensor" in line:
            return n
        n += "POST /generate" in line
    raise AssertionError(f"{log_path}: no weight load logged")


@pytest.fixture(scope="module")
def faults_run(tiny, tmp_path_factory, sglang_python):
    """The 4-step run with both faults, once for the module: the first test judges it, the second
    resumes from its checkpoints (a fleet start and a run fewer)."""
    out = tmp_path_factory.mktemp("fleet_recovery") / "run"
    res, log = _run(tiny, out, sglang_python)
    return res, log, out


def test_killed_and_frozen_servers_come_back_with_the_current_weights(faults_run):
    res, log, out = faults_run
    killed, frozen = res["servers"]
    assert set(res["faults"]) == {"kill", "stop"}, res["faults"]

    # 1. each lost server went dead -> restarting -> stale -> healthy, healthy only on "synced"
    for server, how in ((killed, "exited"), (frozen, "probe_failed")):
        path = _transitions(server)
        assert ("stale", "synced", "healthy") in path, path
        dead = path.index(next(t for t in path if t[2] == "dead"))
        assert path[dead][1] == how, path
        assert [t[2] for t in path[dead:]] == ["dead", "restarting", "stale", "healthy"], path
        assert server["restarts"] == 1 and server["incarnation"] == 1

    # 2. the frozen server was found by the generation probe within its bound, not by the
    #    request time-out (300 s)
    t_dead, why = next((t, w) for t, _, _, new, w in frozen["history"] if new == "dead")
    found_after = t_dead - res["faults"]["stop"]["time"]
    assert "one-token generation" in why, why
    assert found_after < res["request_timeout"] / 2, found_after
    print(f"frozen server found dead {found_after:.1f} s after SIGSTOP (bound {res['probe_bound_s']:.0f} s "
          f"+ a loaded machine's slack)")

    # 3. no request reached a restarted server before its weight sync: the fleet's record and the
    #    server's own access log
    for i, server in enumerate(res["servers"]):
        synced = next(t for t, old, ev, new, _ in server["history"] if old == "stale" and new == "healthy")
        early = [r for r in res["requests"] if r[1] == i and r[2] == 1 and r[3] == "/generate" and r[0] < synced]
        assert not early, early
        assert _generate_before_first_load(server["log_path"]) == 0, server["log_path"]

    # 4. after each step's sync every serving server generates what the actor's weights do;
    #    each restarted server is checked after its return
    for row in res["checks"]:
        if "got" in row:
            assert row["got"] == row["want"], row
    back = {(r["server"], r["step"]) for r in res["checks"] if "got" in r and r["incarnation"] == 1}
    assert (0, 2) in back and (1, 3) in back, res["checks"]

    # 5. the metrics: every step once, every change of state counted once
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    total = {k: sum(r[k] for r in rows) for k in ("fleet_died", "fleet_restarts", "fleet_returned", "fleet_resynced")}
    assert total == {"fleet_died": 2, "fleet_restarts": 2, "fleet_returned": 2, "fleet_resynced": 2}, total
    # in the steps that lost them (step 2's kill, step 3's stop), or the next
    assert deaths_counted_in_time([r["fleet_died"] for r in rows], [2, 3]), rows
    assert rows[-1]["fleet_healthy"] == 2
    assert "-> dead" in log and "stale -> healthy on synced" in log  # every transition is logged


def _other_weights(tiny, dst):
    """The tiny model's folder with other weights altogether (what a requeued job's servers load
    from model.path is not what its checkpoint holds)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny / "model", dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    model = AutoModelForCausalLM.from_pretrained(tiny / "model")  # float32, as saved
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(dst)
    return model


def test_resumed_run_serves_the_resumed_weights_before_its_first_generation(faults_run, tiny, tmp_path,
                                                                            sglang_python):
    import shutil

    from tests.rollout.fleet_recovery_worker import greedy

    out = tmp_path / "run"  # a copy of the faulted run: its checkpoints of steps 1-4 and its metrics
    shutil.copytree(faults_run[2], out, ignore=shutil.ignore_patterns("sglang_logs", "rank*.json"))
    other = _other_weights(tiny, tmp_path / "other_model")
    res, log = _run(tiny, out, sglang_python, phase="resume", steps=5, server_model=tmp_path / "other_model")
    assert "continuing at step 5" in log, log[-3000:]
    first = [r for r in res["checks"] if r["step"] == 0]
    assert [r["server"] for r in first] == [0, 1] and all(r["state"] == "healthy" for r in first), first
    for r in first:  # before the first generation: the resumed actor's weights, not model.path's
        assert r["got"] == r["want"], r
    assert [greedy(other, p) for p in res["prompts"]] != first[0]["want"]  # the check can fail
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
