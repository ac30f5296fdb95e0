"""torchrun worker: the process groups' time-outs as the trainer makes them (issue #32 row 4).

argv[1]: JSON ``fault`` section. The actor is built with ``actor_args`` of a run config with that
section (TP=2 over 2 ranks), the driver's gloo group with the loop's rule; each rank records every
group's time-out in seconds and the time-out the rule asks for.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main():
    from megatron_tepo.actor import MegatronActor
    from megatron_tepo.config import from_dict
    from megatron_tepo.megatron.parallel import group_timeout, group_timeouts
    from megatron_tepo.trainer.loop import Driver
    from megatron_tepo.actor import actor_args
    from megatron_tepo.trainer.watchdog import process_group_timeout_s
    from tests.dist_utils import write_result
    from tests.megatron.helpers import tiny_hf_config

    cfg = from_dict({"fault": json.loads(sys.argv[1]), "parallel": {"tp": 2},
                     "actor": {"precision": "fp32", "attention": "sdpa"}})
    MegatronActor(tiny_hf_config("qwen3"), **actor_args(cfg))
    timeouts = {name: t.total_seconds() for name, t in group_timeouts().items()}
    timeouts["driver"] = group_timeout(Driver(timeout_s=process_group_timeout_s(cfg.fault))._group).total_seconds()
    write_result({"timeouts": timeouts, "wanted": process_group_timeout_s(cfg.fault)})


if __name__ == "__main__":
    main()
