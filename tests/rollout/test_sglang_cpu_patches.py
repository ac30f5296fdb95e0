"""The SGLang CPU server patches (megatron_tepo/rollout/sglang_cpu/mtepo_sglang_cpu.py) inside the
SGLang venv: the reused receive buffer of ``/update_weights_from_distributed`` receives and loads
every bucket bit for bit, reuses one buffer across buckets of different layouts, and gives the
buffer up when a loader keeps a received tensor (which the next bucket must not overwrite).
Two processes over gloo; see recv_buffer_worker.py."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_tepo.rollout.sglang_fleet import free_port

WORKER = Path(__file__).parent / "recv_buffer_worker.py"


def _run(sglang_python, env_extra):
    port = free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}, **env_extra)
    procs = [subprocess.Popen([sglang_python, str(WORKER), str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    return json.loads(outs[1][0].strip().splitlines()[-1])


@pytest.mark.sglang
@pytest.mark.timeout(300)
def test_receive_buffer_reused_exact_and_given_up_when_kept(sglang_python):
    out = _run(sglang_python, {})
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
    out = _run(sglang_python, {"MTEPO_SGLANG_RECV_BUFFER": "0"})
    assert not out["patched"]
    assert all(s["exact"] and s["loaded"] for s in out["steps"])
    assert {s["buffer_ptr"] for s in out["steps"]} == {None}
