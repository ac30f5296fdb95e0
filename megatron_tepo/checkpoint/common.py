"""What HF -> Megatron (:mod:`.hf_to_megatron`) and Megatron -> HF (:mod:`.megatron_to_hf`)
conversion share: the process group they run in, the rank-agreeing error handling of a collective
step, the guarded output directory, progress lines, and this rank's model stage.

* :func:`ensure_process_group` -- torchrun's world, or a 1-process gloo world.
* :func:`agree` -- run a step on every rank; an error anywhere is raised on every rank (naming it).
* :func:`check_out_dir` / :func:`tmp_dir_for` / :func:`finalize_dir` -- output is written to
  ``<out>.tmp-<pid>`` and renamed to ``<out>`` when complete; an existing ``<out>`` is refused
  unless ``force``.
* :func:`build_model` / :func:`load_checkpoint_into` -- this rank's stage of the model (on
  :mod:`megatron_tepo.megatron.gpt`: megatron's ``HybridModel`` or ``GPTModel``, as
  ``model_builder`` resolves; a checkpoint's keys are its builder's, so the exporter builds what
  the sidecar records) and a converted checkpoint loaded into it (the tests use it; it is
  :func:`megatron_tepo.megatron.dist_checkpoint.load_checkpoint_into`, answered here too). The
  rank's stage is read from megatron's ``parallel_state`` through :mod:`megatron_tepo.megatron.parallel`.
* :func:`read_config_json`, :func:`log_progress`, :func:`trim_heap`.

Left out: anything of one direction only, and the HF <-> Megatron mapping itself (that is
:mod:`megatron_tepo.models`).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_tepo.megatron.dist_checkpoint import load_checkpoint_into
from megatron_tepo.megatron.parallel import (parallel_sizes, pipeline_ends, raise_if_any_rank_failed,
                                            single_process_env)

__all__ = ["ensure_process_group", "agree", "check_out_dir", "finalize_dir", "tmp_dir_for", "read_config_json",
           "log_progress", "trim_heap", "build_model", "build_gpt_model", "load_checkpoint_into"]


def log_progress(msg: str, progress: bool = True) -> None:
    if progress and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"[convert] {msg}", file=sys.stderr, flush=True)


def ensure_process_group() -> None:
    """Join torchrun's world, or start a 1-process gloo world when not launched by torchrun."""
    if dist.is_initialized():
        return
    single_process_env()
    dist.init_process_group("gloo")


def agree(fn: Callable, *args, **kwargs):
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank (no rank hangs in a
    later collective). The message names the rank(s) and the original error."""
    result, err = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- re-raised below on every rank
        err = e
    raise_if_any_rank_failed(err, "conversion")
    return result


def check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise FileExistsError(f"output {out} already exists (pass --force / force=True to replace it)")


def finalize_dir(tmp: Path, out: Path, force: bool) -> None:
    """Atomically put ``tmp`` at ``out`` (replacing an old ``out`` only when ``force``)."""
    old = None
    if out.exists():
        check_out_dir(out, force)
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def tmp_dir_for(out: Path) -> Path:
    return out.with_name(f"{out.name}.tmp-{os.getpid()}")


def read_config_json(config_dir) -> dict:
    """``config_dir/config.json`` as a dict (no transformers)."""
    path = Path(config_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return json.loads(path.read_text())


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere). Without
    it the per-tensor read buffers (below glibc's dynamic mmap threshold, so on the heap) leave
    a fragmented heap that grows with the model (measured: 1.17 GiB instead of 0.64 GiB RSS for a
    1.9 GiB model)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def build_model(family_cfg, params_dtype: torch.dtype = torch.float32, initialize: bool = True,
                model_builder: str = "auto"):
    """This rank's pipeline stage of the model for ``family_cfg`` (``model_builder``: ``auto``,
    ``hybrid`` or ``gpt``, as ``actor.model_builder``), with the actor's CPU-safe runtime flags.
    Needs megatron's ``parallel_state`` initialised (TP/PP read from it).
    ``initialize=False`` skips megatron's init -- and with it the ``tensor_model_parallel`` /
    ``partition_dim`` / ``partition_stride`` attributes that ``megatron.sharding`` places by, so it
    is only right at TP=1 or when loading through ``sharded_state_dict`` (which does not use
    them); it is what the meta-device export model uses."""
    import dataclasses

    from megatron_tepo.megatron.gpt import build_chunk, transformer_config
    from megatron_tepo.megatron.resolve import FP32_ACTOR, resolve_model_builder

    actor = dataclasses.replace(FP32_ACTOR, model_builder=resolve_model_builder(model_builder))
    config = transformer_config(family_cfg, **parallel_sizes(), actor=actor, params_dtype=params_dtype,
                                initialize=initialize)
    model = build_chunk(config, family_cfg, *pipeline_ends(), actor=actor)
    model.model_builder = actor.model_builder  # what the sidecar records
    return model


def build_gpt_model(family_cfg, params_dtype: torch.dtype = torch.float32, initialize: bool = True):
    """:func:`build_model` of a ``GPTModel`` (the name callers used before the hybrid builder)."""
    return build_model(family_cfg, params_dtype, initialize, model_builder="gpt")
