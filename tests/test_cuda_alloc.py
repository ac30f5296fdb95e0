"""Issue #40 row 1: the buffers that go out by CUDA IPC (the weight export's, handed to the SGLang
servers by the ``ipc`` sync) are never in expandable segments, whose IPC handles only open through
``pidfd_getfd`` (refused in containers without ptrace): they are allocated with the setting off,
and the rest of the trainer keeps it. On CPU, through the same code with torch's allocator
settings stood in for (what torch's setter would set, read back by the getter)."""
import torch

from megatron_tepo import cuda_alloc


def _stand_in_allocator(monkeypatch, conf):
    state = {"conf": conf}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_alloc, "_get_settings", lambda: state["conf"])

    def set_(new):  # torch's setter changes the keys it is given, keeps the others
        items = dict(i.split(":", 1) for i in state["conf"].split(",") if i)
        items.update(dict(i.split(":", 1) for i in new.split(",")))
        state["conf"] = ",".join(f"{k}:{v}" for k, v in items.items())

    monkeypatch.setattr(cuda_alloc, "_set_settings", set_)
    return state


def test_the_export_buffers_are_allocated_without_expandable_segments(monkeypatch):
    from megatron_tepo.actor import export

    state = _stand_in_allocator(monkeypatch, "expandable_segments:True,max_split_size_mb:64")
    seen, real_empty = [], torch.empty

    def empty(*args, **kwargs):
        seen.append(cuda_alloc.expandable_segments_on())
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(export.torch, "empty", empty)
    for reuse in (True, False):
        bufs = export._Buffers(reuse, device="cpu")
        assert bufs.get("flat", 1024).numel() == 1024 and bufs.get("flat", 4096).numel() == 4096
    assert seen == [False] * 4  # every buffer: the setting off
    assert state["conf"] == "expandable_segments:True,max_split_size_mb:64"  # and back on after
    assert cuda_alloc.expandable_segments_on()  # (the rest of the trainer's allocations)


def test_the_scope_leaves_a_setting_without_expandable_segments_alone(monkeypatch):
    state = _stand_in_allocator(monkeypatch, "max_split_size_mb:64")
    calls = []
    monkeypatch.setattr(cuda_alloc, "_set_settings", calls.append)
    with cuda_alloc.no_expandable_segments():
        assert not cuda_alloc.expandable_segments_on()
    assert calls == [] and state["conf"] == "max_split_size_mb:64"
