"""A launch file's rollout servers (issue #33 point 3): ``launch.rollout`` names its engine and holds
its options; the old ``launch.sglang`` section (the example launch files' form) still loads, as the
options of ``engine: sglang``, to the same layout and the same serve command; errors name the
section the file used, and its line."""
from pathlib import Path

import pytest
import yaml

from megatron_tepo.config import ConfigError
from megatron_tepo.launch import load_launch, serve_args, shell_vars
from megatron_tepo.launch.engines import SERVED_ENGINES

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"


def _rewrite(tmp_path, name, edit):
    """examples/models/<name>.yaml with its launch section changed by ``edit`` (paths made absolute)."""
    data = yaml.safe_load((MODELS / f"{name}.yaml").read_text())
    data["_base_"] = str((MODELS / data["_base_"]).resolve())
    edit(data["launch"])
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _new_form(launch):
    launch["rollout"] = {"engine": "sglang", **launch.pop("sglang")}


@pytest.mark.parametrize("name", ["qwen3_14b", "tiny_cpu"])
def test_the_new_section_and_the_old_one_load_the_same(tmp_path, name):
    old, new = load_launch(MODELS / f"{name}.yaml"), load_launch(_rewrite(tmp_path, name, _new_form))
    assert "sglang" in yaml.safe_load((MODELS / f"{name}.yaml").read_text())["launch"]  # the old form
    assert (old.launch.rollout.key, new.launch.rollout.key) == ("launch.sglang", "launch.rollout")
    assert new.launch.rollout.engine == "sglang" and new.launch.rollout.server == old.launch.rollout.server
    assert (new.launch.rollout.port, new.launch.rollout.servers_per_node) == (old.launch.rollout.port,
                                                                            old.launch.rollout.servers_per_node)
    assert serve_args(new) == serve_args(old) and shell_vars(new) == shell_vars(old)


def test_errors_name_the_section_the_file_used(tmp_path):
    path = _rewrite(tmp_path, "qwen3_14b", _new_form)
    with pytest.raises(ConfigError, match=r"launch.rollout.tp: 3 must be >= 1 and divide launch.gpus_per_node"):
        load_launch(path, ["launch.rollout.tp=3"])
    with pytest.raises(ConfigError, match=r"launch.rollout.mem_fraction_static: must be in \(0, 1\], got 1.5"):
        load_launch(path, ["launch.rollout.mem_fraction_static=1.5"])
    with pytest.raises(ConfigError, match=r"launch.rollout.tpp \(.*qwen3_14b.yaml:\d+\): unknown key in section "
                                          r"'launch.rollout'; did you mean tp"):
        load_launch(_rewrite(tmp_path, "qwen3_14b", lambda L: L.update(rollout={"engine": "sglang", "tpp": 2})
                             or L.pop("sglang")))


def test_an_unknown_engine_and_two_sections_are_refused(tmp_path):
    path = _rewrite(tmp_path, "qwen3_14b", lambda L: L.update(rollout={"engine": "vllm", "tp": 2}) or L.pop("sglang"))
    with pytest.raises(ConfigError, match=r"launch.rollout.engine \(.*qwen3_14b.yaml:\d+\): expected one of "
                                          r"'sglang', found 'vllm'"):
        load_launch(path)
    assert list(SERVED_ENGINES) == ["sglang"]
    both = _rewrite(tmp_path, "qwen3_14b", lambda L: L.update(rollout={"engine": "sglang"}))
    with pytest.raises(ConfigError, match="launch.sglang: the old name of launch.rollout .*give one of the two"):
        load_launch(both)
    with pytest.raises(ConfigError, match=r"launch.sglang.engine .*unknown key in section 'launch.sglang'"):
        load_launch(MODELS / "qwen3_14b.yaml", ["launch.sglang.engine=sglang"])
