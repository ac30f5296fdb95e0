"""A run with asynchronous checkpoint saves (``train.async_save``, the default) gives the metrics of the
same run with synchronous saves, step for step, and leaves the same complete checkpoints (issue #32
row 8): the saves capture the state at their step, whatever the steps after them change while the
files are written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.megatron.helpers import ASYNC_WRITERS, async_writer_missing, writer_env

REPO = Path(__file__).resolve().parents[2]
VOLATILE = {"time", "step_s", "sync_s", "rollout_s", "train_s", "tokens_per_s"}


def _run(out, async_save, port, writer="mcore"):
    cmd = [sys.executable, str(REPO / "examples/tiny_tepo/run.py"), "train.steps=6", "train.save_every=2",
           "train.keep_checkpoints=2", f"train.async_save={str(async_save).lower()}", f"train.output_dir={out}",
           "--eval-size", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(port),
           **writer_env(writer)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [{k: v for k, v in json.loads(line).items() if k not in VOLATILE}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    ckpts = out / "checkpoints"
    listing = sorted(p.name for p in ckpts.iterdir())
    extra = {name: json.loads((ckpts / name / "extra_state.json").read_text()) for name in listing}
    return metrics, listing, extra


@pytest.mark.slow
@pytest.mark.journey  # (whole main-job runs: the second lane, tools/test.sh)
@pytest.mark.parametrize("writer", ASYNC_WRITERS)
def test_async_saves_give_the_metrics_of_synchronous_saves(tmp_path, writer):
    """On each writer that runs here (NVRx's where nvidia-resiliency-ext is installed)."""
    if async_writer_missing(writer):
        pytest.skip(async_writer_missing(writer))
    port = 24000 + os.getpid() % 5000
    sync = _run(tmp_path / "sync", False, port)
    asyn = _run(tmp_path / "async", True, port + 1, writer)
    assert [m["step"] for m in asyn[0]] == list(range(1, 7))
    assert asyn[0] == sync[0]  # every metric of every step, bit for bit
    assert asyn[1] == sync[1] == ["step_4", "step_6"]  # complete, no temporary directory left
    assert asyn[2] == sync[2]  # the loop's state saved with each


def test_a_checkpoint_is_published_before_the_next_steps_first_update(tmp_path):
    """The write of step k's asynchronous checkpoint overlaps step k+1's generation and old
    log-probs, and is complete and published (a blocking finalize, every rank) before step k+1's
    first update: a run that hangs or dies in step k+1 resumes from step k (the Slurm hang test
    resumes at the step it hung in). A fake actor that records the order of its calls."""
    from megatron_tepo.config import from_dict
    from megatron_tepo.trainer.loop import train
    from tests.trainer.test_no_update_stop import EchoEngine, NanActor, _task

    class Recorder(NanActor):
        def __init__(self):
            super().__init__(finite=set(range(1, 100)))
            self.events = []

        def forward_backward(self, batch, loss):
            self.events.append("update")
            return super().forward_backward(batch, loss)

        def save_checkpoint(self, directory, extra_state=None, write_extra=None, asynchronous=False, on_publish=None):
            self.events.append(f"save {Path(directory).name} async={asynchronous}")

        def finalize_checkpoints(self, blocking=False):
            self.events.append(f"finalize blocking={blocking}")

    cfg = from_dict({"rollout": {"prompts_per_step": 2, "n_samples": 2, "max_sampling_rounds": 1},
                     "algorithm": {"old_log_prob": "rollout"},
                     "train": {"steps": 3, "mini_batch_prompts": 2, "epochs_per_step": 1, "save_every": 1},
                     "fault": {"watchdog_generate_s": 0, "watchdog_collective_s": 0, "watchdog_sync_s": 0}})
    actor = Recorder()
    train(cfg, actor, EchoEngine(), _task(lambda r: float(r[1] == 0)), checkpoint_root=tmp_path)
    events = actor.events
    saves = [i for i, e in enumerate(events) if e.startswith("save")]
    assert [events[i] for i in saves] == [f"save step_{k} async=True" for k in (1, 2, 3)]
    for i in saves[:-1]:
        nxt = events.index("update", i)
        assert "finalize blocking=True" in events[i:nxt], events[i:nxt + 1]
    assert events[-1] == "finalize blocking=True"  # the last one complete before train() returns
