"""tools/train.py under torchrun: rank 0 drives (generates, scores, logs) and broadcasts; every rank
runs the actor. The same run at TP=2, DP=2, PP=2 and CP=2 reproduces the one-process run (the engine on
rank 0 gets every pipeline stage's weights: drift stays ~1e-6). A TP=2 run with a real SGLang
server as the engine, syncing every step and resuming, is the Slurm job test
(tests/slurm/test_local_cluster.py), which CI always runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import REPO, torchrun

BASE = ["--config", str(REPO / "examples/tiny_tepo/config.yaml"), "reward.kind=exact_match",
        "rollout.prompts_per_step=8", "train.mini_batch_prompts=4", "train.save_every=1"]


def _args(tiny, out, *extra):
    return [*BASE, f"model.path={tiny / 'model'}", f"data.train_files=[{tiny / 'train.jsonl'}]",
            f"train.output_dir={out}", *extra]


def _metrics(out):
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _single(tiny, out, *extra):
    proc = subprocess.run([sys.executable, str(REPO / "tools/train.py"), *_args(tiny, out, *extra)],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _metrics(out)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.tp=1", "parallel.pp=2",
                                    pytest.param("parallel.cp=2", marks=pytest.mark.second_lane)],
                         ids=["tp2", "dp2", "pp2", "cp2"])
def test_two_processes_match_one(tiny, tmp_path, layout):
    ref = _single(tiny, tmp_path / "one", "train.steps=2")
    torchrun(REPO / "tools/train.py", 2, *_args(tiny, tmp_path / "two", "train.steps=2", layout), tmp_path=tmp_path)
    got = _metrics(tmp_path / "two")
    assert [m["step"] for m in got] == [1, 2]
    for a, b in zip(ref, got):
        # rank 0 samples with the same engine and seed: identical groups and rewards
        assert a["reward_mean"] == b["reward_mean"] and a["response_length_mean"] == b["response_length_mean"]
        # the actor's numbers agree to fp32 noise (TP splits the matmuls; DP splits the rows)
        for key in ("loss", "entropy", "grad_norm", "approx_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["drift_max"] < 1e-4  # the fp32 engine holds exactly the actor's weights after each sync
    from megatron_tepo.checkpoint.store import find_latest_checkpoint

    assert find_latest_checkpoint(tmp_path / "two" / "checkpoints").name == "step_2"


def test_sglang_engine_without_urls_fails_naming_the_setting(tiny, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TEPO_SGLANG_URLS"}
    proc = subprocess.run([sys.executable, str(REPO / "tools/train.py"),
                           *_args(tiny, tmp_path / "x", "rollout.engine=sglang")],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode != 0 and "TEPO_SGLANG_URLS" in proc.stderr and "rollout.sglang_urls" in proc.stderr
    bad = subprocess.run([sys.executable, str(REPO / "tools/train.py"),
                          *_args(tiny, tmp_path / "y", "rollout.engine=sglang")],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**env, "TEPO_SGLANG_URLS": "localhost:30000"})
    assert bad.returncode != 0 and "'localhost:30000' is not an http(s) URL" in bad.stderr
