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
