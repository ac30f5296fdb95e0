"""tools/train.py on prompt files: a local HF model and tokenizer, JSONL data with a bad row,
math-verify rewards in the pool, metrics and counters logged."""
import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_tepo.rewards import COUNT_NAMES

REPO = Path(__file__).resolve().parents[2]


def test_train_tool_on_files(tmp_path):
    sys.path.insert(0, str(REPO))
    from tests.checkpoint.fixtures import make_hf_dir

    model = make_hf_dir(tmp_path / "m", "qwen3", tie=True, vocab_size=320)  # the fixture BPE has 300 tokens
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 9)]
    rows.append({"prompt": [{"role": "user", "content": "12*7="}], "reward_model": {"ground_truth": "84"}})
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"prompt\": \"x\"}\n")
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "tools/train.py"), "--config", str(REPO / "examples/tiny_tepo/sizes.yaml"),
           f"model.path={model}", f"data.train_files=[{tmp_path / 'train.jsonl'}]", "data.on_bad_row=skip",
           "rollout.prompts_per_step=4", "rollout.n_samples=2", "train.mini_batch_prompts=2", "train.steps=2",
           "rollout.dynamic_sampling=false", "rollout.max_new_tokens=5", f"train.output_dir={out}",
           "reward.workers=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(24000 + os.getpid() % 5000)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_prompts"] == 9 and summary["train_bad_rows"] == 1 and summary["steps_run"] == 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    # A random model writes no \boxed{}: every sample is counted, in its own step, none crashes the pool.
    counts = [r["reward_no_answer"] + r["reward_errors"] + r["reward_timeouts"] for r in lines]
    assert counts == [4 * 2, 4 * 2] and sum(summary[k] for k in COUNT_NAMES) == 2 * 4 * 2
    assert lines[-1]["reward_mean"] == 0.0 and lines[-1]["drift_max"] < 1e-4

    bad = subprocess.run(cmd[:4] + [f"model.path={model}", "data.train_files=[]", f"train.output_dir={out}2"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert bad.returncode != 0 and "data.train_files: no training prompt files given" in bad.stderr
