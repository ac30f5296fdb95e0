"""The one choice of the asynchronous checkpoint saves' writer (issue #45 point 2,
``megatron_tepo/megatron/async_save.py:choose_async_writer``, called here through the actor's
``megatron_tepo/actor/checkpointing.py:choose_async_writer``, which refuses with a CheckpointError):
NVRx's where megatron-core's ``dist_checkpointing.save`` takes ``async_strategy`` and
nvidia-resiliency-ext is there, megatron-core's own elsewhere, with the reason said once; and how the tensors reach the writer (#50 row 2: never
GPU tensors of expandable segments by CUDA IPC). (Both writers' saves, resumes and kills:
``test_async_save.py``, ``test_actor_checkpoint.py``, ``tests/trainer/test_async_save_run.py``.)"""
import pytest

from megatron_tepo.checkpoint.store import CheckpointError


def save_0_16(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
              validate_access_integrity=True, async_sharded_save=False, preprocess_common_before_consistancy_check=None,
              content_metadata=None):
    """megatron-core 0.16.1's signature: no async_strategy."""


def save_0_19(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
              validate_access_integrity=True, async_sharded_save=False, preprocess_common_before_consistancy_check=None,
              content_metadata=None, async_strategy="nvrx"):
    """megatron-core 0.19's: async_strategy, "nvrx" by default."""


def test_nvrx_where_megatron_core_takes_it_and_nvrx_is_there(monkeypatch):
    from megatron_tepo.actor.checkpointing import choose_async_writer

    monkeypatch.delenv("MTEPO_ASYNC_WRITER", raising=False)
    w = choose_async_writer(save_0_19, nvrx_version="0.7.0", on_gpu=False)
    assert (w.name, w.save_kwargs) == ("nvrx", {"async_sharded_save": True, "async_strategy": "nvrx"})
    assert (w.why, w.staging) == ("nvidia-resiliency-ext 0.7.0; no CUDA", "host_copy")


def test_megatron_cores_own_writer_elsewhere(monkeypatch):
    from megatron_tepo.actor.checkpointing import choose_async_writer

    monkeypatch.delenv("MTEPO_ASYNC_WRITER", raising=False)
    w = choose_async_writer(save_0_19, nvrx_version=None)  # 0.19 without NVRx: its own writer, asked for by name
    assert (w.name, w.save_kwargs) == ("mcore", {"async_sharded_save": True, "async_strategy": "mcore"})
    assert "nvidia-resiliency-ext >= 0.6 is not installed" in w.why
    w = choose_async_writer(save_0_16, nvrx_version="0.7.0")  # 0.16.1: no choice, NVRx or not
    assert (w.name, w.save_kwargs) == ("mcore", {"async_sharded_save": True})
    assert "has no async_strategy" in w.why
    w = choose_async_writer(save_0_19, nvrx_version="0.7.0", wanted="mcore")
    assert (w.name, w.save_kwargs["async_strategy"], w.why) == ("mcore", "mcore", "MTEPO_ASYNC_WRITER=mcore")


def test_nvrx_asked_for_where_it_cannot_run_says_why(monkeypatch):
    from megatron_tepo.actor.checkpointing import choose_async_writer

    with pytest.raises(CheckpointError, match="NVRx's writer cannot be had here: nvidia-resiliency-ext >= 0.6"):
        choose_async_writer(save_0_19, nvrx_version=None, wanted="nvrx")
    with pytest.raises(CheckpointError, match="has no async_strategy"):
        choose_async_writer(save_0_16, nvrx_version="0.7.0", wanted="nvrx")
    monkeypatch.setenv("MTEPO_ASYNC_WRITER", "fast")
    with pytest.raises(CheckpointError, match="expected auto, mcore or nvrx"):
        choose_async_writer(save_0_19, nvrx_version=None)


def test_the_installed_stack_gets_the_writer_it_can_run(monkeypatch):
    """On this stack: NVRx's exactly where the tests' own reading of the installed versions says
    it runs (megatron-core >= 0.19 and nvidia-resiliency-ext >= 0.6), megatron-core's otherwise."""
    from megatron_tepo.actor.checkpointing import choose_async_writer
    from tests.megatron import helpers
    from tests.megatron.helpers import async_writer_missing

    monkeypatch.delenv("MTEPO_ASYNC_WRITER", raising=False)
    monkeypatch.setattr(helpers, "NVRX_PATH", "")  # this process: the stack as installed, no unpacked NVRx
    assert choose_async_writer().name == ("mcore" if async_writer_missing("nvrx") else "nvrx")


@pytest.mark.parametrize("expandable,host_shm,want", [
    (True, True, ("nvrx", "host_shm", True)),      # the trainer's allocator: staged in host shared memory
    (True, False, ("mcore", "host_copy", False)),  # ... where this stack cannot: megatron-core's own writer
    (False, True, ("nvrx", "cuda_ipc", False)),    # ordinary segments: NVRx's CUDA IPC
])
def test_the_strategy_that_reaches_the_writer_for_each_allocator_setting(monkeypatch, expandable, host_shm, want):
    """#50 row 2: on a GPU, GPU tensors in expandable segments never go to NVRx's writer by CUDA IPC
    (its pidfd_getfd is refused in containers without ptrace: the first save of a 14B run failed).
    ``want``: the writer, its staging, and whether megatron-core's save gets a strategy with
    ``cpu_shm_mode`` (which hands NVRx's writer ``use_cpu_shm_for_gpu_tensors``)."""
    from megatron_tepo.actor.checkpointing import choose_async_writer
    from megatron_tepo.megatron.async_save import mcore_has_cpu_shm_mode

    if want[2] and not mcore_has_cpu_shm_mode():
        pytest.skip("this megatron-core (< 0.19.2) has no cpu_shm_mode: the host-shm strategy cannot be built, and "
                    "the choice never claims it here (_nvrx_stages_in_host_memory is False)")
    monkeypatch.delenv("MTEPO_ASYNC_WRITER", raising=False)
    w = choose_async_writer(save_0_19, nvrx_version="0.7.0", expandable=expandable, host_shm=host_shm, on_gpu=True)
    strategy = w.save_kwargs.get("sharded_strategy")
    assert (w.name, w.staging, bool(strategy is not None and strategy.cpu_shm_mode)) == want
    if want[0] == "mcore":
        assert w.save_kwargs["async_strategy"] == "mcore" and "pytorch#165685" in w.why
    # megatron-core's own writer, asked for: host copies whatever the allocator
    m = choose_async_writer(save_0_19, nvrx_version="0.7.0", wanted="mcore", expandable=expandable, on_gpu=True)
    assert (m.name, m.staging) == ("mcore", "host_copy")


@pytest.mark.timeout(300)
def test_an_nvrx_save_staged_in_host_shared_memory_writes_a_checkpoint_that_loads(tmp_path):
    """The host-shm path for real (NVRx 0.7's writer, megatron-core 0.19.2's strategy; on CPU, the
    choice forced as on a GPU with expandable segments): the writer is built with
    ``use_cpu_shm_for_gpu_tensors=True``, the save is published, and a fresh actor loads it bit for bit."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.megatron.helpers import async_writer_missing, writer_env

    if async_writer_missing("nvrx"):
        pytest.skip(async_writer_missing("nvrx"))
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", **writer_env("nvrx"))
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "workers" / "async_staging_worker.py"),
                           str(tmp_path)], env=env, cwd=repo, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "staging.json").read_text())
    assert r["writer"] == ["nvrx", "host_shm"]
    assert r["writer_kwargs"] == [{"use_cpu_shm_for_gpu_tensors": True}], r
    assert r["published"] and r["params_equal"]
