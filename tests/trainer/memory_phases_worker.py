"""Colocated mode's memory phases on 2 processes (torchrun, gloo), with a stand-in actor and engine:
rank 1's offload is made slow (``"slow_s"``), and each rank records when its offload returned and
the driver when the engine's resume of its weights and of its cache began (``time.time()``, one
machine). The phases are the trainer's own (``trainer/step.py``), on a minimal run.

    torchrun --nproc-per-node 2 tests/trainer/memory_phases_worker.py '{"slow_s": 1.5}'
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.dist_utils import write_result  # noqa: E402
from tests.fakes import FakePolicy  # noqa: E402


class Actor(FakePolicy):
    def __init__(self, slow_s: float):
        super().__init__()
        self.slow_s, self.offload_done = slow_s, None

    def offload(self, parts):
        time.sleep(self.slow_s)  # copying the optimizer to host memory takes this rank a while
        self.offloaded, self.offload_done = tuple(parts), time.time()
        return 1 << 20

    def onload(self):
        self.offloaded = ()
        return 1 << 20


class Engine:
    def __init__(self):
        self.resumed = []

    def resume_memory(self, tags):
        self.resumed.append((tuple(tags), time.time()))

    def release_memory(self, tags):
        pass


def main(args):
    import torch.distributed as dist

    from megatron_tepo.trainer.driver import Driver
    from megatron_tepo.trainer.step import Step, offload_actor, resume_engine_cache, resume_engine_weights
    from megatron_tepo.trainer.watchdog import Watchdog

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    actor = Actor(args["slow_s"] if rank == 1 else 0.0)
    driver = Driver(timeout_s=60)
    engine = Engine() if driver.is_driver else None
    run = SimpleNamespace(actor=actor, engine=engine, driver=driver, offload_parts=("optimizer", "grads"),
                          watchdog=Watchdog({}, rank=rank, start=False))
    step = Step(1)
    offload_actor(run, step)
    resume_engine_weights(run, step)  # (the sync between them needs the real actor: not here)
    resume_engine_cache(run, step)
    write_result({"offload_done": actor.offload_done, "resumed": engine.resumed if engine else []})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
