"""Packaging: megatron-core is part of the base install, the documented tools are console commands,
and a missing optional package is one line naming the extra that installs it."""
import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = {"mtepo-train", "mtepo-evaluate", "mtepo-convert-hf-to-megatron", "mtepo-convert-megatron-to-hf",
            "mtepo-fit-check", "mtepo-plot-metrics"}


def test_megatron_core_is_a_base_dependency():
    base = [r for r in md.requires("megatron_tepo") if "extra ==" not in r]
    names = {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip() for r in base}
    assert {"megatron-core", "transformers", "safetensors", "torch", "math-verify"} <= names

def test_megatron_core_range_is_the_tested_one():
    """pyproject.toml's megatron-core range is compat.SUPPORTED (the range both CI stacks test),
    and the installed megatron-core is inside it."""
    import tomllib

    from packaging.requirements import Requirement

    from megatron_tepo.megatron.compat import SUPPORTED, mcore_version

    root = Path(__file__).resolve().parents[1]
    deps = [Requirement(r) for r in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]]
    (mcore,) = [r for r in deps if r.name == "megatron-core"]
    assert mcore.specifier == SUPPORTED, (str(mcore.specifier), str(SUPPORTED))
    assert mcore_version() in SUPPORTED


def test_console_commands_are_installed_and_run():
    eps = {e.name: e for e in md.entry_points(group="console_scripts") if e.name.startswith("mtepo-")}
    assert set(eps) == COMMANDS
    for name, ep in eps.items():
        assert callable(ep.load()), name
    exe = Path(sys.executable).parent / "mtepo-fit-check"
    exe = exe if exe.exists() else shutil.which("mtepo-fit-check")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([str(exe), "--config", str(root / "examples/models/qwen3_14b.yaml")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "fits" in proc.stdout, proc.stderr
    proc = subprocess.run([str(exe), "--config", str(root / "no_such.yaml")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("mtepo-fit-check: error: ")


@pytest.mark.parametrize("module, extra", [("nemo_run", "nemorun"), ("sglang.srt", "sglang"),
                                           ("transformer_engine.pytorch", "gpu")])
def test_a_missing_optional_package_names_its_extra(module, extra, capsys):
    from megatron_tepo.cli import user_errors

    with pytest.raises(SystemExit) as exit_:
        with user_errors("tool"):
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert f"pip install 'megatron_tepo[{extra}]'" in err and module.split(".")[0] in err
