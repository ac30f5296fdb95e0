"""Metrics JSONL: non-finite values, torn last line, truncation on resume, and the plot tool."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tepo.metrics import MetricsLogger, read_metrics

REPO = Path(__file__).resolve().parents[1]


def test_log_read_nan_and_torn_line(tmp_path):
    log = MetricsLogger(tmp_path / "m.jsonl")
    log.log(1, {"reward_mean": 0.5, "grad_norm": float("nan")})
    log.log(2, {"reward_mean": 0.75})
    log.close()
    with (tmp_path / "m.jsonl").open("a") as fh:
        fh.write('{"step": 3, "rew')  # killed mid-write
    recs = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["grad_norm"] is None and recs[1]["reward_mean"] == 0.75


def test_malformed_middle_line_names_it(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2: not a JSON line"):
        read_metrics(tmp_path / "m.jsonl")


def test_truncate_after_resume_point(tmp_path):
    log = MetricsLogger(tmp_path / "m.jsonl")
    for s in range(1, 6):
        log.log(s, {"x": s})
    assert log.truncate_after(3) == 3
    log.log(4, {"x": 40})
    log.close()
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "m.jsonl")] == [(1, 1), (2, 2), (3, 3), (4, 40)]


def test_plot_tool_writes_png(tmp_path):
    log = MetricsLogger(tmp_path / "run" / "metrics.jsonl")
    for s in range(1, 8):
        log.log(s, {"reward_mean": s / 10, "entropy": 1 / s, "clip_frac": 0.01 * s, "grad_norm": 1.0,
                    "kl_mask_frac": 0.1, "quad_pos_adv_dec_ent": 0.3, "quad_neg_adv_inc_ent": 0.2,
                    "response_length_mean": 20 + s})
    log.close()
    out = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plot_metrics.py"), "--log",
                           str(tmp_path / "run" / "metrics.jsonl"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "plot_metrics.py"), "--log",
                          str(tmp_path / "missing.jsonl"), "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and "missing.jsonl: no such file" in bad.stderr


def test_tensorboard_mirror(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path / "m.jsonl", tensorboard_dir=str(tmp_path / "tb"))
    for s in range(1, 4):
        log.log(s, {"reward_mean": s / 4, "note": "text is not a scalar"})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "note" not in acc.Tags()["scalars"]


def test_the_plot_draws_only_the_panels_a_run_has_data_for(tmp_path):
    """The main job's metrics (one-turn, synchronous) draw no episode or partial-rollout panel (the
    main job's plot used to show 8 empty "no data" panels of 16); a log with episode metrics draws
    those too; a log with nothing plotted still makes a picture."""
    from megatron_tepo.commands.plot_metrics import PANELS, panels_with_data, plot

    one_turn = [{"step": s, "reward_mean": 0.5, "entropy": 1.0, "grad_norm": 1.0} for s in (1, 2)]
    assert [t for t, _, _ in panels_with_data([one_turn])] == ["reward", "entropy", "gradient norm"]
    episodes = [{**r, "episode_turns_mean": 2.0, "tool_calls": 3} for r in one_turn]
    titles = [t for t, _, _ in panels_with_data([one_turn, episodes])]
    assert "turns and tool calls" in titles and "tool calls, errors and time-outs" in titles
    assert "partial rollout" not in titles and "template comparator" not in titles
    assert panels_with_data([[{"step": 1, "note": "x"}]]) == PANELS[:1]
    log = tmp_path / "m.jsonl"
    log.write_text('{"step": 1, "reward_mean": 0.5}\n')
    assert plot([str(log)], ["run"], tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
