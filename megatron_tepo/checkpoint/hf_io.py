"""Hugging Face checkpoint files: lazy safetensors reading, sharded writing, side files, checks.

* :class:`LazyHFCheckpoint` -- names, shapes and dtypes of a (sharded or single-file) safetensors
  checkpoint from the file headers only; :meth:`LazyHFCheckpoint.get` reads one tensor's bytes
  (or a range of its rows), :meth:`LazyHFCheckpoint.read_rows_into` reads rows straight into a
  given tensor (a parameter's slice), each with a plain positioned file read (nothing else is
  loaded, and no file is memory-mapped:
  ``safe_open`` maps the whole file and every page it touched counts in the process's RSS until
  the handle closes -- measured +0.5 GiB on a 1.9 GiB import).
* :func:`open_hf_checkpoint` -- such a reader in the text model's names (a multimodal checkpoint's
  text model under its prefix, its other parts carried: :class:`~megatron_tepo.models.CheckpointNaming`).
* :class:`ShardedSafetensorsWriter` -- writes ``(name, tensor)`` pairs as
  ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_bytes`` plus
  ``model.safetensors.index.json`` (always written, also for one shard); it holds one shard in
  memory at a time.
* :func:`copy_side_files` -- config.json, generation_config.json, tokenizer and chat-template files
  (every regular file that is not a weight file).
* :func:`expected_hf_tensors` / :func:`check_hf_tensors` -- the names and shapes the HF config
  implies (from the transformers model built on the ``meta`` device, no memory; MoE experts that
  transformers >= 5 stacks in memory are listed one tensor per expert, as ``save_pretrained`` stores
  them and a reader of a stacked checkpoint serves them),
  and a check of a checkpoint against them that names every missing / unexpected / wrongly shaped
  tensor.

Left out: ``pytorch_model*.bin`` (pickle) checkpoints -- they cannot be read lazily; convert them
to safetensors first. GGUF is read by transformers, not here.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from megatron_tepo.dtypes import SAFETENSORS_DTYPES, SAFETENSORS_NAMES, dtype_name

INDEX_NAME = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


class _ByteCounter:
    """Bytes of tensor data read by every :class:`LazyHFCheckpoint` of this process (benchmarks)."""

    value = 0


BYTES_READ = _ByteCounter()


class LazyHFCheckpoint:
    """A safetensors HF checkpoint directory, read tensor by tensor.

    ``naming`` (a :class:`~megatron_tepo.models.CheckpointNaming`; :func:`open_hf_checkpoint` reads
    it off the directory's config): the reader answers in the text model's names (a published
    Qwen3.5's ``model.language_model.layers.0.*`` is ``model.layers.0.*`` here); :meth:`names`
    lists the text model's tensors only, :meth:`carried_names` the others (vision tower, MTP
    layers) under their stored names, which :meth:`get` also reads; :meth:`stored_name` gives a
    tensor's name in the files. A naming with ``stacked_experts`` serves a layer's stacked routed
    experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]``: the published
    Qwen3.5-MoE layout) as one tensor per expert, the names the mapping uses, each read from its own
    contiguous bytes of the stacked tensor (:func:`~megatron_tepo.models.names.unstack_experts`);
    :meth:`stored_tensors` lists the files' tensors as stored. Without ``naming`` every name is the
    stored one."""

    def __init__(self, path, naming=None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"HF checkpoint directory {self.path} does not exist")
        index = self.path / INDEX_NAME
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                other = sorted(p.name for p in self.path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
                raise ValueError(f"no *.safetensors weights under {self.path}"
                                 + (f" (found {other}: convert them to safetensors first)" if other else ""))
            self._file_of = {}
            for f in files:
                for name in self._header(f):
                    if name in self._file_of:
                        raise ValueError(f"HF tensor {name!r} is stored twice ({self._file_of[name].name}, {f.name})")
                    self._file_of[name] = f
        self._meta: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self._span: Dict[str, Tuple[int, int]] = {}
        for f in sorted(set(self._file_of.values())):
            if not f.exists():
                raise FileNotFoundError(f"{f} (named in {INDEX_NAME}) does not exist")
            for name, (shape, dt, span) in self._header(f, with_offsets=True).items():
                if self._file_of.get(name) == f:
                    self._meta[name] = (shape, dt)
                    self._span[name] = span
        absent = [n for n in self._file_of if n not in self._meta]
        if absent:
            raise ValueError(f"{INDEX_NAME} names tensor(s) absent from their file: {absent[:8]}")
        self._handles: Dict[Path, object] = {}
        self._carried_set: set = set()
        self.naming = naming
        self._stored: Dict[str, str] = {}  # this reader's name -> the stored one, where they differ
        self._stored_meta = dict(self._meta)  # the stored tensors: stored name -> (shape, dtype)
        self._carried: List[str] = []
        if naming is not None:
            self._rename(naming)

    def _rename(self, naming) -> None:
        """Key every table by the text model's name (a carried tensor keeps its stored name); a
        stacked expert tensor (``naming.expert_pieces``) becomes its per-expert tensors, each a
        contiguous byte range of it."""
        file_of, meta, span = {}, {}, {}
        for stored in self._meta:
            text = naming.text_name(stored)
            key = stored if text is None else text
            shape, dt = self._meta[stored]
            try:
                pieces = naming.expert_pieces(key, shape) if text is not None else None
            except ValueError as exc:
                raise ValueError(f"{exc} (in {self._file_of[stored]})") from None
            if pieces is None:
                entries = [(key, shape, self._span[stored])]
            else:  # [E, R, C]: expert e's rows [a, b) are bytes (e * R + a) * C ... of the stored tensor
                start, rows, row_bytes = self._span[stored][0], shape[1], shape[2] * dt.itemsize
                entries = [(name, (b - a, shape[2]),
                            (start + (e * rows + a) * row_bytes, start + (e * rows + b) * row_bytes))
                           for name, e, (a, b) in pieces]
            for name, piece_shape, piece_span in entries:
                if name in meta:
                    raise ValueError(f"HF tensors {self._stored.get(name, name)!r} and {stored!r} in {self.path} are "
                                     f"both the text model's {name!r}")
                if text is None:
                    self._carried.append(stored)
                elif name != stored:
                    self._stored[name] = stored
                file_of[name], meta[name], span[name] = self._file_of[stored], (piece_shape, dt), piece_span
        self._file_of, self._meta, self._span = file_of, meta, span
        self._carried_set = set(self._carried)

    @staticmethod
    def _header(file: Path, with_offsets: bool = False) -> Dict[str, tuple]:
        """name -> (shape, dtype) read from the safetensors JSON header (no tensor data); with
        ``with_offsets`` also the absolute byte range ``(start, end)`` of the tensor's data."""
        with open(file, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        out = {}
        for name, info in header.items():
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"HF tensor {name!r} in {file.name} has unsupported dtype {info['dtype']}")
            entry = (tuple(info["shape"]), SAFETENSORS_DTYPES[info["dtype"]])
            if with_offsets:
                begin, end = info["data_offsets"]
                entry += ((8 + n + int(begin), 8 + n + int(end)),)
            out[name] = entry
        return out

    def names(self) -> List[str]:
        """The text model's tensors (every tensor without a ``naming``)."""
        return [n for n in self._meta if n not in self._carried_set] if self._carried else list(self._meta)

    def carried_names(self) -> List[str]:
        """The stored names of the tensors that are not the text model's (``naming``'s ``carried``)."""
        return list(self._carried)

    def stored_name(self, name: str) -> str:
        """The name in the files of tensor ``name`` (as :meth:`names` / :meth:`carried_names` give it;
        an expert's piece of a stacked tensor: the stacked tensor's)."""
        return self._stored.get(name, name)

    def stored_tensors(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """Every tensor as the files store it: stored name -> (shape, dtype) (a stacked expert tensor
        once, whole; the text model's and the carried ones)."""
        return dict(self._stored_meta)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def __contains__(self, name: str) -> bool:
        """Whether the text model's tensor ``name`` is stored (a carried one is not counted)."""
        return name in self._meta and not (self._carried and name in self._carried_set)

    def file_of(self, name: str) -> Path:
        """The file that stores ``name``."""
        return self._file_of[name]

    def _rows_span(self, name: str, rows: Optional[Tuple[int, int]]):
        """(start, end, shape) of the bytes of ``name`` (or of its rows ``[a, b)`` along dim 0)."""
        if sys.byteorder != "little":
            raise RuntimeError("LazyHFCheckpoint reads raw little-endian safetensors data: "
                               "big-endian hosts are not supported")
        shape, dt = self._meta[name]
        start, end = self._span[name]
        numel = 1
        for d in shape:
            numel *= int(d)
        if end - start != numel * dt.itemsize:
            raise ValueError(f"HF tensor {name!r} in {self._file_of[name].name}: {end - start} data "
                             f"bytes for shape {shape} and dtype {dtype_name(dt)}")
        if rows is not None:
            a, b = int(rows[0]), int(rows[1])
            if not shape or not 0 <= a <= b <= shape[0]:
                raise ValueError(f"HF tensor {name!r} of shape {shape}: no rows [{a}, {b})")
            row_bytes = (end - start) // shape[0] if shape[0] else 0
            start, end, shape = start + a * row_bytes, start + b * row_bytes, (b - a,) + tuple(shape[1:])
        return start, end, tuple(shape)

    def _pread(self, name: str, start: int, end: int, out: torch.Tensor) -> None:
        """Read the file bytes ``[start, end)`` of ``name``'s file into ``out`` (contiguous, CPU,
        exactly ``end - start`` bytes). Every read of tensor data goes through here."""
        if end <= start:
            return
        fh = self._handles.get(self._file_of[name])
        if fh is None:
            fh = self._handles[self._file_of[name]] = open(self._file_of[name], "rb")
        fh.seek(start)
        # the tensor's bytes as a buffer without .numpy(), which would pin its storage's size for
        # good (colocated mode frees and re-allocates the parameters' storages: megatron/offload.py)
        flat = out.reshape(-1).view(torch.uint8)
        got = fh.readinto((ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr()))
        if got != end - start:
            raise ValueError(f"HF tensor {name!r}: {self._file_of[name].name} is truncated "
                             f"(read {got} of {end - start} bytes)")
        BYTES_READ.value += end - start

    def get(self, name: str, rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Read one tensor -- or only its rows ``[a, b)`` along dim 0, a contiguous byte range --
        straight from the file into a fresh tensor (safetensors stores raw little-endian data,
        so this is bit for bit what ``safe_open`` returns)."""
        start, end, shape = self._rows_span(name, rows)
        raw = torch.empty(end - start, dtype=torch.uint8)
        self._pread(name, start, end, raw)
        return raw.view(self._meta[name][1]).reshape(shape)

    def read_rows_into(self, name: str, rows: Tuple[int, int], out: torch.Tensor) -> torch.Tensor:
        """Read rows ``[a, b)`` (dim 0) of ``name`` straight into ``out``: a contiguous CPU
        tensor of the stored dtype and ``b - a`` rows (e.g. a slice of a parameter), no copy."""
        start, end, shape = self._rows_span(name, rows)
        dt = self._meta[name][1]
        if out.device.type != "cpu" or out.dtype != dt or not out.is_contiguous() or out.numel() * dt.itemsize != end - start:
            raise ValueError(f"HF tensor {name!r} rows {tuple(rows)}: cannot read {shape} {dtype_name(dt)} into a "
                             f"{'contiguous' if out.is_contiguous() else 'strided'} {tuple(out.shape)} "
                             f"{dtype_name(out.dtype)} tensor on {out.device}")
        self._pread(name, start, end, out.detach())
        return out

    def read_columns_into(self, name: str, rows: Tuple[int, int], cols: Tuple[int, int],
                          out: torch.Tensor) -> torch.Tensor:
        """Read ``name[a:b, c:d]`` (a 2-D tensor) into ``out`` (CPU, stored dtype, shape
        ``(b - a, d - c)``, each row contiguous: e.g. a column block of a parameter), one
        positioned read per row -- only those bytes, nothing of the other columns."""
        a, b = int(rows[0]), int(rows[1])
        c, d = int(cols[0]), int(cols[1])
        shape, dt = self._meta[name]
        start, _, _ = self._rows_span(name, (a, b))
        if len(shape) != 2 or not 0 <= c <= d <= shape[1]:
            raise ValueError(f"HF tensor {name!r} of shape {shape}: no columns [{c}, {d})")
        if (out.device.type != "cpu" or out.dtype != dt or tuple(out.shape) != (b - a, d - c)
                or (d > c + 1 and out.stride(1) != 1)):
            raise ValueError(f"HF tensor {name!r}: cannot read [{a}:{b}, {c}:{d}] into a {tuple(out.shape)} "
                             f"{dtype_name(out.dtype)} tensor on {out.device}")
        row_bytes, item = int(shape[1]) * dt.itemsize, dt.itemsize
        out = out.detach()
        for i in range(b - a):
            first = start + i * row_bytes + c * item
            self._pread(name, first, first + (d - c) * item, out[i])
        return out

    def copy_to_safetensors(self, names: List[str], out, chunk_bytes: int = 64 << 20) -> int:
        """Write tensors ``names`` (this reader's names) under their stored names as one
        safetensors file ``out``, their bytes copied from the files as they are (bit for bit, never
        a whole tensor in memory: ``chunk_bytes`` at a time); written to ``out.part`` and renamed
        when complete. Returns the tensor bytes copied."""
        header, offset = {}, 0
        for name in names:
            shape, dt = self._meta[name]
            start, end = self._span[name]
            header[self.stored_name(name)] = {"dtype": SAFETENSORS_NAMES[dt], "shape": list(shape),
                                              "data_offsets": [offset, offset + end - start]}
            offset += end - start
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # (the data starts 8-byte aligned, as safetensors writes it)
        out = Path(out)
        part = out.with_name(out.name + ".part")
        with open(part, "wb") as dst:
            dst.write(len(raw).to_bytes(8, "little") + raw)
            for name in names:
                start, end = self._span[name]
                src = self._handles.get(self._file_of[name])
                if src is None:
                    src = self._handles[self._file_of[name]] = open(self._file_of[name], "rb")
                src.seek(start)
                left = end - start
                while left:
                    block = src.read(min(left, chunk_bytes))
                    if not block:
                        raise ValueError(f"HF tensor {self.stored_name(name)!r}: {self._file_of[name].name} is truncated")
                    dst.write(block)
                    left -= len(block)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(part, out)
        return offset

    def meta_tensor(self, name: str) -> torch.Tensor:
        """A ``meta`` stand-in with the stored shape and dtype (no data read)."""
        shape, dt = self._meta[name]
        return torch.empty(shape, dtype=dt, device="meta")

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()


def open_hf_checkpoint(path) -> LazyHFCheckpoint:
    """:class:`LazyHFCheckpoint` of ``path`` in the text model's names: its ``config.json``'s family
    says how its checkpoints name their tensors (:func:`megatron_tepo.models.checkpoint_naming`; a
    published Qwen3.5 keeps the text model under ``model.language_model.``); a directory without a
    ``config.json`` is read as stored."""
    from megatron_tepo.models import checkpoint_naming

    config = Path(path) / "config.json"
    if not config.is_file():
        return LazyHFCheckpoint(path)
    try:
        raw = json.loads(config.read_text())
    except ValueError as exc:
        raise ValueError(f"{config}: not valid JSON ({exc})") from None
    try:
        naming = checkpoint_naming(raw)
    except ValueError as exc:
        raise in_config_file(exc, config) from None
    return LazyHFCheckpoint(path, naming=naming)


def in_config_file(exc: ValueError, config) -> ValueError:
    """``exc`` (a config error, which may start with ``config.json:``) naming the file ``config``."""
    msg = str(exc)
    msg = msg[len("config.json: "):] if msg.startswith("config.json: ") else msg
    return ValueError(f"{config}: {msg}")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def hf_layer_index(name: str) -> Optional[int]:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def streaming_order(names: Iterable[str]) -> List[str]:
    """Embedding first, then layer by layer (stored order inside a layer), then the rest."""
    names = list(names)
    pos = {n: i for i, n in enumerate(names)}

    def key(n):
        layer = hf_layer_index(n)
        if n == "model.embed_tokens.weight":
            return (0, 0, pos[n])
        if layer is not None:
            return (1, layer, pos[n])
        return (2, 0, pos[n])

    return sorted(names, key=key)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
class ShardedSafetensorsWriter:
    """Accumulate tensors up to ``max_shard_bytes``, write each shard, then the index."""

    def __init__(self, out_dir, max_shard_bytes: int = 2 * 1024 ** 3):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = int(max_shard_bytes)
        self._buf: Dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._shards: List[List[str]] = []
        self._total = 0
        self._names: set = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"HF tensor {name!r} written twice")
        self._names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buf[name] = tensor.detach().contiguous()
        self._buf_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        i = len(self._shards)
        save_file(self._buf, str(self.out_dir / f"shard-{i:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._buf))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> Dict[str, str]:
        """Write the last shard, give shards their final names, write the index; returns weight_map."""
        if self._buf or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / f"shard-{i:05d}.tmp", self.out_dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
        return weight_map


def copy_side_files(src, dst) -> List[str]:
    """Copy every regular non-weight file (config, generation config, tokenizer, chat template)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json"):
            continue
        shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied


# ---------------------------------------------------------------------------------------------
# validation against the config
# ---------------------------------------------------------------------------------------------
def load_hf_config(hf_dir):
    """The transformers config of a directory (local files only)."""
    import transformers

    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return transformers.AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)


def expected_hf_tensors(hf_config) -> Dict[str, Tuple[int, ...]]:
    """Checkpoint names -> shapes of the transformers model for ``hf_config`` (built on meta).

    A tied ``lm_head.weight`` is left out (``save_pretrained`` does not store it)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    shapes = checkpoint_shapes({k: tuple(v.shape) for k, v in model.state_dict().items()})
    if getattr(hf_config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def checkpoint_shapes(shapes: Dict[str, Tuple[int, ...]]) -> Dict[str, Tuple[int, ...]]:
    """In-memory names/shapes -> the names/shapes the mapping uses. transformers >= 5 keeps MoE
    experts stacked in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], gate first;
    ``mlp.experts.down_proj`` [E, H, I]: :func:`~megatron_tepo.models.names.unstack_experts`);
    ``save_pretrained`` stores one tensor per expert (``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``),
    the names the mapping uses and a reader of a stacked checkpoint gives."""
    from megatron_tepo.models.names import unstack_experts

    out: Dict[str, Tuple[int, ...]] = {}
    for name, shape in shapes.items():
        pieces = unstack_experts(name, shape)
        if pieces is None:
            out[name] = shape
        for piece, _, (a, b) in pieces or ():
            out[piece] = (b - a, shape[2])
    return out


def check_hf_tensors(ckpt: LazyHFCheckpoint, hf_config) -> None:
    """Every expected tensor present with its config shape, nothing unexpected (a tied
    ``lm_head.weight`` copy is tolerated). ValueError naming the culprits otherwise."""
    expected = expected_hf_tensors(hf_config)
    names = set(ckpt.names())
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    missing = [n for n in expected if n not in names]
    unexpected = [n for n in ckpt.names() if n not in expected and not (tied and n == "lm_head.weight")]
    wrong = [f"{n}: {tuple(ckpt.shape(n))} but the config implies {expected[n]}"
             for n in ckpt.names() if n in expected and tuple(ckpt.shape(n)) != expected[n]]
    errors = []
    if missing:
        errors.append(f"missing HF tensor(s) {missing[:8]}" + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if unexpected:
        errors.append(f"unexpected HF tensor(s) {unexpected[:8]}" + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))
    if wrong:
        errors.append("wrong shape: " + "; ".join(wrong[:8]))
    if errors:
        raise ValueError(f"HF checkpoint {ckpt.path} does not match its config.json: " + " | ".join(errors))
