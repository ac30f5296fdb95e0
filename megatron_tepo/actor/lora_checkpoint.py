"""What a LoRA actor's checkpoint holds (``actor.lora``): the adapters, their optimizer state and
a reference to the frozen base, not the base itself.

A LoRA actor built from an HF checkpoint folder (``hf_weights``: a directory, or an open
:class:`~megatron_tepo.checkpoint.hf_io.LazyHFCheckpoint`) remembers where its base came from
(:func:`base_reference`: the folder's absolute path and a :func:`fingerprint` of its weight files).
Its checkpoints (:mod:`megatron_tepo.actor.checkpointing`) then save only the adapters of the
model's ``sharded_state_dict`` (:func:`adapters_only`) beside the optimizer, scheduler and RNG
states, and write :data:`BASE_FILE` (``lora_base.json``: ``{"base": {"path", "fingerprint"}}``).
A load reads it, refuses a base whose fingerprint changed since (:func:`check_base`: one line
naming the folder and the first file that differs), loads the base from that folder when the actor
holds another one (:func:`load_base_into`: a fresh actor on a random base, or built from another
folder; skipped when the actor was built from the same folder, the trainer's case), and then the
adapters.

A base that cannot be referenced -- megatron's random init, an in-memory state dict (the tests) --
is saved in full as before, and ``lora_base.json`` says so (``{"base": null, "saved_in_full":
true, "why": ...}``).

The fingerprint is a spot check, not a hash of the whole base (which would read every byte of a
14B model at every start): for each weight file (``*.safetensors``, ``pytorch_model*.bin``, their
index) its size and the SHA-256 of its first and last MiB (a safetensors file's header -- names,
shapes, offsets -- and its first and last tensors' bytes). A re-saved or re-quantised base changes
it; an edit inside a file that keeps its size and both ends does not.

Left out: a base on an object store, a base given as an in-memory state dict (saved in full), the
converters of a checkpoint to HF (``checkpoint/megatron_to_hf.py``), which read the base from the
checkpoint and so need a LoRA checkpoint's base folder beside it (not built).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Optional

from megatron_tepo.checkpoint.store import CheckpointError

__all__ = ["BASE_FILE", "base_reference", "fingerprint", "adapters_only", "read_base_file", "base_file_text",
           "check_base", "load_base_into", "NOT_REFERENCED"]

BASE_FILE = "lora_base.json"
_SPOT = 1 << 20  # the bytes hashed at each end of a weight file
NOT_REFERENCED = ("the base was not loaded from an HF checkpoint folder (random init, or an in-memory state "
                  "dict), so it cannot be referenced: saved in full")


def _weight_files(path: Path):
    return sorted(p for p in path.iterdir() if p.is_file() and (
        p.suffix == ".safetensors" or (p.name.startswith("pytorch_model") and p.suffix == ".bin")
        or p.name.endswith(".index.json")))


def fingerprint(path) -> Dict[str, list]:
    """``{file name: [size, sha256 of its first and last MiB]}`` of the weight files of the HF folder
    ``path`` (see the module docstring)."""
    out = {}
    for f in _weight_files(Path(path)):
        size = f.stat().st_size
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            h.update(fh.read(_SPOT))
            if size > _SPOT:
                fh.seek(max(_SPOT, size - _SPOT))
                h.update(fh.read(_SPOT))
        out[f.name] = [size, h.hexdigest()]
    return out


def base_reference(source) -> Optional[Dict[str, Any]]:
    """``{"path", "fingerprint"}`` of the HF safetensors folder ``source`` (the actor's ``hf_weights``:
    a path, or an open lazy reader with a ``path``); None for anything else (a state dict, None)."""
    path = getattr(source, "path", source)
    if not isinstance(path, (str, Path)) or not Path(path).is_dir() or not any(Path(path).glob("*.safetensors")):
        return None  # (pytorch_model*.bin pickles cannot be read in slices: such a base is saved in full)
    path = Path(path).absolute()
    return {"path": str(path), "fingerprint": fingerprint(path)}


def adapters_only(model_sd: Dict[str, Any]) -> Dict[str, Any]:
    """The adapters' entries (``*.lora_A`` / ``*.lora_B``) of a model's ``sharded_state_dict``."""
    return {k: v for k, v in model_sd.items() if k.rsplit(".", 1)[-1] in ("lora_A", "lora_B")}


def base_file_text(reference: Optional[Dict[str, Any]]) -> str:
    """The text of :data:`BASE_FILE` for a checkpoint whose base is ``reference`` (None: saved in full)."""
    if reference is None:
        return json.dumps({"base": None, "saved_in_full": True, "why": NOT_REFERENCED}, sort_keys=True)
    return json.dumps({"base": reference, "saved_in_full": False}, sort_keys=True)


def read_base_file(directory) -> Optional[Dict[str, Any]]:
    """The base reference a checkpoint in ``directory`` holds; None where it holds its base (a
    full-parameter checkpoint, or a LoRA one whose base was saved in full)."""
    f = Path(directory) / BASE_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text()).get("base")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None


def check_base(directory, reference: Dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` (one line) when the base folder that the checkpoint in
    ``directory`` references is gone or its fingerprint changed since the save."""
    path = Path(reference["path"])
    if not path.is_dir():
        raise CheckpointError(f"{directory}: its LoRA base {path} (the checkpoint holds the adapters only) is not "
                              f"there; put the base back at that path")
    now, then = fingerprint(path), reference["fingerprint"]
    if now != then:
        differs = sorted(set(now) ^ set(then)) or sorted(n for n in now if now[n] != then[n])
        raise CheckpointError(f"{directory}: its LoRA base {path} changed since the save ({differs[0]} differs: "
                              f"size or first / last MiB); the adapters were trained on the old base, resume "
                              f"with it")


def load_base_into(train_model, reference: Dict[str, Any]) -> None:
    """Fill the frozen base of ``train_model``'s chunks from the HF folder ``reference`` names, each
    rank reading its own slices (the adapters untouched); ``train_model.lora_base`` becomes it."""
    from megatron_tepo.checkpoint.hf_io import open_hf_checkpoint
    from megatron_tepo.megatron.hf_load import load_hf_checkpoint_into
    from megatron_tepo.megatron.lora import is_adapter
    from megatron_tepo.megatron.sharding import unwrap_model

    ckpt = open_hf_checkpoint(reference["path"])
    try:
        load_hf_checkpoint_into([unwrap_model(c) for c in train_model.model], ckpt, train_model.family_cfg,
                                select=lambda p: not is_adapter(p))
    finally:
        ckpt.close()
    train_model.lora_base = reference
