"""One schema per SGLang server (issue #33 point 3): ServerConfig is written on a command line and read
back into the same type, with one default per value (the device's through one rule), and a launch
file's servers are that type from the YAML to the serve command."""
import dataclasses
from pathlib import Path

import pytest

from megatron_tepo.launch import load_launch, serve_args
from megatron_tepo.rollout.sglang import serve
from megatron_tepo.rollout.sglang.options import DEVICE_DEFAULTS, SERVE_COMMAND_DEFAULTS, ServerConfig

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"


@pytest.mark.parametrize("cfg", [
    ServerConfig(),
    ServerConfig(device="cuda"),
    ServerConfig(model_path="/models/m x", host="0.0.0.0", dtype="float32", device="cuda", tp=4,
                 mem_fraction_static=0.7, max_running_requests=0, threads_per_server=3, max_total_tokens=65536,
                 context_length=10240, skip_warmup=False, extra_args=["--log-level", "warning"]),
    ServerConfig(model_path="/m", max_total_tokens=0, max_running_requests=8),
], ids=["cpu-defaults", "cuda-defaults", "every-option", "zeros"])
def test_the_command_line_reads_back_into_the_same_config(cfg):
    argv = cfg.to_argv()
    assert ServerConfig.from_argv(argv) == cfg
    assert ServerConfig.from_argv(argv, **SERVE_COMMAND_DEFAULTS) == cfg  # every option is written


def test_the_device_decides_its_defaults_through_one_rule():
    for device, defaults in DEVICE_DEFAULTS.items():
        cfg = ServerConfig(device=device)
        assert {k: getattr(cfg, k) for k in defaults} == defaults
    given = ServerConfig(device="cuda", mem_fraction_static=0.5, max_total_tokens=4096, max_running_requests=0)
    assert (given.mem_fraction_static, given.max_total_tokens, given.max_running_requests) == (0.5, 4096, 0)
    with pytest.raises(ValueError, match="ServerConfig.device: expected cpu or cuda, found 'tpu'"):
        ServerConfig(device="tpu")


@pytest.mark.parametrize("name", ["qwen3_14b", "tiny_cpu"])
def test_a_launch_files_servers_are_one_type_from_yaml_to_the_serve_command(name, monkeypatch):
    """launch file -> ServerConfig -> FIT_SERVE_ARGS -> the serve command's parser -> ServerConfig."""
    monkeypatch.setenv("MTEPO_SGLANG_PYTHON", "/sglang/bin/python")
    spec = load_launch(MODELS / f"{name}.yaml", ["model.path=/models/m"])
    sent = spec.launch.rollout.server
    assert isinstance(sent, ServerConfig) and sent.device == spec.launch.device
    ns = serve.build_parser().parse_args([*serve_args(spec)[2:], "--port", "30000"])
    got = ServerConfig.from_namespace(ns, python="/sglang/bin/python")
    ctx = spec.cfg.rollout.max_prompt_len + spec.cfg.rollout.max_new_tokens if sent.device == "cuda" else None
    assert got == dataclasses.replace(sent, model_path="/models/m", host="0.0.0.0", context_length=ctx,
                                      python="/sglang/bin/python")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_launch_file_without_server_options_takes_the_servers_defaults(tmp_path, device):
    import yaml

    launch = {"device": device, "gpus_per_node": 2, "rollout_nodes": 0 if device == "cpu" else 1}
    path = tmp_path / "l.yaml"
    path.write_text(yaml.safe_dump({"_base_": str(ROOT / "examples" / "tiny_tepo" / "config.yaml"),
                                    "architecture": {"num_attention_heads": 4}, "launch": launch}))
    assert load_launch(path).launch.rollout.server == ServerConfig(device=device)


def test_a_server_never_inherits_expandable_segments_and_a_releasing_one_runs_safe():
    """Issue #40 rows 2, 4, 5: the trainer's (or the user's) ``expandable_segments:True`` is dropped from
    the server's allocator settings (torch_memory_saver refuses to start with it), its other settings
    kept; a server with the memory saver (colocated on GPUs) answers ``/health`` without generating and
    keeps its CUDA graphs under the memory saver; a server without it gets neither."""
    from megatron_tepo.rollout.sglang.options import MEMORY_SAVER_ENV, server_command

    base = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128",
            "PYTORCH_ALLOC_CONF": "expandable_segments:True", "OTHER": "x"}
    saver = ServerConfig(model_path="/m", device="cuda", python="/no/such/venv/bin/python", enable_memory_saver=True)
    _, env = server_command(saver, 30000, base_env=base)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128" and "PYTORCH_ALLOC_CONF" not in env
    assert env["OTHER"] == "x" and base["PYTORCH_CUDA_ALLOC_CONF"].startswith("expandable")  # (a copy)
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false" and env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"
    assert {k: env[k] for k in MEMORY_SAVER_ENV} == MEMORY_SAVER_ENV
    plain = dataclasses.replace(saver, enable_memory_saver=False)
    _, env = server_command(plain, 30000, base_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and not set(MEMORY_SAVER_ENV) & set(env)
    _, env = server_command(plain, 30000, base_env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"  # nothing to drop: as it was


def test_lora_servers_get_sglangs_lora_flags_from_the_config_and_the_launch():
    """``actor.lora.sync: adapters``: the servers are started with LoRA on for the run's rank and its
    targets' HF modules (``options.py:lora_flags``; the torch_native backend on CPU); a server without
    ``max_lora_rank`` gets none of them, and a merged LoRA run's servers are plain."""
    from megatron_tepo.rollout.sglang.options import server_command

    plain, _ = server_command(ServerConfig(model_path="/m"), 30000, base_env={})
    assert "--enable-lora" not in plain
    cfg = ServerConfig(model_path="/m", max_lora_rank=32, lora_target_modules="q_proj,k_proj,v_proj,o_proj")
    assert ServerConfig.from_argv(cfg.to_argv()) == cfg
    cmd, _ = server_command(cfg, 30000, base_env={})
    at = cmd.index("--enable-lora")
    assert cmd[at:at + 12] == ["--enable-lora", "--max-lora-rank", "32", "--lora-target-modules", "q_proj", "k_proj",
                               "v_proj", "o_proj", "--max-loras-per-batch", "2", "--lora-backend", "torch_native"]
    from megatron_tepo.rollout.sglang.options import lora_flags

    gpu = lora_flags(dataclasses.replace(cfg, device="cuda"))
    assert "--enable-lora" in gpu and "--lora-backend" not in gpu
    spec = load_launch(MODELS / "tiny_cpu.yaml", ["actor.lora.rank=16", "actor.lora.sync=adapters",
                                                  "actor.lora.target_modules=[linear_qkv,linear_fc2]"])
    served = ServerConfig.from_argv(serve_args(spec)[2:])
    assert served.max_lora_rank == 16 and served.lora_target_modules == "q_proj,k_proj,v_proj,down_proj"
    merged = load_launch(MODELS / "tiny_cpu.yaml", ["actor.lora.rank=16"])
    assert ServerConfig.from_argv(serve_args(merged)[2:]).max_lora_rank is None
