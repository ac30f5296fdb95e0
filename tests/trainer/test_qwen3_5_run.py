"""The main job's loop on a tiny Qwen3.5 (#53): tools/train.py with the embedded engine, the actor on
megatron-core's HybridModel (said once in the log), the engine on transformers' Qwen3.5. Its two steps
train (updates, a gradient: an entropy bonus, since a random model earns no reward), and after every weight sync the engine scores its samples as the actor
does (the drift check within fp32 rounding): the export's names and the engine's Qwen3.5 agree
tensor for tensor, the Gated DeltaNet's included. Its learning run (the main job's warm-up and 150
steps, ``examples/tiny_tepo/run.py --model qwen3_5``) is measured in the README, not here."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import REPO


@pytest.mark.journey  # (a whole tools/train.py run)
@pytest.mark.timeout(600)
def test_a_tiny_qwen3_5_trains_on_hybrid_model_and_its_engine_follows(tiny, tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    from make_tiny_model import make_qwen3_5

    model = make_qwen3_5(tiny, tmp_path / "qwen3_5")
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "tools/train.py"), "--config", str(REPO / "examples/tiny_tepo/config.yaml"),
           "reward.kind=exact_match", "rollout.prompts_per_step=8", "train.mini_batch_prompts=4", "train.steps=2",
           "train.export_hf=false", "rollout.dynamic_sampling=false", f"model.path={model}",
           # (a random model scores 0 everywhere: an entropy bonus moves the weights, so the sync has work)
           "algorithm.entropy_coef=0.01",
           f"data.train_files=[{tiny / 'train.jsonl'}]", f"train.output_dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=580, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("model: megatron-core's HybridModel") == 1, done.stdout[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["updates"] > 0 and math.isfinite(r["loss"]) and r["grad_norm"] > 0, r
        assert r["drift_tokens"] > 0 and r["drift_max"] < 1e-4, r  # the engine's log-probs are the actor's
