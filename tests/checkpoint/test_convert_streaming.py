"""The streaming import writes the very checkpoint megatron-core's own save of the filled model
writes: same keys, global shapes, dtypes, chunk lists (TP partition, fused QKV rows, gate/up halves,
stacked layers, experts, replica dedup), the same bytes for every stored item, the same
``common.pt`` (megatron-core < 0.19; from 0.19 the common state is one more stored item) and
``metadata.json`` -- at TP=2 x PP=2 (tied and untied, QKV bias) and at EP=2
(Qwen3-MoE). And it holds at most one layer's (or the embedding's) full tensors at a time."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.fixtures import make_hf_dir, variant_id
from tests.dist_utils import torchrun

WORKER = Path(__file__).with_name("convert_worker.py")
pytestmark = pytest.mark.distributed


def _stored_items(path: Path) -> tuple:
    """(state_dict_metadata with sorted chunk lists, {(key, offset): raw bytes of the stored item})."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    meta = {}
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            meta[key] = (tuple(m.size), m.properties,
                         sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks))
        else:
            meta[key] = type(m).__name__
    items = {}
    for index, info in md.storage_data.items():
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            items[(index.fqn, None if index.offset is None else tuple(index.offset))] = f.read(info.length)
    return meta, items


def assert_same_checkpoint(streamed: Path, reference: Path) -> int:
    meta_s, items_s = _stored_items(streamed)
    meta_r, items_r = _stored_items(reference)
    assert sorted(meta_s) == sorted(meta_r), set(meta_s) ^ set(meta_r)
    for key in meta_r:
        assert meta_s[key] == meta_r[key], (key, meta_s[key], meta_r[key])
    assert sorted(items_s) == sorted(items_r), set(items_s) ^ set(items_r)
    differ = [k for k in items_r if items_s[k] != items_r[k]]
    assert differ == [], differ[:8]
    from megatron_tepo.megatron.compat import dist_ckpt_common_files

    for name in (*dist_ckpt_common_files(reference), "metadata.json"):  # no common.pt from 0.19 on
        assert (streamed / name).read_bytes() == (reference / name).read_bytes(), name
    return len(items_r)


def _largest_group_bytes(hf_dir: Path) -> int:
    """Bytes of the largest unit the import streams by: one decoder layer, or one top-level tensor."""
    from megatron_tepo.checkpoint.hf_io import LazyHFCheckpoint, hf_layer_index

    ckpt = LazyHFCheckpoint(hf_dir)
    groups: dict = {}
    for n in ckpt.names():
        numel = 1
        for d in ckpt.shape(n):
            numel *= d
        key = hf_layer_index(n) if hf_layer_index(n) is not None else n
        groups[key] = groups.get(key, 0) + numel * ckpt.dtype(n).itemsize
    return max(groups.values())


@pytest.mark.parametrize("layout", ["tp2pp2", "ep2"])
def test_streaming_import_equals_megatron_save(tmp_path, layout):
    if layout == "tp2pp2":
        variants, nproc, args, suffix = [("llama", True), ("qwen2", False)], 4, ["2", "2"], "tp2pp2"
    else:
        variants, nproc, args, suffix = [("qwen3_moe", False)], 2, ["1", "1"], "tp1pp1ep2"
    for family, tie in variants:
        make_hf_dir(tmp_path / f"hf-{variant_id(family, tie)}", family, tie, seed=11, tokenizer=False)
    names = ",".join(variant_id(f, t) for f, t in variants)
    extra = ["--ep", "2"] if layout == "ep2" else []
    results = torchrun(WORKER, nproc, "import", str(tmp_path), *args, names, "--reference", *extra,
                       tmp_path=tmp_path)
    for family, tie in variants:
        v = variant_id(family, tie)
        n = assert_same_checkpoint(tmp_path / f"mg-{v}-{suffix}", tmp_path / f"mg-{v}-{suffix}-ref")
        assert n > 4 * 6, n
        bound = _largest_group_bytes(tmp_path / f"hf-{v}")
        for rank, r in enumerate(results):
            stats = r[v]["import_stats"]
            assert stats["bytes_written"] > 0, (rank, stats)
            assert stats["peak_cached_bytes"] <= bound, (v, rank, stats, bound)
