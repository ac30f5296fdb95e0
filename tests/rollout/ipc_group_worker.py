"""The ``ipc`` weight sync as the trainer builds it on every rank (torchrun, gloo, 2 processes:
``megatron_tepo/rollout/sglang/attach.py``'s ``weight_sync``): which process group carries its
per-bucket messages. Writes ``{"backend", "default", "size"}`` per rank."""
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.dist_utils import write_result  # noqa: E402


def main():
    import torch.distributed as dist

    from megatron_tepo.config import FaultConfig, RolloutConfig
    from megatron_tepo.rollout.sglang.attach import weight_sync

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ws = weight_sync(RolloutConfig(engine="sglang", sync_mode="ipc", colocated=True), None,
                     ["http://127.0.0.1:30000"], rank == 0, FaultConfig())
    write_result({"backend": dist.get_backend(ws.group) if ws.group is not None else None,
                  "default": ws.group is None or ws.group == dist.group.WORLD,
                  "size": dist.get_world_size(ws.group)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
