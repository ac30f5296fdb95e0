"""Checkpoints of the Megatron actor (megatron_tepo/actor/checkpointing.py; folders and markers:
megatron_tepo/checkpoint/store.py).

* resume is bit-exact: save at step 2, a FRESH actor (other init seed) loads it, and its step 3
  equals the uninterrupted step 3 (every parameter ``torch.equal``, loss / grad norm / lr equal);
  the RNGs (torch, python, numpy, megatron's tracker) continue where they were at the save.
  Single process; TP=2 (plain optimizer); DP=2 with the distributed optimizer.
* the same in bf16 (bf16 parameters, fp32 main parameters and Adam states in the optimizer; the
  main parameters are compared too): TP=2 with the plain optimizer, DP=2 with the distributed one.
* the model part of the TP=2 checkpoint loads at TP=1 (model_only) bit-exactly; a full load at
  another layout is refused.
* partial checkpoints: a ``step_N`` without the ``complete`` marker and a ``*.tmp-*`` directory
  are ignored by ``find_latest_checkpoint`` and refused by ``load_checkpoint``.
"""
import json
import os
from pathlib import Path

import pytest

from megatron_tepo.checkpoint.store import (
    COMPLETE_MARKER,
    CheckpointError,
    find_latest_checkpoint,
    list_complete_checkpoints,
    prune_checkpoints,
    read_marker,
)
from tests.dist_utils import REPO, torchrun
from tests.megatron.helpers import ASYNC_WRITERS, async_writer_missing, writer_env

WORKER = Path(__file__).parent / "workers" / "checkpoint_worker.py"


def _run(cases, nproc, tmp_path):
    root = tmp_path / "ckpts"
    # (NVRx's code on the workers' path where a case asks for its writer: each case forces its own)
    extra = writer_env("nvrx").get("PYTHONPATH") if any(c.get("writer") == "nvrx" for c in cases) else None
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), extra])} if extra else None
    results = torchrun(WORKER, nproc, str(root), json.dumps(cases), tmp_path=tmp_path, timeout=380, env=env)
    return [r["cases"] for r in results]


def _check_resume(c, where):
    assert c["listing"] == ["step_2"], (where, c["listing"])  # no tmp dir left behind
    assert c["differs_before_load"], where
    assert c["extra_state"] == {"step": 2, "data_position": 16}, where
    assert c["params_equal"], (where, c["max_param_diff"])
    assert c["main_params_equal"], where
    assert c["step3_a"] == c["step3_b"], where  # loss, grad norm, lr: exactly equal
    assert c["rand_equal"] and c["python_numpy_equal"], where
    assert c["tracker_equal"] and "model-parallel-rng" in c["tracker_names"], where


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_resume_single_process_and_partial_checkpoints(tmp_path):
    (c,) = _run([{"tp": 1, "partial_checks": True}], 1, tmp_path)[0]
    _check_resume(c, "tp1")
    assert c["latest"].endswith("step_2")
    assert "step_7" in c["refused"]["step_7"] and "no 'complete' marker" in c["refused"]["step_7"]
    tmp_name = "step_9.tmp-1234-deadbeef"
    assert c["refused"][tmp_name] and tmp_name in c["refused"][tmp_name]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_resume_tp2_and_dp2_distributed_optimizer(tmp_path):
    # the asynchronous save on each of its writers that runs here (NVRx's where it is installed)
    writers = [w for w in ASYNC_WRITERS if not async_writer_missing(w)]
    per_rank = _run([{"tp": 2, "reshard_to_tp1": True}, {"tp": 1, "dist_opt": True},
                     {"tp": 2, "precision": "bf16"}, {"tp": 1, "dist_opt": True, "precision": "bf16"}]
                    + [{"tp": 2, "precision": "bf16", "async": True, "writer": w} for w in writers], 2, tmp_path)
    for rank, (tp2, dp2, tp2_bf16, dp2_bf16, *tp2_asyncs) in enumerate(per_rank):
        # an asynchronous save (issue #32 row 8): not published when save_checkpoint returns, written
        # while step 3 trains (its weights change under the writer), then resumed bit for bit
        assert [c["writer"] for c in tp2_asyncs] == writers, rank
        for tp2_async in tp2_asyncs:
            _check_resume(tp2_async, f"rank {rank} tp2 bf16 asynchronous save, {tp2_async['writer']} writer")
            assert tp2_async["published_at_return"] is False and tp2["published_at_return"] is True, rank
        _check_resume(tp2, f"rank {rank} tp2")
        _check_resume(dp2, f"rank {rank} dp2 distributed optimizer")
        _check_resume(tp2_bf16, f"rank {rank} tp2 bf16")
        _check_resume(dp2_bf16, f"rank {rank} dp2 bf16 distributed optimizer")
        assert dp2["dp"] == 2 and tp2["dp"] == 1
        assert tp2["dtypes"] == tp2["main_dtypes"] == ["torch.float32"]
        for c in (tp2_bf16, dp2_bf16):
            assert c["dtypes"] == ["torch.bfloat16"] and c["main_dtypes"] == ["torch.float32"], rank
        # TP=2 checkpoint -> TP=1 actor, model weights only
        assert tp2["reshard_tp"] == 1 and tp2["reshard_equal"], rank
        assert tp2["reshard_extra_state"] == {"step": 2, "data_position": 16}
        assert "model_only=True" in tp2["full_load_other_layout"], rank


