"""Colocated mode through the main job (issue #34): every step the engine releases its memory, the
actor comes back, trains, offloads and the engine takes its memory back around the weight sync,
and the metrics are those of the same run with the engine and the actor apart (the main job's
short run of test_loop.py, made in this session on this machine; every key but the timings). A checkpoint written in colocated mode (the actor brought
back for it) resumes into the same steps. The settings that cannot work together are refused in
one line."""
import json
import shutil

import pytest

from tests.trainer.test_loop import MAIN_JOB_SHORT_RUN, _run, same_run

MEMORY = {"engine_release_s", "engine_resume_s", "actor_onload_s", "actor_offload_s", "actor_onload_gb",
          "actor_offload_gb"}


def _main_job(out, *overrides):
    # the main job's short run (tests/trainer/test_loop.py::test_main_job_short_run), colocated
    return _run(["examples/tiny_tepo/run.py", *MAIN_JOB_SHORT_RUN, f"train.output_dir={out}", "rollout.colocated=true",
                 *overrides, "--eval-size", "50"], 600, MTEPO_FAST_PATHS="0")


def test_colocated_main_job_equals_the_separate_run_and_resumes(tmp_path, main_job_short_run):
    separate = main_job_short_run[2]
    out = tmp_path / "run"
    _main_job(out, "train.save_every=3")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    same_run(lines, separate, MEMORY)
    for r in lines:
        assert set(r) >= MEMORY, r["step"]
        # everything the actor holds went out after the step and came back for the next one
        assert r["actor_offload_gb"] > 0 and r["actor_onload_gb"] > 0
    # after the first update Adam's moments exist: what comes back is what went out the step before
    assert [r["actor_onload_gb"] for r in lines[1:]] == [r["actor_offload_gb"] for r in lines[:-1]]

    # resume from step 3's checkpoint (written with the actor brought back from host memory)
    shutil.rmtree(out / "checkpoints" / "step_6")
    _main_job(out, "train.save_every=3")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    same_run(lines, separate, MEMORY)


@pytest.mark.parametrize("overrides, message", [
    ({"rollout": {"colocated": True, "max_staleness": 1}},
     "rollout.max_staleness: one-step-off generation needs the engine and the actor on the GPUs at once"),
    ({"actor": {"offload": "optimizer"}},
     "actor.offload: 'optimizer' moves the actor out of the GPUs while the engine generates, which only "
     "rollout.colocated does"),
])
def test_settings_that_cannot_work_together_are_refused(overrides, message):
    from megatron_tepo.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as err:
        from_dict(overrides)
    assert message in str(err.value)


def test_offload_levels_name_the_actors_parts():
    """Each choice once: the config's offload levels move the parts the train model knows."""
    from megatron_tepo.config import OFFLOAD_LEVELS, ActorConfig
    from megatron_tepo.megatron.model import OFFLOAD_PARTS

    assert set(OFFLOAD_LEVELS["all"]) == set(OFFLOAD_PARTS)
    assert all(set(parts) <= set(OFFLOAD_PARTS) for parts in OFFLOAD_LEVELS.values())
    assert ActorConfig().offload_parts(colocated=True) == OFFLOAD_PARTS
    assert ActorConfig().offload_parts(colocated=False) == ()
    assert ActorConfig(offload="optimizer_grads").offload_parts(colocated=True) == ("optimizer", "grads")


@pytest.mark.distributed
def test_the_engine_takes_its_memory_back_only_after_every_ranks_offload(tmp_path):
    """Issue #40 row 3: rank 1's offload takes 1.5 s; the driver resumes the servers' weights (and then
    their cache) only once it has returned, else the servers would take GPU memory that rank 1 is
    still freeing (the trainer's own phases, tests/trainer/memory_phases_worker.py)."""
    from tests.dist_utils import REPO, torchrun

    results = torchrun(REPO / "tests/trainer/memory_phases_worker.py", 2, json.dumps({"slow_s": 1.5}),
                       tmp_path=tmp_path, timeout=300)
    slow_done = results[1]["offload_done"]
    resumed = results[0]["resumed"]
    assert [tuple(tags) for tags, _ in resumed] == [("weights",), ("kv_cache", "cuda_graph")]
    assert all(started >= slow_done for _, started in resumed), (resumed, slow_done)
