"""A bad launch file is an error naming the key and its line (the run config's own loader)."""
from pathlib import Path

import pytest
import yaml

from megatron_tepo.config import ConfigError
from megatron_tepo.launch import load_launch

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"


def _launch_file(tmp_path, **sections):
    data = {"_base_": str(ROOT / "examples" / "tiny_tepo" / "config.yaml"),
            "architecture": str(MODELS / "tiny_cpu.yaml"), **sections}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("sections,needle", [
    ({"launch": {"device": "cpu", "rollout_nodes": 0, "gpus_per_nodes": 2}},
     r"launch.gpus_per_nodes \(.*bad.yaml:6\): unknown key in section 'launch'; did you mean gpus_per_node"),
    ({"launch": {"device": "cpu", "rollout_nodes": 0, "sglang": {"tp": "2"}}},
     r"launch.sglang.tp \(.*bad.yaml:7\): expected int, found str '2'"),
    ({"launch": {"device": "cpu", "rollout_nodes": 0}, "parallel": {"tpp": 2}},
     r"parallel.tpp \(.*bad.yaml:7\): unknown key in section 'parallel'"),
])
def test_errors_name_the_key_and_its_line(tmp_path, sections, needle):
    with pytest.raises(ConfigError, match=needle):
        load_launch(_launch_file(tmp_path, **sections))


def test_override_errors_name_the_override(tmp_path):
    path = _launch_file(tmp_path, launch={"device": "cpu", "rollout_nodes": 0})
    with pytest.raises(ConfigError, match=r"launch.sglang.port \(override 'launch.sglang.port=x'\): expected int"):
        load_launch(path, ["launch.sglang.port=x"])
    with pytest.raises(ConfigError, match=r"train.stepz \(override 'train.stepz=3'\): unknown key"):
        load_launch(path, ["train.stepz=3"])
