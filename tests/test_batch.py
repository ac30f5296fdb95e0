"""The one batch type (megatron_tepo/batch.py): built from the engine's groups with the engine's
log-probs, split for data parallelism as tensors, the sampling temperature carried along."""
import json
import subprocess
import sys

import pytest
import torch

from megatron_tepo.batch import RolloutBatch
from megatron_tepo.rollout.engine import Sample


def _groups():
    prompts = [[5, 6, 7], [8]]
    groups = [[Sample([1, 2], [-0.5, -1.0], "stop"), Sample([3], [-0.25], "stop")],
              [Sample([4, 4, 4], [-0.1, -0.2, -0.3], "length"), Sample([], [], "stop")]]
    return prompts, groups


def test_from_groups_carries_the_engine_log_probs_and_the_temperature():
    prompts, groups = _groups()
    b = RolloutBatch.from_groups(prompts, groups, pad_id=0, advantages=torch.tensor([1.0, -1.0, 0.5, 2.0]),
                                 temperature=0.7)
    assert b.input_ids.tolist() == [[5, 6, 7, 1, 2, 0], [5, 6, 7, 3, 0, 0], [8, 4, 4, 4, 0, 0], [8, 0, 0, 0, 0, 0]]
    assert b.prompt_lens.tolist() == [3, 3, 1, 1]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert b.rollout_log_probs.tolist() == [[-0.5, -1.0, 0], [-0.25, 0, 0], pytest.approx([-0.1, -0.2, -0.3]),
                                            [0, 0, 0]]
    assert b.advantages.tolist() == [[1, 1, 0], [-1, 0, 0], [0.5, 0.5, 0.5], [0, 0, 0]]
    assert b.temperature == 0.7


def test_the_data_parallel_split_and_padding_keep_every_field():
    prompts, groups = _groups()
    b = RolloutBatch.from_groups(prompts, groups, pad_id=0, advantages=torch.arange(4.0), temperature=0.5)
    b.old_log_probs = b.rollout_log_probs + 0.01
    half = b.select(range(1, 4, 2))  # rank 1 of 2: rows 1 and 3
    assert half.temperature == 0.5 and half.batch_size == 2
    assert torch.equal(half.rollout_log_probs, b.rollout_log_probs[[1, 3]])
    assert torch.equal(half.old_log_probs, b.old_log_probs[[1, 3]])
    grown = half.padded(3, 9)
    assert grown.temperature == 0.5 and grown.rollout_log_probs.shape == (3, 3)
    assert grown.rollout_log_probs[2].abs().sum() == 0
    assert torch.equal(b.split_for_data_parallel(0, 2).rollout_log_probs, b.rollout_log_probs[[0, 2]])
    assert torch.equal(b.split_for_data_parallel(1, 2).old_log_probs, half.old_log_probs)


def test_each_ranks_k_th_mini_batch_holds_rows_of_the_k_th_global_one():
    """The trainer cuts every rank's share into mini-batches of ``rows / dp`` consecutive rows."""
    b = RolloutBatch.from_groups([[row + 1] for row in range(12)], [[Sample([1], [0.0], "stop")]] * 12, pad_id=0)
    dp, global_mb = 3, 6
    for rank in range(dp):
        share = b.split_for_data_parallel(rank, dp)
        assert share.batch_size == 4
        for k in range(2):
            rows = share.input_ids[k * 2:(k + 1) * 2, 0] - 1  # (the prompt token names the row)
            assert all(k * global_mb <= int(r) < (k + 1) * global_mb for r in rows), (rank, k, rows)
    uneven = b.select(range(5))
    assert [uneven.split_for_data_parallel(r, 2).batch_size for r in range(2)] == [3, 2]
    with pytest.raises(ValueError, match="dp_rank 2"):
        b.split_for_data_parallel(2, 2)


def test_bad_batches_name_the_field():
    prompts, groups = _groups()
    with pytest.raises(ValueError, match="advantages must be 1-D|response_mask must be"):
        RolloutBatch.from_groups(prompts, groups, pad_id=0, advantages=torch.zeros(3))
    b = RolloutBatch.from_groups(prompts, groups, pad_id=0)
    with pytest.raises(ValueError, match="rollout_log_probs must match response_mask's shape"):
        RolloutBatch(b.input_ids, b.prompt_lens, b.response_mask, rollout_log_probs=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="temperature must be a number > 0"):
        RolloutBatch(b.input_ids, b.prompt_lens, b.response_mask, temperature=0.0)
    with pytest.raises(ValueError, match="at least one sample"):
        RolloutBatch.from_groups([], [], pad_id=0)


def test_the_batch_module_knows_nothing_of_megatron_or_the_engines():
    code = "import json, sys; import megatron_tepo.batch; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "megatron_tepo.batch" in modules
    assert [m for m in modules if m == "megatron" or m.startswith(("megatron.", "megatron_tepo.actor",
                                                                    "megatron_tepo.rollout", "sglang"))] == []
