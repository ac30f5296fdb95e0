"""megatron_tepo.algorithms is pure PyTorch: no megatron, sglang or sibling subpackages."""
import json
import subprocess
import sys


def test_algorithms_import_is_pure():
    code = (
        "import json, sys; import megatron_tepo.algorithms as a; "
        "assert a.compute_policy_loss; print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "megatron_tepo.algorithms.losses" in modules  # the check sees the package's modules
    offenders = [
        m for m in modules
        if m == "megatron" or m.startswith(("megatron.", "sglang", "transformers"))
        or (m.startswith("megatron_tepo.") and not m.startswith("megatron_tepo.algorithms"))
    ]
    assert offenders == []
