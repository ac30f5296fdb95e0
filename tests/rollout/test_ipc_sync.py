"""The ``ipc`` weight sync in one process, against fake SGLang servers (the same path with a TP=2
actor and a real server: tests/trainer/test_colocated_sglang.py), and its placement rule (pure).

* Each server TP rank gets its own pickle of the bucket's own buffer -- a handle, not a copy: one
  shared-memory file for every bucket of a push, where ``tensor`` mode copies each bucket into a
  fresh one -- and what it maps holds the bucket's bytes.
* One bucket in flight per server, and the buffer is not written again before the server answered:
  a fake that holds each request for a while reads the same bytes at its end as at its start.
* Which actor rank feeds which server TP rank: the colocated placement (the k-th server of a host
  on that host's GPUs after the earlier servers'), loopback URLs on the sender's host, CPU ranks by
  their local rank, a server beside the actor's GPUs fed across GPUs (reported), a server on a host
  without an actor rank refused.
* ``sync_mode: ipc`` with pipeline parallelism is refused by the config."""
import base64
import pickle
import threading

import pytest
import torch

from megatron_tepo.rollout.sglang.weight_sync import make_weight_sync
from megatron_tepo.rollout.sglang.weight_sync.ipc import RankPlace, ipc_sources
from tests.rollout.fake_sglang import FakeFleet, FakeSGLang

UPDATE = "/update_weights_from_tensor"


def _weights(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(64, 32, generator=g)) for i in range(n)]


def _unpickle(entry):
    return pickle.loads(base64.b64decode(entry))


def _expected(weights, names):
    by_name = dict(weights)
    return torch.cat([by_name[n].reshape(-1).view(torch.uint8) for n in names])


class Reader:
    """What a server TP rank would load: every entry of every update mapped once as it arrives (as
    SGLang's worker does: each pickle holds one reference of the shared file), read then and again
    just before the answer (after the fake's delay)."""

    def __init__(self):
        self.seen, self.changed, self.lock = [], [], threading.Lock()

    def __call__(self, path, body, when):
        if path != UPDATE:
            return
        with self.lock:
            for rank, entry in enumerate(body["serialized_named_tensors"]):
                if when == "start":
                    obj = _unpickle(entry)
                    flat = obj["flattened_tensor"]
                    self.seen.append({"rank": rank, "names": [m.name for m in obj["metadata"]], "flat": flat,
                                      "bytes": flat.clone(), "request": id(body),
                                      "file": flat.untyped_storage()._share_filename_cpu_()[1]})
                    continue
                s = next(s for s in self.seen if s["request"] == id(body) and s["rank"] == rank)
                if not torch.equal(s["flat"], s["bytes"]):
                    self.changed.append(s["names"])
                s["flat"] = None  # let go of the mapping, as the server does after its load


@pytest.fixture
def servers():
    reader = Reader()
    fakes = [FakeSGLang(tp_size=2, delays={UPDATE: 0.2}, inspect=reader), FakeSGLang(tp_size=1, inspect=reader)]
    yield fakes, reader
    for f in fakes:
        f.close()


def test_each_tp_rank_maps_the_buckets_own_buffer_one_bucket_in_flight(servers):
    fakes, reader = servers
    weights = _weights()
    sync = make_weight_sync("ipc", FakeFleet([_server(f) for f in fakes]), bucket_bytes=3 * 64 * 32 * 4)  # 2 buckets
    stats = sync.push(weights)
    assert stats.buckets == 2 and stats.tensors == 6

    bodies = fakes[0].bodies(UPDATE) + fakes[1].bodies(UPDATE)
    assert [len(b["serialized_named_tensors"]) for b in bodies] == [2, 2, 1, 1]  # one entry per TP rank
    assert all(b["load_format"] == "flattened_bucket" and b["flush_cache"] is False for b in bodies)
    for s in reader.seen:  # what each rank mapped is the bucket
        assert torch.equal(s["bytes"], _expected(weights, s["names"]))
    assert sorted({n for s in reader.seen for n in s["names"]}) == sorted(n for n, _ in weights)
    # the handle is of the sender's own reused buffer: one shared file for both buckets
    assert len({s["file"] for s in reader.seen}) == 1
    # one bucket in flight per server, and no byte rewritten before the server answered
    assert fakes[0].max_inflight[UPDATE] == 1 and not reader.changed
    b0 = [r for r in fakes[0].requests if r["path"] == UPDATE]
    assert b0[1]["start"] >= b0[0]["end"]
    assert not [p for f in fakes for p in f.paths() if "weights_update_group" in p]  # no process group
    sync.close()


def test_tensor_mode_copies_each_bucket_where_ipc_shares_it(servers):
    """(What sets the two apart, so that the first test's shared-file check can fail.)"""
    fakes, reader = servers
    sync = make_weight_sync("tensor", FakeFleet([_server(fakes[1])]), bucket_bytes=3 * 64 * 32 * 4)
    sync.push(_weights())
    assert len({s["file"] for s in reader.seen}) == 2
    sync.close()


def _server(fake):
    from megatron_tepo.rollout.sglang.client import SGLangServer

    return SGLangServer(fake.url, tp_size=fake.tp_size)


