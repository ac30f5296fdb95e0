"""The RL loop end to end on CPU: the main job learns, weight sync is exact, every ablation runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}


def _run(args, timeout, **env_overrides):
    env = dict(ENV, MASTER_PORT=str(20000 + os.getpid() % 20000), **env_overrides)
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


# The main job's short run, as the loop tests pin it (with the clip range TEPO had then: its default
# is GSPO's range since, docs/ALGORITHMS.md). MTEPO_FAST_PATHS=0 (set by the fixture): megatron-core's
# own grad norm, clipping and AdamW loop; the fast paths are checked against these paths in
# tests/megatron/test_launch_costs.py.
MAIN_JOB_SHORT_RUN = ("train.steps=6", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28")
TIMINGS = {"time", "step_s", "sync_s", "rollout_s", "train_s", "tokens_per_s"}


def same_run(lines, reference, extra=frozenset()):
    """Every metric of ``reference`` (the same steps on this machine) equals the run's, bar rounding
    in the last bits; the run logs nothing else but the timings and ``extra``."""
    assert [r["step"] for r in lines] == [r["step"] for r in reference]
    for new, old in zip(lines, reference, strict=True):
        same = {k: v for k, v in old.items() if k not in TIMINGS}
        assert {k: new[k] for k in same} == pytest.approx(same, rel=1e-6, abs=1e-9), new["step"]
        assert set(new) - set(old) <= set(extra), new["step"]


def test_main_job_short_run(main_job_short_run, tmp_path):
    out, proc, lines = main_job_short_run
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= {"accuracy_before", "accuracy_after", "improvement"}
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    for r in lines:
        # The engine sampled with the weights the actor had: after every sync the engine's
        # log-probs of its own samples equal the actor's recomputation (fp32, exact sync).
        assert r["drift_max"] < 1e-4, r
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["grad_norm"] > 0 and r["lr"] == pytest.approx(1e-4)
        assert r["groups_generated"] >= 16 and r["sampling_rounds"] >= 1 and r["rollout_staleness"] == 0.0
        # 16 groups of 8 kept, two updates of 8 prompts each
        assert r["updates"] == 2.0 and r["skipped_update"] == 0.0 and r["num_tokens"] > 0
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "held-out greedy accuracy: before" in proc.stdout
    # rollout.max_staleness: 0 (the default) is the plain synchronous loop: its metrics equal those of
    # the textbook loop written out in tests/trainer/reference_loop_worker.py, run here on the same
    # machine from the same warm-up (every metric the reference computes; floating point is
    # compared only between two runs on one machine, never with figures recorded on another)
    ref = tmp_path / "reference.jsonl"
    _run(["tests/trainer/reference_loop_worker.py", str(ref), *MAIN_JOB_SHORT_RUN, "--eval-size", "50"], 600,
         MTEPO_FAST_PATHS="0")
    reference = [json.loads(x) for x in ref.read_text().splitlines()]
    assert set(reference[0]) <= set(lines[0]) and len(reference[0]) > 20, sorted(reference[0])
    for new, old in zip(lines, reference, strict=True):
        assert {k: new[k] for k in old} == pytest.approx(old, rel=1e-6, abs=1e-9), new["step"]


def test_every_ablation_config_runs_through_the_loop(tmp_path):
    _run(["tests/trainer/ablations_worker.py", str(tmp_path / "r.json")], 600)
    results = json.loads((tmp_path / "r.json").read_text())
    nan, after = results.pop("_nan"), results.pop("_after_nan")
    correction, bypass, mismatch = results.pop("_correction"), results.pop("_old_from_rollout"), results.pop("_mismatch")
    one_step_off, stale_warnings = results.pop("_one_step_off"), results.pop("_one_step_off_warnings")
    # TEPO at its default range (0.01/0.014) trained one step off as well as on-policy: no warning
    assert stale_warnings == []
    # one-step-off: step 1 on-policy, then every batch one update older than the weights it trains
    assert [m["rollout_staleness"] for m in one_step_off] == [0.0, 1.0, 1.0]
    assert all(m["updates"] > 0 for m in one_step_off)
    fresh, stale = one_step_off[0], one_step_off[1:]
    assert fresh["drift_max"] < 1e-4 and fresh["rollout_mismatch_kl"] < 1e-9
    for m in stale:  # the engine's weights were one update behind: the correction measures it
        assert m["drift_max"] > 1e-4 and m["rollout_mismatch_kl"] > 1e-9 and m["rollout_is_weight"] != 1.0
    # rollout correction in the loop: with the exact sync, the geometric IS weights are ~1 and a
    # tight token rejection band rejects nothing; the metrics are logged and the update happens
    m = correction["metrics"]
    assert correction["moved"] and m["updates"] > 0
    assert m["rollout_is_weight"] == pytest.approx(1.0, abs=1e-3) and m["rollout_mismatch_kl"] < 1e-6
    assert m["rollout_rs_rejected"] == 0.0 and {"rollout_is_capped", "drift_max"} <= set(m)
    # the engine's log-probs as the old policy's: no actor pass, so no drift check; weights 1
    m = bypass["metrics"]
    assert bypass["moved"] and m["updates"] > 0 and "drift_max" not in m
    assert m["rollout_is_weight"] == 1.0 and m["rollout_mismatch_kl"] == 0.0
    # engine at T=0.7, actor at T=1: the token weights are p_1(y) / p_0.7(y), computed from the logits
    assert mismatch["tokens"] > 20 and mismatch["spread"] > 0.1
    assert mismatch["worst_rel_err"] < 1e-4
    assert nan["skipped"] == 1.0 and nan["unchanged"] and nan["loss"] != nan["loss"]  # NaN loss: no step
    assert after["skipped"] == 0.0 and after["finite"] and after["moved"]  # training goes on
    stems = {p.stem for p in (REPO / "examples" / "ablations").glob("[!_]*.yaml")}
    assert set(results) == stems
    for stem, r in results.items():
        assert r["skipped"] == 0.0, stem
        assert r["finite"], (stem, r)
        assert r["moved"], f"{stem}: the actor's weights did not change"
        assert r["drift_max"] < 1e-4, (stem, r["drift_max"])
    assert "clip_cov_frac" in results["table1_clip_cov"]["keys"]
    assert "kl_cov_frac" in results["table1_kl_cov"]["keys"]
    assert "steer_weight_mean" in results["table3_b_steel"]["keys"]


def test_main_job_says_why_a_step_made_no_update_and_still_evaluates(tmp_path):
    # one-token responses cannot hold a 2-3-digit sum: every group's rewards are 0, every step is
    # skipped (a collapsed run looks the same); the main job says so instead of failing on the
    # step's missing reward, and the held-out accuracy is still measured when it is due
    out = tmp_path / "run"
    proc = _run(["examples/tiny_tepo/run.py", "train.steps=2", "train.eval_every=2", "rollout.max_new_tokens=1",
                 "rollout.max_sampling_rounds=1", f"train.output_dir={out}", "--eval-size", "20"], 600)
    no_update = [line for line in proc.stdout.splitlines() if "NO UPDATE" in line]
    assert len(no_update) == 2 and all("every group had equal rewards" in line for line in no_update), proc.stdout
    assert "held-out accuracy" in no_update[1] and "held-out accuracy" not in no_update[0]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_step"], r["updates"]) for r in lines] == [(1, 1.0, 0.0), (2, 1.0, 0.0)]
    assert "eval_acc" not in lines[0] and 0.0 <= lines[1]["eval_acc"] <= 1.0


def test_a_sequence_ratio_loss_one_step_off_warns_only_above_the_measured_range():
    from megatron_tepo.config import AlgorithmConfig
    from megatron_tepo.algorithms import stale_sequence_ratio_warning

    wide = AlgorithmConfig(loss="tepo", clip_low=0.2, clip_high=0.28)
    msg = stale_sequence_ratio_warning(wide, 1)
    assert "algorithm.loss=tepo and clip 0.2/0.28" in msg and "rollout.max_staleness=1" in msg
    assert stale_sequence_ratio_warning(wide, 0) is None  # on-policy
    assert stale_sequence_ratio_warning(AlgorithmConfig(loss="tepo"), 1) is None  # the default, 0.01/0.014
    assert stale_sequence_ratio_warning(AlgorithmConfig(loss="tepo", clip_low=3e-4, clip_high=4e-4), 1) is None
    assert stale_sequence_ratio_warning(AlgorithmConfig(loss="tepo", clip_high=0.02), 1) is not None
    assert stale_sequence_ratio_warning(AlgorithmConfig(loss="grpo", clip_low=0.2, clip_high=0.28), 1) is None
