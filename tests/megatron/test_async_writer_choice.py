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


def _statvfs(free_bytes):
    """An ``os.statvfs`` stand-in: ``free_bytes`` available to an unprivileged writer."""
    import os

    def statvfs(path):
        assert path == "/dev/shm", path
        return os.statvfs_result((4096, 4096, 1 << 20, free_bytes // 4096, free_bytes // 4096, 0, 0, 0, 0, 255))
    return statvfs


def test_host_shm_staging_needs_room_in_dev_shm(monkeypatch):
    """Issue #56 row 9: NVRx's host-shm staging copies a save's GPU tensors into /dev/shm, which plain
    Docker makes 64 MB unless the container is started larger: the first save failed there. The choice
    now checks /dev/shm's free space against what a save stages (this node's checkpoint bytes) and
    falls back to megatron-core's writer, saying why, when it is too small; with room it stages there
    as before, and NVRx asked for by name is refused naming /dev/shm."""
    from megatron_tepo.actor.checkpointing import choose_async_writer
    from megatron_tepo.megatron.async_save import mcore_has_cpu_shm_mode

    if not mcore_has_cpu_shm_mode():
        pytest.skip("this megatron-core (< 0.19.2) has no cpu_shm_mode: the host-shm strategy cannot be built")
    monkeypatch.delenv("MTEPO_ASYNC_WRITER", raising=False)
    gpu = dict(nvrx_version="0.7.0", expandable=True, host_shm=True, on_gpu=True)
    w = choose_async_writer(save_0_19, staged_bytes=3 << 30, statvfs=_statvfs(64 << 20), **gpu)
    assert (w.name, w.staging, w.save_kwargs["async_strategy"]) == ("mcore", "host_copy", "mcore")
    assert "/dev/shm has 64 MiB free and a save stages 3.00 GiB" in w.why and "--shm-size" in w.why
    w = choose_async_writer(save_0_19, staged_bytes=3 << 30, statvfs=_statvfs(500 << 30), **gpu)
    assert (w.name, w.staging) == ("nvrx", "host_shm")
    with pytest.raises(CheckpointError, match="NVRx's writer cannot be had here: .*/dev/shm has 64 MiB free"):
        choose_async_writer(save_0_19, wanted="nvrx", staged_bytes=3 << 30, statvfs=_statvfs(64 << 20), **gpu)


def test_the_actor_counts_what_a_checkpoint_holds():
    """What the choice is told: the model's parameters and the optimizer's main parameters and Adam
    moments (before the first step: counted as they will be), each tensor once."""
    import torch

    from megatron_tepo.actor.actor import MegatronActor

    class Opt:
        def __init__(self, params, state):
            self.param_groups, self.state = [{"params": params}], state

    w = torch.nn.Linear(10, 10, bias=False)  # 100 fp32 parameters
    actor = MegatronActor.__new__(MegatronActor)

    def train_model(optimizer):  # (the actor's model and optimizer are its TrainModel's)
        return type("TrainModel", (), {"model": [w], "optimizer": type("Wrapped", (), {"optimizer": optimizer})()})()

    actor.train_model = train_model(Opt([w.weight], {}))
    assert actor.checkpoint_bytes() == 400 + 2 * 400  # the same tensor as main parameter: counted once
    main = torch.zeros(100, dtype=torch.float32)
    moments = {"exp_avg": torch.zeros(100), "exp_avg_sq": torch.zeros(100), "step": torch.tensor(1.0)}
    actor.train_model = train_model(Opt([main], {main: moments}))
    assert actor.checkpoint_bytes() == 400 + 400 + 800


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