def test_placement_follows_the_colocated_layout(monkeypatch):
    from megatron_tepo.rollout.sglang.weight_sync import ipc

    # (made-up host names: no DNS look-up, which takes seconds to fail)
    monkeypatch.setattr(ipc, "_addresses", lambda host: frozenset())
    monkeypatch.setattr(ipc, "_is_loopback", lambda host: host in ("127.0.0.1", "localhost"))
    # two nodes of 4 GPUs, an actor rank per GPU; two TP-2 servers per node, listed node by node
    places = [RankPlace(r, f"node{r // 4}", r % 4, r % 4) for r in range(8)]
    servers = [("node0", 2), ("node0", 2), ("node1.cluster", 2), ("NODE1", 2)]
    plan, across = ipc_sources(servers, places, here="node0")
    assert plan == [[0, 1], [2, 3], [4, 5], [6, 7]] and across == []
    # one TP-4 server per node, listed in the other order
    assert ipc_sources([("node1", 4), ("node0", 4)], places, "node0")[0] == [[4, 5, 6, 7], [0, 1, 2, 3]]
    # a loopback URL is the sender's host; CPU ranks (no GPU) go by their local rank
    cpu = [RankPlace(0, "me", 0), RankPlace(1, "me", 1)]
    assert ipc_sources([("127.0.0.1", 1), ("localhost", 1)], cpu, "me") == ([[0], [1]], [])
    assert ipc_sources([("127.0.0.1", 2)], cpu, "me") == ([[0, 1]], [])
    # a server on GPUs 4-5 beside an actor on 0-3 of the same node: fed across GPUs, and said so
    plan, across = ipc_sources([("node0", 4), ("node0", 2)], places[:4], "node0")
    assert plan == [[0, 1, 2, 3], [0, 1]] and across == [(1, 0), (1, 1)]
    with pytest.raises(ValueError, match="server 0 runs on node7, where no actor rank runs.*sync_mode"):
        ipc_sources([("node7", 1)], places, "node0")


def test_ipc_with_pipeline_parallelism_is_refused():
    from megatron_tepo.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="rollout.sync_mode: 'ipc'.*parallel.pp=2"):
        from_dict({"rollout": {"sync_mode": "ipc"}, "parallel": {"pp": 2}})
    assert from_dict({"rollout": {"sync_mode": "ipc", "colocated": True}}).rollout.sync_mode == "ipc"


def test_a_cuda_handle_names_its_device_by_uuid(monkeypatch):
    """The one GPU-only step of the sender, on a stand-in CUDA tensor (no CUDA here): torch's
    reduction of a CUDA tensor with its device index replaced by the device's UUID, which SGLang's
    patched rebuild (``sglang.srt.utils.patch_torch``) maps to its own index; the position of the
    device among torch's arguments is checked against the installed torch and SGLang's constant."""
    import inspect
    import io
    import re
    from types import SimpleNamespace

    from torch.multiprocessing import reductions

    from megatron_tepo.rollout.sglang.options import default_sglang_python
    from megatron_tepo.rollout.sglang.weight_sync import ipc
    from tests.rollout.test_weight_sync_gpu_path import _OnDevice

    # torch's CUDA branch returns (rebuild_cuda_tensor, (type, size, stride, offset, storage type, dtype, device, ...))
    src = inspect.getsource(reductions.reduce_tensor)
    fields = re.search(r"rebuild_cuda_tensor,\s*\((.*?)\),\s*\)", src, re.S).group(1)
    names = [re.sub(r"#.*", "", f).strip() for f in fields.split("\n")]
    names = [n.rstrip(",") for n in names if n]
    assert names[ipc._REDUCE_DEVICE_ARG] == "device", names
    patch = list(__import__("pathlib").Path(default_sglang_python()).parents[1].glob(
        "lib/python*/site-packages/sglang/srt/utils/patch_torch.py"))
    if patch:  # SGLang's own constant for the same position
        assert f"_REDUCE_TENSOR_ARG_DEVICE_INDEX = {ipc._REDUCE_DEVICE_ARG}" in patch[0].read_text()

    args = tuple(range(15))
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: ("rebuild", (*args[:6], 3, *args[7:])))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-uuid-{i}"))
    fn, out = ipc._reduce_naming_device_uuid(_OnDevice(torch.zeros(4, dtype=torch.uint8), "cuda"))
    assert fn == "rebuild" and out == (*args[:6], "GPU-uuid-3", *args[7:])
    fn, out = ipc._reduce_naming_device_uuid(torch.zeros(4))  # a CPU tensor: torch's reduction as it is
    assert out[6] == 3
    monkeypatch.undo()
    assert ipc._uuid_pickler(io.BytesIO()).dispatch_table[torch.Tensor] is ipc._reduce_naming_device_uuid


@pytest.mark.distributed
def test_the_per_bucket_messages_go_over_a_gloo_group_of_their_own(tmp_path):
    """Issue #40 row 7: on a GPU job the default group is NCCL; the sync's per-bucket gather and
    broadcast must not run there (host syncs, NCCL kernels on the GPUs where the servers load the
    weights): every rank's sync holds a gloo group of every rank."""
    from tests.dist_utils import REPO, torchrun

    results = torchrun(REPO / "tests/rollout/ipc_group_worker.py", 2, tmp_path=tmp_path, timeout=300)
    assert results == [{"backend": "gloo", "default": False, "size": 2}] * 2, results
