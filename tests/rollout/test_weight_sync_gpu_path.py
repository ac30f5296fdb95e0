"""The weight sync's GPU-path rules, checked on CPU against fake SGLang HTTP servers
(tests/rollout/fake_sglang.py) -- issue #22 rows 1, 2, 5 and 6:

- every TP worker of every server gets its own rank in the update group (the TP size is asked of
  the server, or known from the fleet that launched it), and tensor mode sends one payload per
  TP rank;
- ``disk`` mode writes buckets whose buffer is not on the CPU;
- in ``distributed`` mode a bucket's request goes out only once the servers answered the
  previous one, while the next bucket is still built during the servers' load;
- a server without ``/begin_weight_update`` / ``/end_weight_update`` is probed once and updated
  without them.

The real servers' side (SGLang's own receiving code) is tested in test_sglang_tp2_sync.py and
test_sglang_fleet.py.
"""
import time

import pytest
import torch

from megatron_tepo.buckets import FlatBucket, write_safetensors
from megatron_tepo.rollout.sglang.weight_sync import DistributedSync, TensorSync, make_weight_sync
from megatron_tepo.rollout.sglang.weight_sync import distributed as ws_distributed
from megatron_tepo.rollout.sglang.server import ServerConfig, SGLangServer, launch_server, stop_server
from tests.rollout.fake_sglang import FakeFleet, FakeSGLang

UPDATE_DIST = "/update_weights_from_distributed"


def _stream(n=4, numel=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(f"layers.{i}.weight", torch.randn(numel, generator=g)) for i in range(n)]


class _InstantWork:
    """An asynchronous broadcast as NCCL hands it back: ``wait()`` returns at once (it only
    orders CUDA streams), whether or not the servers have received anything."""

    def wait(self):
        return True


@pytest.fixture
def fake_group(monkeypatch):
    """No real process group: record what the sender would build, broadcast nothing."""
    made = []

    def fake_init(backend, init_method, world_size, rank, group_name, timeout=None):
        made.append({"world_size": world_size, "rank": rank, "backend": backend})
        return object()

    monkeypatch.setattr(ws_distributed, "init_custom_process_group", fake_init)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: _InstantWork())
    return made


def _server(url, tp_size=1, cls=SGLangServer):
    s = cls(url)
    s.tp_size = tp_size  # known, as for a server the fleet launched
    return s


