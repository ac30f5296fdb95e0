"""The library warnings a user can do nothing about are silenced, each by its message and issuing
module (``megatron_tepo.KNOWN_LIBRARY_WARNINGS``); the same message from elsewhere, and any other
warning, still shows. (A short trainer run prints none of them: tests/trainer/test_user_journey.py.)"""
import os
import subprocess
import sys
import textwrap

CODE = textwrap.dedent("""
    import warnings
    import megatron_tepo  # the filters
    import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs  # warn at import without TE / Apex
    from megatron.core.distributed.fsdp.src.megatron_fsdp import mixed_precision
    for module in ("torch.distributed.checkpoint.default_planner", "user_code"):
        warnings.warn_explicit("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
                               "x.py", 1, module=module)
    warnings.warn("Transformer Engine and Apex are not installed. Falling back to mine", UserWarning)
    warnings.warn("rollout.max_staleness=1 with algorithm.loss=tepo: watch it", RuntimeWarning)
""")


def test_known_library_warnings_are_silenced_and_others_show():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = [line for line in proc.stderr.splitlines() if "Warning: " in line]
    assert len(shown) == 3, proc.stderr  # the two from this script's own code, and the user-relevant one
    assert shown[0].startswith("x.py:1: FutureWarning: Please use DTensor")
    assert "<string>:9: UserWarning: Transformer Engine and Apex are not installed. Falling back to mine" in shown[1]
    assert "RuntimeWarning: rollout.max_staleness=1" in shown[2]
