"""Bring your own task (#58, docs/TASKS.md): a data file with extra fields, one Python file with a
reward and a stateful environment, one command -- ``tools/train.py`` run from a folder outside the
package, the reward and the environment given by file path, no file of the package edited; the tiny
model trains, the reward sees each row and episode, the environment opens each episode from its row."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.dist_utils import REPO
from tests.trainer.test_resume import _tool_model

pytestmark = [pytest.mark.slow, pytest.mark.journey]  # one whole run of the trainer (~40 s)

TASK = textwrap.dedent('''
    import json, os
    from megatron_tepo.environments import Environment, Reply

    def score(text, ids, row, episode):
        with open("scored.jsonl", "a") as f:  # (what the reward saw, for the test)
            f.write(json.dumps({"text": text, "row": row, "env": episode.get("env")}) + "\\n")
        return float(text.strip() == row["sum"])

    class Oracle(Environment):
        """Opens each episode from its row: a turn with a code block is answered with the row's sum,
        a turn without one ends the episode, rewarded per turn (logged)."""
        name = "oracle"

        def __init__(self, tag="x"):
            self.tag = tag

        def start(self, row, messages):
            return {"sum": row["sum"], "tag": self.tag, "user": messages[0]["content"], "looks": 0}

        def step(self, state, turn, turn_index):
            if "```python" in turn:
                state["looks"] += 1
                return Reply(done=False, message=state["sum"], tool_calls=1)
            return Reply(done=True, reward=float(turn.strip() == state["sum"]))
''')


def test_a_reward_and_an_environment_from_a_folder_outside_the_package_train_the_tiny_model(tmp_path):
    task = tmp_path / "my_task"
    task.mkdir()
    model = _tool_model(tmp_path / "model")  # (a tiny chat model taught to call its tool on 37*45, then answer)
    (task / "train.jsonl").write_text("".join(json.dumps({"prompt": "37*45", "sum": "1665", "id": k}) + "\n"
                                              for k in range(16)))  # no 'answer': the reward reads 'sum'
    (task / "task.py").write_text(TASK)
    (task / "run.yaml").write_text(textwrap.dedent(f'''
        _base_: [{REPO / "examples/tiny_tir/sizes.yaml"}]
        model: {{path: {model}}}
        data: {{train_files: [train.jsonl]}}
        reward: {{function: task.py:score, workers: 1}}
        environment: {{name: task.py:Oracle, args: {{tag: mine}}}}
        rollout: {{prompts_per_step: 4, n_samples: 2, dynamic_sampling: false}}
        train: {{steps: 2, mini_batch_prompts: 4, output_dir: out, export_hf: false}}
    '''))
    proc = subprocess.run([sys.executable, str(REPO / "tools/train.py"), "--config", "run.yaml"], cwd=task,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "multi-turn episodes: environment task.py:Oracle" in proc.stdout
    metrics = [json.loads(x) for x in (task / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all("env_turn_reward_mean" in m for m in metrics)
    assert all(m["tool_calls"] > 0 for m in metrics)  # the environment answered the model's calls
    seen = [json.loads(x) for x in (task / "scored.jsonl").read_text().splitlines()]
    assert len(seen) == 2 * 4 * 2
    for s in seen:  # the reward saw the whole row and the episode the environment opened from it
        assert set(s["row"]) == {"prompt", "sum", "id", "answer"} and s["env"]["state"]["sum"] == s["row"]["sum"]
        assert s["env"]["state"]["tag"] == "mine" and s["env"]["state"]["user"] == s["row"]["prompt"]
        assert s["env"]["turn_rewards"] in ([], [float(s["text"].strip() == s["row"]["sum"])])
    summary = json.loads((task / "out" / "summary.json").read_text())
    assert summary["steps_run"] == 2
