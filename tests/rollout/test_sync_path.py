"""The sync path in one call: ``sync_weights`` is ``engine.update_weights(actor.export_hf_state())``
and the update flushes the servers' cache exactly once, between pause and continue (fake
servers record what a push sends; the real-server behaviour is in test_sglang_fleet.py); a
stream is read as buckets when its type says it comes in buckets (``BucketStream``)."""
import typing

import pytest
import torch

from megatron_tepo.buckets import BucketStream, to_flat_bucket
from megatron_tepo.rollout.engine import gathered_tensors
from megatron_tepo.config import RolloutConfig
from megatron_tepo.rollout.sglang.weight_sync import MODES, SYNC_MODES, DiskSync, make_weight_sync
from megatron_tepo.trainer.loop import sync_weights
from tests.fakes import FakePolicy


class FakeServer:
    def __init__(self, url, calls):
        self.url, self.tp_size, self.calls = url, 1, calls

    def post(self, path, payload=None, timeout=None):
        self.calls.append((self.url, path))
        return {"success": True}


class FakeFleet:
    def __init__(self, n=2):
        self.calls = []
        self.servers = [FakeServer(f"http://s{i}", self.calls) for i in range(n)]

    def alive_servers(self):
        return self.servers


def test_one_push_pauses_updates_flushes_once_and_continues(tmp_path):
    fleet = FakeFleet()
    ws = DiskSync(fleet, shared_dir=str(tmp_path), bucket_bytes=64)
    stats = ws.push([("a.weight", torch.ones(4, 4)), ("b.weight", torch.zeros(8))])
    assert stats.tensors == 2 and stats.buckets == 2
    for s in fleet.servers:
        paths = [p for url, p in fleet.calls if url == s.url]
        assert paths == ["/pause_generation", "/update_weights_from_disk", "/flush_cache", "/continue_generation"]


def test_sync_weights_is_one_update_call_and_no_second_flush():
    calls = []

    class Engine:
        def update_weights(self, named):
            calls.append(("update", list(named)))

        def flush_cache(self):
            calls.append(("flush", None))

    class Actor(FakePolicy):
        def export_hf_state(self):
            return iter([("w", torch.ones(2))])

    seconds = sync_weights(Actor(), Engine())
    assert seconds >= 0 and [c[0] for c in calls] == ["update"] and calls[0][1][0][0] == "w"


class Stream(BucketStream):
    """Two buckets made beforehand; records how it was asked for them."""

    def __init__(self):
        self.calls = []
        self.buckets = [to_flat_bucket([("a.weight", torch.ones(4, 4))]), to_flat_bucket([("b.weight", torch.zeros(8))])]

    def flat_buckets(self, bucket_bytes=None, dtype=None, dst=None, reuse=False, buffers=None):
        self.calls.append({"bucket_bytes": bucket_bytes, "dtype": dtype, "dst": dst, "reuse": reuse})
        return iter(self.buckets)


def test_a_bucket_stream_is_read_as_buckets(tmp_path):
    """The actor's export is a BucketStream: the sync asks it for buckets of its own size, cast to
    the wire dtype, in reused buffers; an engine's reader asks for them gathered to rank 0.
    Iterating it gives the pairs of every bucket."""
    stream = Stream()
    ws = DiskSync(FakeFleet(), shared_dir=str(tmp_path), bucket_bytes=64, wire_dtype=torch.bfloat16)
    stats = ws.push(stream)
    assert stats.bucketed_export and stats.buckets == 2 and stats.tensors == 2
    assert stream.calls == [{"bucket_bytes": 64, "dtype": torch.bfloat16, "dst": None, "reuse": True}]
    assert [n for n, _ in gathered_tensors(stream)] == ["a.weight", "b.weight"]
    assert stream.calls[-1]["dst"] == 0
    assert [n for n, _ in stream] == ["a.weight", "b.weight"]


def test_a_plain_stream_with_a_flat_buckets_attribute_is_still_a_plain_stream(tmp_path):
    """Only the type says that a stream buckets itself, not an attribute that happens to exist."""
    class Pairs(list):
        flat_buckets = None

    pairs = Pairs([("a.weight", torch.ones(4, 4)), ("b.weight", torch.zeros(8))])
    stats = DiskSync(FakeFleet(), shared_dir=str(tmp_path), bucket_bytes=64).push(pairs)
    assert not stats.bucketed_export and stats.tensors == 2
    assert gathered_tensors(pairs) is pairs


def test_sync_modes_by_name():
    """``rollout.sync_mode`` names one class each; a mode takes only its own options."""
    assert set(MODES) == set(typing.get_args(typing.get_type_hints(RolloutConfig)["sync_mode"]))
    assert all(SYNC_MODES[m].mode == m for m in MODES)
    assert isinstance(make_weight_sync("disk", FakeFleet(), shared_dir="/x"), DiskSync)
    with pytest.raises(ValueError, match="unknown weight sync mode 'nfs'"):
        make_weight_sync("nfs", FakeFleet())
    with pytest.raises(TypeError, match="shared_dir"):
        make_weight_sync("tensor", FakeFleet(), shared_dir="/x")
