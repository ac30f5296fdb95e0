"""The checkpoint store: the folders of a run's training checkpoints and their lifecycle. No
process group and no model needed; the actor's save and load (:mod:`megatron_tepo.actor.checkpointing`)
and the trainer build on it, and the tools report its :class:`CheckpointError` in one line.

A checkpoint is a folder ``<root>/step_<N>``, complete once its ``complete`` marker (JSON: format,
step, time, layout) exists; that marker is written LAST, into a ``step_<N>.tmp-<id>`` folder that
is then renamed. So a crash leaves a ``*.tmp-*`` folder or a markerless one, never a half
checkpoint that looks whole:

* :func:`read_marker` / :func:`is_complete_checkpoint` -- is this folder a whole checkpoint;
* :func:`list_complete_checkpoints` / :func:`find_latest_checkpoint` -- the whole ones, by step;
* :func:`check_checkpoint_files` -- every file a load reads is there, readable and long enough
  (names the first that is not);
* :func:`prune_checkpoints` / :func:`remove_partial_checkpoints` -- keep the newest N, drop what
  interrupted saves left (global rank 0 deletes);
* :func:`write_file_atomic` / :func:`fsync_dir` -- the durable writes the save uses.

Left out: what is inside the tensors (megatron's ``dist_checkpointing`` and the actor's RNG
states), object stores other than a shared POSIX file system.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

__all__ = [
    "COMPLETE_MARKER", "EXTRA_STATE", "RNG_DIR", "FORMAT", "CheckpointError", "checkpoint_dir_for_step",
    "is_complete_checkpoint", "read_marker", "list_complete_checkpoints", "find_latest_checkpoint",
    "check_checkpoint_files", "prune_checkpoints", "remove_partial_checkpoints", "write_file_atomic", "fsync_dir", "global_rank",
]

COMPLETE_MARKER = "complete"
EXTRA_STATE = "extra_state.json"
RNG_DIR = "rng"
FORMAT = "megatron_tepo.actor_checkpoint/1"
PathLike = Union[str, os.PathLike]
_STEP_DIR = re.compile(r"^step_(\d+)$")



class CheckpointError(RuntimeError):
    """A directory is not a usable (complete, compatible) actor checkpoint."""


# ---------------------------------------------------------------------------------------------
# directory helpers (no process group needed)
# ---------------------------------------------------------------------------------------------
def checkpoint_dir_for_step(root: PathLike, step: int) -> Path:
    return Path(root) / f"step_{int(step)}"


def is_complete_checkpoint(directory: PathLike) -> bool:
    d = Path(directory)
    return d.is_dir() and (d / COMPLETE_MARKER).is_file() and ".tmp-" not in d.name


def read_marker(directory: PathLike) -> Dict[str, Any]:
    """The ``complete`` marker's contents; raises :class:`CheckpointError` naming the directory
    when it is not a complete checkpoint."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} does not exist")
    if ".tmp-" in d.name:
        raise CheckpointError(f"{d} is a temporary (unfinished) checkpoint directory; refusing to load it")
    marker = d / COMPLETE_MARKER
    if not marker.is_file():
        raise CheckpointError(f"{d} has no '{COMPLETE_MARKER}' marker: it is a partial / unfinished "
                              f"checkpoint (the save did not finish); refusing to load it")
    try:
        info = json.loads(marker.read_text())
    except ValueError as e:
        raise CheckpointError(f"{marker} is not valid JSON ({e}); refusing to load {d}") from e
    if info.get("format") != FORMAT:
        raise CheckpointError(f"{marker}: unknown format {info.get('format')!r} (expected {FORMAT!r})")
    return info


def list_complete_checkpoints(root: PathLike) -> List[Path]:
    """Complete ``step_<N>`` directories under ``root``, oldest (smallest N) first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)  # (``step_3.tmp-ab`` does not match)
        if m and is_complete_checkpoint(d):
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def find_latest_checkpoint(root: PathLike) -> Optional[Path]:
    """The complete ``step_<N>`` subdirectory of ``root`` with the largest N, or None.
    Temporary ``*.tmp-*`` directories and directories without the marker are ignored."""
    done = list_complete_checkpoints(root)
    return done[-1] if done else None


def prune_checkpoints(root: PathLike, keep_last: int, remove_partial: bool = False) -> List[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints under ``root``. With
    ``remove_partial`` also delete ``step_*.tmp-*`` leftovers and markerless ``step_*`` directories
    (only safe when no save is in flight). Returns the paths removed. Not a collective: every rank
    may call it, but when a process group is up only global rank 0 deletes."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    done = list_complete_checkpoints(root)
    removed = done[:-keep_last]
    if remove_partial and Path(root).is_dir():
        keep = set(done)
        for d in Path(root).iterdir():
            if d.is_dir() and d.name.startswith("step_") and d not in keep and d not in removed:
                removed.append(d)
    if global_rank() == 0:
        for d in removed:
            shutil.rmtree(d, ignore_errors=True)
    return removed


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_checkpoint_files(directory: PathLike, rank: Optional[int] = None, rng: bool = True) -> None:
    """Raise :class:`CheckpointError` naming the first file of ``directory`` that is missing,
    truncated or unreadable: the marker, ``extra_state.json``, ``rank``'s RNG file (default: this
    rank's), megatron's ``metadata.json`` and ``common.pt`` (where it belongs:
    ``compat.dist_ckpt_common_files``), PyTorch's ``.metadata`` and every data
    file it indexes (each at least as long as the byte ranges it is read at). Reads no tensor data
    besides the small common and RNG files; no process group needed."""
    d = Path(directory)
    read_marker(d)

    def bad(name: str, why: str) -> CheckpointError:
        return CheckpointError(f"{d / name}: {why}")

    for name in (EXTRA_STATE, "metadata.json"):
        try:
            json.loads((d / name).read_text())
        except FileNotFoundError:
            raise bad(name, "missing") from None
        except (OSError, ValueError) as e:
            raise bad(name, f"unreadable ({e})") from None
    rank = global_rank() if rank is None else rank
    from megatron_tepo.megatron.compat import dist_ckpt_common_files

    for name in ([f"{RNG_DIR}/rank{rank}.pt"] if rng else []) + list(dist_ckpt_common_files(d)):
        if not (d / name).is_file():
            raise bad(name, "missing")
        try:
            torch.load(d / name, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 -- a truncated pickle raises EOFError, RuntimeError, ...
            raise bad(name, f"unreadable ({type(e).__name__}: {e})") from None
    if not (d / ".metadata").is_file():
        raise bad(".metadata", "missing")
    try:
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(d)).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise bad(".metadata", f"unreadable ({type(e).__name__}: {e})") from None
    need: Dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for name, size in sorted(need.items()):
        path = d / name
        if not path.is_file():
            raise bad(name, "missing")
        if path.stat().st_size < size:
            raise bad(name, f"truncated ({path.stat().st_size} bytes, {size} needed)")


def remove_partial_checkpoints(root: PathLike) -> List[Path]:
    """Delete what interrupted saves left under ``root`` (``step_*.tmp-*`` folders, ``step_*``
    folders without the marker); only safe when no save is running. Global rank 0 deletes;
    returns what was (or, elsewhere, would be) removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = sorted(d for d in root.iterdir()
                   if d.is_dir() and d.name.startswith("step_") and not is_complete_checkpoint(d))
    if global_rank() == 0:
        for d in stale:
            shutil.rmtree(d, ignore_errors=True)
    return stale