@pytest.fixture
def fakes():
    made = []

    def make(**kw):
        f = FakeSGLang(**kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


# ------------------------------------------------------------------ row 1: TP > 1 servers
def test_update_group_gives_every_tp_worker_its_own_rank(fakes, fake_group):
    """Two servers at TP=2, attached by URL (the sync must ask them their TP size): world size
    1 + 2 + 2 = 5, rank offsets 1 and 3; with SGLang's rule (worker rank = rank_offset + tp_rank)
    the ranks 1..4 are each taken once. Asked once per server, not at every push."""
    servers = [fakes(tp_size=2), fakes(tp_size=2)]
    fleet = FakeFleet([SGLangServer(f.url) for f in servers])
    ws = DistributedSync(fleet, bucket_bytes=512, backend="gloo")
    try:
        ws.push(_stream())
        ws.push(_stream(seed=1))
    finally:
        ws.close()
    inits = [f.bodies("/init_weights_update_group")[0] for f in servers]
    assert [b["rank_offset"] for b in inits] == [1, 3]
    assert {b["world_size"] for b in inits} == {5}
    assert fake_group == [{"world_size": 5, "rank": 0, "backend": "gloo"}]
    worker_ranks = [b["rank_offset"] + r for b, f in zip(inits, servers) for r in range(f.tp_size)]
    assert sorted(worker_ranks) == list(range(1, 5))
    for f in servers:
        assert sum(p in ("/server_info", "/get_server_info") for p in f.paths("GET")) == 1


def test_tp_size_from_an_older_servers_get_server_info(fakes, fake_group):
    """A server without ``/server_info`` (SGLang before it was renamed) is asked at
    ``/get_server_info``."""
    f = fakes(tp_size=2, missing={"/server_info"})
    fleet = FakeFleet([SGLangServer(f.url), SGLangServer(fakes(tp_size=1).url)])
    ws = DistributedSync(fleet, bucket_bytes=512, backend="gloo")
    try:
        ws.push(_stream())
    finally:
        ws.close()
    assert f.bodies("/init_weights_update_group")[0]["world_size"] == 4
    assert "/get_server_info" in f.paths("GET")


def test_tensor_mode_sends_one_payload_per_tp_rank(fakes):
    """SGLang's TP worker deserialises ``serialized_named_tensors[tp_rank]`` (tp_worker.py,
    ``deserialize_own_rank``): a TP=2 server needs two entries."""
    f2, f1 = fakes(tp_size=2), fakes(tp_size=1)
    fleet = FakeFleet([SGLangServer(f2.url), SGLangServer(f1.url)])
    ws = TensorSync(fleet, bucket_bytes=512)
    ws.push(_stream())
    ws.close()
    for f, tp in ((f2, 2), (f1, 1)):
        bodies = f.bodies("/update_weights_from_tensor")
        assert bodies and all(len(b["serialized_named_tensors"]) == tp for b in bodies), (tp, bodies)


def test_fleet_launched_server_knows_its_tp_size(tmp_path):
    """A server the fleet starts with ``--tp-size 2`` is a TP=2 server without asking it
    (``/bin/true`` stands in for the SGLang python: only the returned handle is checked)."""
    cfg = ServerConfig(model_path=str(tmp_path), python="/bin/true", tp=2, log_dir=str(tmp_path))
    s = launch_server(cfg, 0)
    try:
        assert s.tp_size == 2
    finally:
        stop_server(s)


def test_bad_tp_size_reported_by_a_server_is_a_clear_error(fakes, fake_group):
    f = fakes(tp_size=0)
    ws = DistributedSync(FakeFleet([SGLangServer(f.url)]), bucket_bytes=512, backend="gloo")
    with pytest.raises(ValueError, match=r"tp_size"):
        ws.push(_stream())
    ws.close()


# ------------------------------------------------------------------ row 5: NCCL ordering
def test_distributed_request_waits_for_the_previous_answer(fakes, fake_group):
    """NCCL's ``work.wait()`` returns at once (here: ``_InstantWork``), so "the broadcast of bucket
    k completed" says nothing about the server. The server takes 0.3 s over each bucket: request
    k+1 must reach it only after it answered request k (never two bucket requests in flight,
    which could reach its update lock out of order), in bucket order -- and the next bucket must
    still be built while the server loads the previous one."""
    f = fakes(delays={UPDATE_DIST: 0.3})
    fleet = FakeFleet([_server(f.url)])
    pulled = {}

    def stream():
        for name, t in _stream(n=4, numel=64):
            pulled[name] = time.monotonic()
            yield name, t

    ws = DistributedSync(fleet, bucket_bytes=256, backend="gloo")  # one tensor a bucket
    try:
        stats = ws.push(stream())
    finally:
        ws.close()
    assert stats.buckets == 4
    reqs = [r for r in f.requests if r["path"] == UPDATE_DIST]
    assert [r["body"]["names"] for r in reqs] == [[f"layers.{i}.weight"] for i in range(4)]
    assert f.max_inflight[UPDATE_DIST] == 1, "a bucket request was sent before the previous was answered"
    for k in range(3):
        assert reqs[k + 1]["start"] >= reqs[k]["end"]
        # the gather of bucket k+1 overlapped the server's load of bucket k
        assert pulled[f"layers.{k + 1}.weight"] < reqs[k]["end"]


# ------------------------------------------------------------------ row 6: optional routes
@pytest.mark.parametrize("mode,own", [("tensor", {}), ("distributed", {"backend": "gloo"})])
def test_server_without_weight_update_session_routes(fakes, fake_group, mode, own):
    """An SGLang without ``/begin_weight_update`` / ``/end_weight_update`` (HTTP 404): probed once,
    then updated without them; a server that has them still gets both at every push."""
    old, new = fakes(missing={"/begin_weight_update", "/end_weight_update"}), fakes()
    fleet = FakeFleet([_server(old.url), _server(new.url)])
    ws = make_weight_sync(mode, fleet, bucket_bytes=512, **own)
    try:
        for seed in range(2):
            ws.push(_stream(seed=seed))
    finally:
        ws.close()
    load = UPDATE_DIST if mode == "distributed" else "/update_weights_from_tensor"
    assert old.paths("POST").count("/begin_weight_update") == 1  # the probe
    assert "/end_weight_update" not in old.paths("POST")
    assert len(old.bodies(load)) == len(new.bodies(load)) > 0
    assert new.paths("POST").count("/begin_weight_update") == new.paths("POST").count("/end_weight_update") == 2


def test_other_errors_of_the_session_routes_still_fail(fakes):
    """Only a missing route (404) is skipped: a server that refuses the update fails the push."""
    class Refusing(SGLangServer):
        def post(self, path, payload=None, timeout=60.0):
            if path == "/begin_weight_update":
                return {"success": False, "message": "refused"}
            return super().post(path, payload, timeout)

    f = fakes()
    ws = TensorSync(FakeFleet([_server(f.url, cls=Refusing)]), bucket_bytes=512)
    with pytest.raises(RuntimeError, match="begin_weight_update.*refused"):
        ws.push(_stream())
    ws.close()


# ------------------------------------------------------------------ row 2: disk from any device
class _OnDevice(torch.Tensor):
    """A tensor that reports a non-CPU device (here ``cuda``) while its bytes live in an inner CPU
    tensor. No CUDA tensor can be made on this machine; this is the honest stand-in for one: like
    a CUDA tensor it has no ``numpy()`` (torch refuses it for any non-CPU tensor, and for this
    subclass), while ``copy_`` into a host tensor -- the one transfer a GPU buffer allows --
    works, through ``__torch_dispatch__`` on the inner tensor."""

    @staticmethod
    def __new__(cls, inner, device):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=device)

    def __init__(self, inner, device):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(x):
            return x.inner if isinstance(x, _OnDevice) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def _bucket(flat_factory):
    a, b = torch.randn(3, 4), torch.arange(6, dtype=torch.int64)
    flat = torch.cat([a.reshape(-1).view(torch.uint8), b.view(torch.uint8)])
    return FlatBucket(["a", "b"], [a.dtype, b.dtype], [(3, 4), (6,)], [0, a.numel() * 4], flat_factory(flat)), a, b


def test_disk_mode_writes_a_bucket_whose_buffer_is_not_on_the_cpu(tmp_path):
    from safetensors.torch import load_file

    bucket, a, b = _bucket(lambda flat: _OnDevice(flat, "cuda"))
    assert bucket.flat.device.type == "cuda"
    write_safetensors(bucket, str(tmp_path / "m.safetensors"))
    got = load_file(str(tmp_path / "m.safetensors"))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_host_bytes_copies_only_off_the_cpu():
    """On the CPU the bucket's own buffer is written (no copy); off it one copy into a host
    buffer, reused when it is large enough (pinned where CUDA is available)."""
    from megatron_tepo.buckets import host_bytes

    bucket, _, _ = _bucket(lambda flat: flat)
    assert host_bytes(bucket.flat) is bucket.flat
    dev, _, _ = _bucket(lambda flat: _OnDevice(flat, "cuda"))
    staging = torch.empty(1024, dtype=torch.uint8)
    out = host_bytes(dev.flat, staging)
    assert out.device.type == "cpu" and out.data_ptr() == staging.data_ptr()
    assert torch.equal(out, dev.flat.inner)
