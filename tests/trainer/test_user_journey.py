"""From a prompt file to a trained, exported, evaluated model, as a user runs it: ``tools/train.py``
with the documented command and no save setting, then the exported folder, ``tools/evaluate.py``
on it and ``tools/convert_megatron_to_hf.py`` on a trainer checkpoint; and what happens when the
same command runs again: resume, changed settings, damaged checkpoints, interrupted saves, a run
that trains nothing."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_utils import REPO

pytestmark = [pytest.mark.slow, pytest.mark.journey]  # each test starts the trainer (10-20 s) a few times


def train(tiny, out, *extra, expect=0, env=None):
    """The README's command: a method file, the model, the prompt file, the output folder."""
    cmd = [sys.executable, str(REPO / "tools/train.py"), "--config", str(REPO / "examples/tiny_tepo/sizes.yaml"),
           f"model.path={tiny / 'model'}", f"data.train_files=[{tiny / 'train.jsonl'}]", "reward.kind=exact_match",
           f"train.output_dir={out}", "rollout.prompts_per_step=8", "train.mini_batch_prompts=4", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def steps(out):
    return [json.loads(x)["step"] for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_prompt_file_to_exported_and_evaluated_model(tiny, tmp_path):
    out = tmp_path / "run"
    train(tiny, out, "train.steps=3")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exported_hf"] == str((out / "hf").absolute()) and summary["updates"] > 0
    assert summary["last_checkpoint"].endswith("step_3")  # the last step is saved without asking
    hf = out / "hf"
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= {p.name for p in hf.iterdir()}
    # the exported model scores tokens as the trained actor does (its last checkpoint), and a trainer
    # checkpoint converts to the same files
    from tests.dist_utils import torchrun

    (r,) = torchrun(Path(__file__).with_name("export_worker.py"), 1,
                    json.dumps({"model": str(tiny / "model"), "checkpoint": str(out / "checkpoints" / "step_3"),
                                "hf": str(hf), "prompts": str(tiny / "eval.jsonl")}), tmp_path=tmp_path)
    assert r["tokens"] > 100 and r["max_abs_diff"] <= 1e-5, r
    assert r["moved_from_start"] > 1e-4  # it is the trained policy, not the start
    conv = subprocess.run([sys.executable, str(REPO / "tools/convert_megatron_to_hf.py"), "--megatron",
                           str(out / "checkpoints" / "step_3"), "--out", str(tmp_path / "converted"), "--quiet"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert conv.returncode == 0, conv.stderr[-2000:]
    from safetensors.torch import load_file
    import torch

    a = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    b = {k: v for f in (tmp_path / "converted").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # evaluate.py on the exported folder, the trainer's exact-match reward, into a new folder
    report = tmp_path / "eval" / "x" / "report.json"
    ev = subprocess.run([sys.executable, str(REPO / "tools/evaluate.py"), "--model", str(hf), "--file",
                         str(tiny / "eval.jsonl"), "--reward", "exact_match", "--max-new-tokens", "4", "--out",
                         str(report)], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ev.returncode == 0, ev.stderr[-2000:]
    (res,) = json.loads(report.read_text()).values()
    assert res["num_prompts"] == 40 and res["avg@1"] > 0.2  # the warmed-up adder gets about half right


@pytest.mark.second_lane  # (about 100 s: the third lane has none to spare, tools/test.sh)
def test_same_command_resumes_and_refuses_changed_settings(tiny, tmp_path):
    out = tmp_path / "run"
    assert "[train] starting at step 1" in train(tiny, out, "train.steps=2").stdout
    train(tiny, out, "train.steps=2")  # again: already done, nothing repeated
    assert steps(out) == [1, 2]
    proc = train(tiny, out, "train.steps=4", "optim.lr=0.1", "algorithm.loss=grpo", expect=2)
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "optim.lr 0.0001 -> 0.1" in err[0] and "algorithm.loss 'tepo' -> 'grpo'" in err[0]
    assert "train.allow_config_change=true" in err[0]
    assert "lr: 0.0001" in (out / "config.yaml").read_text()  # it still tells what ran
    proc = train(tiny, out, "train.steps=3", "train.save_every=1")  # longer, other interval: allowed
    assert "resumed from" in proc.stdout and steps(out) == [1, 2, 3]
    train(tiny, out, "train.steps=4", "optim.lr=0.0003", "train.allow_config_change=true")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert lines[-1]["lr"] == pytest.approx(3e-4) and lines[-2]["lr"] == pytest.approx(1e-4)  # really used
    assert "lr: 0.0003" in (out / "config.yaml").read_text()
    proc = train(tiny, out, "train.steps=5", "train.resume=false", expect=2)
    assert "holds checkpoints of an earlier run" in proc.stderr


def test_a_run_folder_moved_elsewhere_resumes_from_its_new_place(tiny, tmp_path):
    old, new = tmp_path / "run", tmp_path / "elsewhere" / "moved"
    train(tiny, old, "train.steps=2")
    shutil.copytree(old, new)
    shutil.rmtree(old)  # nothing may be read from the old place
    proc = train(tiny, new, "train.steps=3")
    assert f"resumed from {new / 'checkpoints' / 'step_2'}: continuing at step 3" in proc.stdout
    assert steps(new) == [1, 2, 3] and not old.exists()
    assert f"output_dir: {new}" in (new / "config.yaml").read_text()


def test_a_short_run_prints_no_library_warning_a_user_can_do_nothing_about(tiny, tmp_path):
    """No TE / Apex fall-back notices, no deprecations of megatron-core's own defaults or of the
    PyTorch calls its checkpoint loader makes -- and a warning about the run's settings still shows."""
    from megatron_tepo import KNOWN_LIBRARY_WARNINGS

    known = [re.compile(message) for message, *_ in KNOWN_LIBRARY_WARNINGS] + [re.compile("full scope is deprecated")]
    stale = ["rollout.max_staleness=1", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28"]  # warned about
    for steps_ in (1, 2):  # the second resumes: a checkpoint loads
        proc = train(tiny, tmp_path / "run", f"train.steps={steps_}", *stale)
        lines = (proc.stdout + proc.stderr).splitlines()
        assert [line for line in lines if any(k.search(line) for k in known)] == [], proc.stderr
        assert sum("RuntimeWarning: rollout.max_staleness=1 with algorithm.loss=tepo" in line for line in lines) == 1
    assert "resumed from" in proc.stdout


def test_no_duplicate_steps_after_a_run_died_before_its_first_checkpoint(tiny, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": 0.0}) + "\n" for s in (1, 2, 3)))
    train(tiny, out, "train.steps=2")
    assert steps(out) == [1, 2]


def test_damaged_newest_checkpoint_falls_back_and_stale_temporaries_go(tiny, tmp_path):
    out = tmp_path / "run"
    proc = train(tiny, out, "train.steps=2", "train.save_every=1")
    assert "incomplete / corrupted" not in proc.stdout + proc.stderr  # megatron-core's warning on a non-empty dir
    ckpts = out / "checkpoints"
    victim = sorted((ckpts / "step_2").glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    stale = ckpts / "step_3.tmp-4242-deadbeef"
    stale.mkdir()
    proc = train(tiny, out, "train.steps=3", "train.save_every=1")
    damaged = [line for line in proc.stdout.splitlines() if "is damaged, not resuming" in line]
    assert len(damaged) == 1 and str(victim) in damaged[0] and "truncated" in damaged[0]
    assert f"resumed from {ckpts / 'step_1'}" in proc.stdout
    assert not stale.exists() and steps(out) == [1, 2, 3]
    (ckpts / "step_3" / "metadata.json").unlink()  # a missing file: named too
    (ckpts / "step_2" / ".metadata").unlink()
    proc = train(tiny, out, "train.steps=4", "train.save_every=1")
    assert "step_3/metadata.json: missing" in proc.stdout and "step_2/.metadata: missing" in proc.stdout
    assert steps(out) == [1, 2, 3, 4]


def test_a_run_that_trains_nothing_says_why_and_fails(tiny, tmp_path):
    # math_verify on answers without \boxed{}: every group has reward 0, every step is skipped
    # (a skipped step is still evaluated when one is due: a collapsed run's accuracy is measured)
    proc = train(tiny, tmp_path / "run", "train.steps=2", "reward.kind=math_verify", "reward.workers=1",
                 f"data.eval_files=[{tiny / 'eval.jsonl'}]", "train.eval_every=2", expect=3)
    no_update = [line for line in proc.stdout.splitlines() if "NO UPDATE" in line]
    assert len(no_update) == 2 and all("had no \\boxed{} answer" in line for line in no_update)
    assert "no update in 2 step(s)" in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["updates"] == 0 and summary["steps_without_update"] == 2 and summary["reward_no_answer"] > 0
    m = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in m] == [1, 2] and all(x["skipped_step"] == 1.0 and not math.isnan(x["updates"]) for x in m)
    assert "eval/avg@1" not in m[0] and m[1]["eval/avg@1"] == 0.0  # math_verify: no boxed answer, reward 0


def test_a_run_that_stops_updating_stops_early_and_forbids_a_requeue(tiny, tmp_path):
    # 400 steps asked, none can update (no \boxed{} answer: equal rewards): it stops after
    # fault.max_steps_without_update steps, exit 3, and tells the Slurm job not to requeue
    reason = tmp_path / "exit_reason.json"
    proc = train(tiny, tmp_path / "run", "train.steps=400", "reward.kind=math_verify", "reward.workers=1",
                 "rollout.max_sampling_rounds=1", "fault.max_steps_without_update=2", expect=3,
                 env={"TEPO_EXIT_REASON_FILE": str(reason)})
    assert "no policy update for 2 steps in a row (steps 1-2, fault.max_steps_without_update=2)" in proc.stderr
    assert "had no \\boxed{} answer" in proc.stderr
    assert steps(tmp_path / "run") == [1, 2]
    written = json.loads(reason.read_text())
    assert written["reason"] == "no_update" and written["requeue"] is False and "2 steps in a row" in written["message"]
    bad = train(tiny, tmp_path / "bad", "train.steps=0", expect=2, env={"TEPO_EXIT_REASON_FILE": str(reason)})
    assert "train.steps" in bad.stderr
    written = json.loads(reason.read_text())
    assert written["reason"] == "user_error" and written["requeue"] is False


def test_user_errors_are_one_line(tiny, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: [1e-4\n")
    proc = subprocess.run([sys.executable, str(REPO / "tools/train.py"), "--config", str(bad)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and f"{bad}:3:1: invalid YAML" in err[0], proc.stderr
    proc = train(tiny, tmp_path / "r", "model.path=/nonexistent", expect=2)
    assert "model.path: /nonexistent is not a Hugging Face model folder" in proc.stderr
    proc = train(tiny, tmp_path / "r", "train.stepz=3", expect=2)
    assert "train.stepz" in proc.stderr and "did you mean steps" in proc.stderr
    shutil.rmtree(tmp_path / "r", ignore_errors=True)


def test_kill_9_of_the_trainer_leaves_nothing_running(tiny, tmp_path):
    import signal

    from tests.rewards.test_math_reward import _alive, _descendants

    cmd = [sys.executable, str(REPO / "tools/train.py"), "--config", str(REPO / "examples/tiny_tepo/sizes.yaml"),
           f"model.path={tiny / 'model'}", f"data.train_files=[{tiny / 'train.jsonl'}]", "reward.workers=2",
           f"train.output_dir={tmp_path / 'run'}", "train.steps=50"]  # math-verify: the reward pool runs
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:
            if line.startswith("[step 1/50]"):
                break
        family = _descendants(proc.pid)
        assert len(family) >= 3, family  # two reward workers and multiprocessing's resource tracker
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in family if _alive(p)]
