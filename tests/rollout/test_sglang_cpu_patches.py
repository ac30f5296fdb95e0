"""The SGLang CPU server patches (megatron_tepo/rollout/sglang_cpu/mtepo_sglang_cpu.py) inside the
SGLang venv: the reused receive buffer of ``/update_weights_from_distributed`` receives and loads
every bucket bit for bit, reuses one buffer across buckets of different layouts, and gives the
buffer up when a loader keeps a received tensor (which the next bucket must not overwrite); the
direct receive (patch 3) moves the parameters of a layout whose loaders only copy into one
bucket-sized tensor and receives later buckets of that layout straight into them, and no other.
Two processes over gloo; see recv_buffer_worker.py."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_tepo.net import free_port

WORKER = Path(__file__).parent / "recv_buffer_worker.py"


def _run(sglang_python, env_extra, scenario="buffer"):
    port = free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}, **env_extra)
    procs = [subprocess.Popen([sglang_python, str(WORKER), str(r), str(port), scenario], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    return json.loads(outs[1][0].strip().splitlines()[-1])


@pytest.mark.sglang
@pytest.mark.timeout(300)
def test_receive_buffer_reused_exact_and_given_up_when_kept(sglang_python):
    out = _run(sglang_python, {"MTEPO_SGLANG_DIRECT_RECEIVE": "0"})  # patch 2 alone (3: below)
    assert out["patched"]
    steps = out["steps"]
    assert all(s["exact"] and s["loaded"] for s in steps), steps
    assert [s["names"] for s in steps] == [["w", "b"], ["w", "b"], ["w"], ["w", "b"]]
    # one buffer for the first three buckets (the third is smaller: a view of it)
    assert steps[0]["buffer_ptr"] == steps[1]["buffer_ptr"] == steps[2]["buffer_ptr"] is not None
    assert steps[0]["buffer_after_load"] and steps[1]["buffer_after_load"]
    # bucket 3's loader kept its tensor: the buffer went with it, bucket 4 got a new one
    assert not steps[2]["buffer_after_load"]
    assert steps[3]["buffer_ptr"] != steps[2]["buffer_ptr"]
    assert out["kept_intact"]


@pytest.mark.sglang
@pytest.mark.timeout(300)
def test_receive_buffer_patch_off_switch(sglang_python):
    out = _run(sglang_python, {"MTEPO_SGLANG_RECV_BUFFER": "0"})  # patch 3 on: fresh receives
    assert not out["patched"]
    assert all(s["exact"] and s["loaded"] for s in out["steps"])
    assert {s["buffer_ptr"] for s in out["steps"]} == {None}


@pytest.mark.sglang
@pytest.mark.timeout(300)
def test_direct_receive_into_parameters(sglang_python):
    out = _run(sglang_python, {}, "direct")
    assert out["patched"]
    steps = out["steps"]
    assert all(s["loaded"] and s["draft_loaded"] for s in steps), steps
    assert [s["names"] for s in steps] == (["qkvn"] * 3 + ["s", "s", "kqv"] + ["qkvn"] * 2 + ["qkv"] * 2
                                           + ["c"] * 2 + ["n"] * 2)
    # the first bucket of a layout is loaded (and traced); then that layout goes into the params;
    # a scaling loader (s), a layout in another order (kqv) and a parameter with a view kept
    # elsewhere (c) never; after n was replaced (step 6) and after a new bucket size (step 8) the
    # layout is traced again, then direct; n, left behind in L1's tensor when qkv moved, moves too
    assert [s["direct"] for s in steps] == [False, True, True, False, False, False, False, True, False, True,
                                            False, False, False, True]
    assert [s["in_params"] for i, s in enumerate(steps) if s["direct"]] == [True] * 5
    assert not steps[0]["in_params"]
    assert all(s["view_current"] for s in steps)  # c stayed where its view is
    # L4's plan took qkv from L1's, which was dropped; then n got its own
    assert [s["plans"] for s in steps] == [1] * 12 + [2, 2]
    # the receive buffer is let go while every layout seen goes in directly; kept once one was refused
    assert [s["buffer_held"] for s in steps[:4]] == [True, False, False, True]
    assert all(s["buffer_held"] for s in steps[4:])


@pytest.mark.sglang
@pytest.mark.timeout(300)
def test_direct_receive_off_switch(sglang_python):
    out = _run(sglang_python, {"MTEPO_SGLANG_DIRECT_RECEIVE": "0"}, "direct")
    assert not out["patched"]
    assert all(s["loaded"] and s["draft_loaded"] and not s["direct"] for s in out["steps"])
    assert {s["plans"] for s in out["steps"]} == {0}


def test_a_released_scheduler_empties_torchs_cuda_cache(monkeypatch):
    """Issue #40 row 5: SGLang's release unmaps what the memory saver holds but leaves the activations
    in torch's caching allocator; launch.py wraps the scheduler's release (every site of the version
    range, found in order) to empty the cache after it, once, keeping what it returns."""
    import sys
    import types

    from megatron_tepo.rollout.sglang import launch

    calls = []

    class Manager:  # stand-in of 0.5.23's class
        def release_memory_occupation(self, req):
            calls.append(("release", req))
            return "out"

    mod = types.ModuleType("stand_in_weight_updater")
    mod.Manager = Manager
    monkeypatch.setitem(sys.modules, "stand_in_weight_updater", mod)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    sites = (("no_such_module_here", "X"), ("stand_in_weight_updater", "Manager"))
    assert launch.empty_cache_after_release(sites) == "stand_in_weight_updater.Manager"
    assert launch.empty_cache_after_release(sites) == "stand_in_weight_updater.Manager"  # (wrapped once)
    assert Manager().release_memory_occupation("req") == "out"
    assert calls == [("release", "req"), ("empty_cache",)]
    assert launch.empty_cache_after_release((("no_such_module_here", "X"),)) == ""


@pytest.mark.sglang
def test_the_release_sites_are_sglangs_own():
    """The first site is where the installed SGLang (0.5.23, the tests' server) releases memory (read
    in its source, not imported: importing the scheduler takes a while)."""
    import re

    from megatron_tepo.rollout.sglang import launch
    from tests.rollout.conftest import require_sglang

    python = Path(require_sglang())
    module, cls = launch.RELEASE_SITES[0]
    src = next(python.parent.parent.glob("lib/python3*/site-packages/" + module.replace(".", "/") + ".py")).read_text()
    body = src.split(f"class {cls}", 1)[1]
    assert re.search(r"\n    def release_memory_occupation\(self", body), cls
