"""The one choice of the asynchronous checkpoint saves' writer (issue #45 point 2,
``megatron_tepo/actor/checkpointing.py:choose_async_writer``): NVRx's where megatron-core's
``dist_checkpointing.save`` takes ``async_strategy`` and nvidia-resiliency-ext is there, megatron-core's
own elsewhere, with the reason said once. (Both writers' saves, resumes and kills:
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
    w = choose_async_writer(save_0_19, nvrx_version="0.7.0")
    assert (w.name, w.save_kwargs) == ("nvrx", {"async_sharded_save": True, "async_strategy": "nvrx"})
    assert w.why == "nvidia-resiliency-ext 0.7.0"


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
