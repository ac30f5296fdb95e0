"""One process: an asynchronous save through a writer (#50 row 2) -- ``ROOT [WRITER]``, ``nvrx`` by
default, ``mcore`` or ``auto`` -- with the trainer's allocator (expandable segments: on a GPU the
process is started with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; on CPU the choice is
made as on such a GPU). Records the writer and how the tensors reached it (its staging, and what
reached NVRx's ``FileSystemWriterAsync``: ``use_cpu_shm_for_gpu_tensors``), whether the save was
published, and whether a fresh actor loads it bit for bit: ``ROOT/staging.json`` (the GPU check's
``async_save`` step runs it too)."""
import functools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from tests.megatron.helpers import hf_state, make_batch, make_hf_model, tiny_hf_config


def _actor(weights):
    from megatron_tepo.actor import MegatronActor

    return MegatronActor(tiny_hf_config("qwen3"), hf_weights=weights, precision="fp32", attention="sdpa",
                         packed_attention="loop")


def main():
    from megatron_tepo.actor.checkpointing import AsyncSaves, choose_async_writer
    from megatron_tepo.algorithms import PolicyLoss
    from megatron_tepo.megatron.parallel import single_process_env

    root, wanted = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "nvrx")
    seen = []
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
    except ImportError:  # (megatron-core's own writer: nothing of NVRx to record)
        filesystem_async = None
    if filesystem_async is not None:
        init = filesystem_async.FileSystemWriterAsync.__init__

        @functools.wraps(init)  # (its signature stays the one the choice reads)
        def record(self, *args, **kwargs):
            seen.append({"use_cpu_shm_for_gpu_tensors": kwargs.get("use_cpu_shm_for_gpu_tensors", False)})
            init(self, *args, **kwargs)

        filesystem_async.FileSystemWriterAsync.__init__ = record
    single_process_env()
    actor = _actor(hf_state(make_hf_model(tiny_hf_config("qwen3"), seed=0)))
    batch = make_batch(seed=1)
    batch.old_log_probs = -2.0 * batch.response_mask
    actor.train_step(batch, PolicyLoss.of("grpo"))
    # the trainer's allocator: read on a GPU (the process's PYTORCH_CUDA_ALLOC_CONF), as on one on CPU
    forced = {} if torch.cuda.is_available() else {"expandable": True, "on_gpu": True}
    writer = choose_async_writer(wanted=wanted, **forced)
    actor._async_saves = AsyncSaves(writer)
    actor.save_checkpoint(root / "step_1", {"step": 1}, asynchronous=True)
    want = {n: p.detach().clone() for n, p in actor.model[0].named_parameters()}
    actor.finalize_checkpoints(blocking=True)
    fresh = _actor(None)
    fresh.load_checkpoint(root / "step_1")
    got = dict(fresh.model[0].named_parameters())
    (root / "staging.json").write_text(json.dumps({
        "writer": [writer.name, writer.staging], "why": writer.why, "writer_kwargs": seen,
        "device": str(next(actor.model[0].parameters()).device),
        "published": (root / "step_1" / "complete").is_file(),
        "params_equal": sorted(want) == sorted(got) and all(torch.equal(want[n], got[n].detach()) for n in want)}))
    actor._async_saves.close()


if __name__ == "__main__":  # (dist_checkpointing starts processes)
    main()
