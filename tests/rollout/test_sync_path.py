"""The sync path in one call: ``sync_weights`` is ``engine.update_weights(actor.export_hf_state())``
and the update flushes the servers' cache exactly once, between pause and continue (fake
servers record what a push sends; the real-server behaviour is in test_sglang_fleet.py)."""
import torch

from megatron_tepo.rollout.weight_sync import WeightSync
from megatron_tepo.trainer.loop import sync_weights


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
    ws = WeightSync(fleet, mode="disk", shared_dir=str(tmp_path), bucket_bytes=64)
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

    class Actor:
        def export_hf_state(self):
            return iter([("w", torch.ones(2))])

    seconds = sync_weights(Actor(), Engine())
    assert seconds >= 0 and [c[0] for c in calls] == ["update"] and calls[0][1][0][0] == "w"
