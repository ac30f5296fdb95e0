"""The log-prob drift check (megatron_tepo.algorithms.drift): mean / max over the valid tokens,
a warning over either threshold, and the report of drift combined elsewhere."""
import warnings

import pytest
import torch

from megatron_tepo.algorithms import DriftCheck


def test_drift_check_warns():
    with pytest.warns(RuntimeWarning, match="drift"):
        m = DriftCheck(mean_threshold=0.01)([[0.0, -1.0]], [[0.1, -1.0]])
    assert m["rollout/logprob_drift_mean"] == pytest.approx(0.05)
    assert m["rollout/logprob_drift_max"] == pytest.approx(0.1)


def test_mask_and_no_tokens():
    check = DriftCheck(prefix="drift")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = check(torch.tensor([[0.0, -5.0]]), torch.tensor([[0.02, 0.0]]), mask=torch.tensor([[1, 0]]))
        assert m == {"drift_mean": pytest.approx(0.02), "drift_max": pytest.approx(0.02), "drift_tokens": 1}
        assert check([], [], warn=True) == {"drift_mean": 0.0, "drift_max": 0.0, "drift_tokens": 0}
    with pytest.raises(ValueError, match="drift check"):
        check([0.0, 1.0], [0.0])
    with pytest.warns(RuntimeWarning, match="max 2"):
        check.report(0.01, 2.0, 10)
