"""A launch file's SGLang settings reach the servers from one place (``launch.spec.serve_args``):
slurm/lib.sh's serve command, the nemo-run launcher's, and what the serve command makes of them;
and a bad launch file is an error naming the key and its line (the run config's own loader)."""
import importlib.util
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from megatron_tepo.config import ConfigError
from megatron_tepo.launch import load_launch, render_shell, serve_args, shell_vars
from megatron_tepo.launch.spec import SERVE_MODULE

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"


def test_serve_module_exists():
    assert serve_args(load_launch(MODELS / "tiny_cpu.yaml"))[:2] == ["-m", SERVE_MODULE]
    assert importlib.util.find_spec(SERVE_MODULE) is not None


@pytest.mark.parametrize("name,device_args", [
    ("qwen3_14b", ["--context-length", "10240"]),
    ("qwen3_14b_32k", ["--context-length", "34816"]),  # 2048 + 32768
    ("tiny_cpu", ["--threads", "1", "--max-total-tokens", "4096"]),
])
def test_one_serve_command_for_both_launchers(tmp_path, name, device_args):
    spec = load_launch(MODELS / f"{name}.yaml", ["model.path=/models/m x", "launch.sglang.mem_fraction_static=0.7"])
    args = serve_args(spec)
    assert args[args.index("--mem-fraction-static") + 1] == "0.7" and args[-len(device_args):] == device_args
    assert args[args.index("--model-path") + 1] == "/models/m x"
    assert shell_vars(spec)["FIT_SERVE_ARGS"] == shlex.join(args)
    # slurm/lib.sh: the fit check's lines sourced, then tepo_serve_cmd
    env_file = tmp_path / "fit.env"
    env_file.write_text(render_shell(spec) + "\n")
    script = f'source "{ROOT}/slurm/lib.sh"; source "{env_file}"; tepo_serve_cmd 30001'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"], "TEPO_PYTHON": "/py/bin/python"}).stdout
    env_words = shlex.split(shell_vars(spec)["FIT_SERVE_ENV"])  # (a server with the memory saver: its variables)
    assert shlex.split(out) == ["env", *env_words, "/py/bin/python", *args, "--port", "30001"]
    # the nemo-run launcher
    from megatron_tepo.launch.nemo_run import Plan, server_command

    assert server_command(Plan(name, spec, ""), "/py/bin/python") == ["/py/bin/python", *args, "--port", "{port}"]


def test_serve_command_makes_sglang_flags_of_them(monkeypatch):
    """The last hops: the serve command's parser, then the fleet's server_command (SGLang's flags)."""
    from megatron_tepo.rollout.sglang import serve

    spec = load_launch(MODELS / "qwen3_14b.yaml", ["model.path=/models/m", "launch.sglang.mem_fraction_static=0.7",
                                                  "launch.sglang.max_total_tokens=65536"])
    monkeypatch.setenv("MTEPO_SGLANG_PYTHON", "/sglang/bin/python")
    argv, _ = serve.command(serve.build_parser().parse_args([*serve_args(spec)[2:], "--port", "30000"]))
    assert argv[0] == "/sglang/bin/python"
    got = {flag: argv[argv.index(flag) + 1] for flag in ("--model-path", "--port", "--mem-fraction-static", "--tp-size",
                                                         "--max-running-requests", "--context-length",
                                                         "--max-total-tokens")}
    assert got == {"--model-path": "/models/m", "--port": "30000", "--mem-fraction-static": "0.7", "--tp-size": "2",
                   "--max-running-requests": "64", "--context-length": "10240", "--max-total-tokens": "65536"}


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
