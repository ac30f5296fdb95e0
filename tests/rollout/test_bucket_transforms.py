"""The stage between the export and the servers (issue #33 point 6: the seam for, e.g., an FP8
rollout): a weight sync's transforms, in order -- the wire dtype (``rollout.sync_dtype``) first,
a cast done before any collective -- and every other one applied to each bucket the sender sends."""
import torch

from megatron_tepo.buckets import BucketTransform, FlatBucket, WireDtype, to_flat_bucket
from megatron_tepo.rollout.sglang.weight_sync.base import SyncStats, WeightSync


class _Recorder(WeightSync):
    mode = "record"

    def _send(self, bucket, servers):
        pass


class _Halve(BucketTransform):
    """A stand-in for a quantizer: each tensor halved, and its name marked."""

    def __call__(self, bucket: FlatBucket) -> FlatBucket:
        named = [(f"{n}.halved", t / 2) for n, t in bucket.named_tensors()]
        out = to_flat_bucket(named, torch.empty(sum(t.numel() * t.element_size() for _, t in named), dtype=torch.uint8))
        out.release = bucket.release
        return out


def _stream():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(4, 3, generator=g)), ("b.bias", torch.randn(5, generator=g))]


def _sent(sync):
    return [dict(b.named_tensors()) for b in sync._buckets(_stream(), SyncStats("record"))]


def test_the_wire_dtype_is_the_first_stage_and_a_cast():
    sync = _Recorder(None, wire_dtype=torch.bfloat16, is_sender=True)
    assert [type(t) for t in sync.transforms] == [WireDtype] and sync.wire_dtype == torch.bfloat16
    (bucket,) = _sent(sync)
    assert {n: t.dtype for n, t in bucket.items()} == {"a.weight": torch.bfloat16, "b.bias": torch.bfloat16}


def test_a_transform_changes_every_bucket_the_sender_sends():
    sync = _Recorder(None, wire_dtype=torch.float32, is_sender=True, transforms=[_Halve()], bucket_bytes=48)
    assert [type(t) for t in sync.transforms] == [WireDtype, _Halve]
    sent = _sent(sync)
    assert len(sent) == 2  # one tensor per bucket at 48 bytes: the transform ran on each
    got = {n: t.clone() for b in sent for n, t in b.items()}
    want = {f"{n}.halved": t / 2 for n, t in _stream()}
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_a_rank_that_only_drains_applies_nothing():
    sync = _Recorder(None, is_sender=False, transforms=[_Halve()])
    assert all(b is None for b in sync._buckets(_stream(), SyncStats("record")))
