"""Every process group waits longer than the watchdog allows its longest phase (issue #32 row 4).

The NCCL groups kept torch's 10-minute default and the driver's gloo group its 30 minutes while the
watchdog allows a rollout 7200 s: a follower waiting in the driver's broadcast through a long
rollout died with a gloo time-out, and a slow checkpoint or a sync behind a restarting server was
aborted by NCCL before the watchdog could name the phase and requeue. Now the time-out comes from
the watchdog's settings (``FaultConfig.process_group_timeout_s``) and is set where each group is
made: torch's default group and megatron's groups (``initialize_parallel``), the driver's gloo
group (``Driver``), the weight sync's group to the servers (``DistributedSync``). Read back from the groups themselves, at TP=2 over gloo.
"""
import json
from pathlib import Path

import pytest

from megatron_tepo.config import UNWATCHED_PG_TIMEOUT_S, FaultConfig
from megatron_tepo.trainer.watchdog import BACKSTOP_GRACE_S, process_group_timeout_s
from tests.dist_utils import torchrun

WORKER = Path(__file__).parent / "group_timeout_worker.py"


def test_the_rule_outlasts_the_longest_watched_phase():
    default = FaultConfig()
    t = process_group_timeout_s(default)
    assert t > max(default.watchdog_generate_s, default.watchdog_collective_s, default.watchdog_sync_s) + BACKSTOP_GRACE_S
    assert process_group_timeout_s(FaultConfig(watchdog_sync_s=9000.0)) > 9000.0 + BACKSTOP_GRACE_S
    # a phase nobody watches may last any time: the groups wait for a week
    assert process_group_timeout_s(FaultConfig(watchdog_generate_s=0.0)) == UNWATCHED_PG_TIMEOUT_S


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_every_group_has_the_watchdogs_time_out(tmp_path):
    fault = {"watchdog_generate_s": 5400.0, "watchdog_collective_s": 900.0, "watchdog_sync_s": 1200.0}
    results = torchrun(WORKER, 2, json.dumps(fault), tmp_path=tmp_path, timeout=280)
    for r in results:
        wanted = r["wanted"]
        assert wanted > 5400.0 + BACKSTOP_GRACE_S
        assert set(r["timeouts"]) == {"default", "tensor", "pipeline", "data", "model", "driver"}
        for name, seconds in r["timeouts"].items():
            # megatron takes whole minutes: at most 59 s more than asked, never less
            assert wanted <= seconds < wanted + 60, (name, seconds, wanted)


def test_the_weight_syncs_group_gets_the_same_time_out():
    """The sender's side of the distributed weight sync's group (``rollout.sync_mode: distributed``)
    waits as long as the trainer's groups: the watchdog's ``sync`` phase fires first."""
    from megatron_tepo.config import from_dict
    from megatron_tepo.rollout.sglang.attach import weight_sync

    cfg = from_dict({"rollout": {"sync_mode": "distributed"}, "fault": {"watchdog_sync_s": 4000.0}})
    sync = weight_sync(cfg.rollout, None, ["http://127.0.0.1:30000"], False, cfg.fault)
    assert sync.group_timeout_s == cfg.fault.process_group_timeout_s() > 4000.0 + BACKSTOP_GRACE_S