@pytest.mark.distributed
@pytest.mark.second_lane
@pytest.mark.timeout(400)
def test_resume_cp2_and_its_weights_at_cp1(tmp_path):
    """Context parallelism (#44): a CP=2 actor (its two ranks one replica) resumes bit-exact, with
    the distributed optimizer sharding its state over the CP ranks too; a full load at CP=1 is
    refused naming model_only, and the weights alone load at CP=1 equal to the saved ones."""
    per_rank = _run([{"cp": 2, "reshard_to_tp1": True}, {"cp": 2, "dist_opt": True}], 2, tmp_path)
    for rank, (cp2, cp2_dist_opt) in enumerate(per_rank):
        _check_resume(cp2, f"rank {rank} cp2")
        _check_resume(cp2_dist_opt, f"rank {rank} cp2 distributed optimizer")
        assert cp2["dp"] == 1 and cp2_dist_opt["dp"] == 1
        assert "model_only=True" in cp2["full_load_other_layout"], rank
        assert cp2["reshard_equal"] and cp2["reshard_extra_state"] == {"step": 2, "data_position": 16}, rank


def _fake_ckpt(root: Path, name: str, marker: bool) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "metadata.json").write_text("{}")
    if marker:
        (d / COMPLETE_MARKER).write_text(json.dumps({"format": "megatron_tepo.actor_checkpoint/1",
                                                      "step": int(name.split("_")[1].split(".")[0]),
                                                      "time": 0.0, "layout": {}}))
    return d


def test_find_latest_ignores_partial_and_prune(tmp_path):
    assert find_latest_checkpoint(tmp_path / "missing") is None
    assert find_latest_checkpoint(tmp_path) is None
    for n in (2, 10, 4):
        _fake_ckpt(tmp_path, f"step_{n}", marker=True)
    _fake_ckpt(tmp_path, "step_12", marker=False)  # a save that died before the marker
    _fake_ckpt(tmp_path, "step_11.tmp-99-abc", marker=True)  # never renamed
    (tmp_path / "notes").mkdir()
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_10"  # numeric, not lexical order
    assert [d.name for d in list_complete_checkpoints(tmp_path)] == ["step_2", "step_4", "step_10"]
    assert read_marker(tmp_path / "step_4")["step"] == 4
    with pytest.raises(CheckpointError, match="step_12"):
        read_marker(tmp_path / "step_12")
    with pytest.raises(CheckpointError, match="temporary"):
        read_marker(tmp_path / "step_11.tmp-99-abc")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_marker(tmp_path / "step_99")

    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert [d.name for d in removed] == ["step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_10", "step_11.tmp-99-abc",
                                                          "step_12", "step_4"]
    prune_checkpoints(tmp_path, keep_last=1, remove_partial=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_10"]
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, keep_last=0)


def test_the_checkpoint_layout_is_read_from_the_train_model():
    """The checkpointing code takes the train model it saves (its parallel state and settings) and
    the optimizer's config, not the actor: a stand-in with only those answers."""
    import types

    from megatron_tepo.actor.checkpointing import actor_layout
    from megatron_tepo.config import ActorConfig, OptimConfig

    ps = types.SimpleNamespace(**{f"get_{n}_world_size": (lambda v: lambda: v)(v) for n, v in (
        ("tensor_model_parallel", 2), ("pipeline_model_parallel", 1), ("expert_model_parallel", 1),
        ("data_parallel", 2))})
    train_model = types.SimpleNamespace(_ps=ps, settings=ActorConfig(precision="bf16", model_builder="gpt"))
    assert actor_layout(train_model, OptimConfig(use_distributed_optimizer=True)) == {
        "world_size": 1, "tp": 2, "pp": 1, "ep": 1, "dp": 2, "distributed_optimizer": True, "precision": "bf16",
        "model_builder": "gpt"}
