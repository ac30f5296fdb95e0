"""Fit check arithmetic against hand-computed numbers (formulas: docs/LAUNCH.md, "The fit-check
arithmetic"; code: megatron_tepo/launch/)."""
from pathlib import Path

import pytest
import yaml

from megatron_tepo.launch import FitError, check_fit, load_launch, write_run_config
from megatron_tepo.launch.memory import GiB, actor_memory, param_counts, server_memory, total_params
from megatron_tepo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"

TINY_ARCH = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                 tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000)


def tiny(tmp_path, parallel=None, launch=None, optim=None, actor=None, name="tiny.yaml"):
    data = {
        "architecture": TINY_ARCH,
        "launch": dict(dict(gpus_per_node=4, gpu_mem_gib=1, actor_nodes=1, rollout_nodes=1, reserve_gib=0,
                            sglang=dict(tp=2, max_running_requests=4)), **(launch or {})),
        "parallel": dict(dict(tp=2, pp=1), **(parallel or {})),
        "actor": dict(dict(max_tokens_per_micro_batch=256, recompute="none"), **(actor or {})),
        "optim": dict(optim or {}),
        "rollout": {"max_prompt_len": 32, "max_new_tokens": 96},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return load_launch(path)


def test_tiny_params_by_hand(tmp_path):
    spec = tiny(tmp_path)
    m = spec.shape()
    # per layer: q 64*64 + k,v 2*64*32 + o 64*64 = 12288, norms 64+64, q/k norms 16+16, MLP 3*64*128
    assert total_params(m) == 2 * (12288 + 128 + 32 + 3 * 64 * 128) + 2 * 256 * 64 + 64 == 106880
    # TP=2: attention 12288/2 + 64 + 32, MLP 24576/2 + 64, embedding and output 16384/2 each
    assert param_counts(m, t=2)["first"] == (2 * (6144 + 96 + 12288 + 64) + 8192 + 8192 + 64, 0) == (53632, 0)


def test_tiny_actor_bytes_by_hand(tmp_path):
    spec = tiny(tmp_path)
    a = actor_memory(spec.shape(), spec.cfg, spec.launch)
    assert (a.weights, a.grads, a.optimizer) == (2 * 53632, 4 * 53632, 12 * 53632)
    # s = max(256, 32 + 96) = 256 tokens; bf16 (2 bytes), fused SwiGLU (cuda, fusions auto), no SP:
    # 2*4h = 512 whole + (2*[(4+4)*16 + 2*4*16 + (4+2)*16 + 3*128] + 4*4) / 2 = (1472 + 16) / 2 = 744
    assert a.tokens == 256
    assert a.activations == 2 * (512 + 744) * 256 == 643072
    # the fused LM head (the default): two blocks of 128 columns (the whole shard: the tiny vocabulary
    # is below the least block), the gathered hidden states, their gradient and its fp32 sum, the weight
    # shard's gradient, and the fp32 staging of the block's weights
    assert a.logits == 2 * 2 * 128 * 256 + (2 * 2 + 4) * 64 * 256 + 2 * 128 * 64 + 4 * 128 * 64 == 311296
    assert a.total == 107264 + 214528 + 643584 + 643072 + 311296
    spec = tiny(tmp_path, actor={"lm_head": "materialized"})  # the logits, their gradient, the weight's
    assert actor_memory(spec.shape(), spec.cfg, spec.launch).logits == 2 * 2 * 256 / 2 * 256 + 2 * 128 * 64 == 147456
    # distributed optimizer over DP = 4 / 2 = 2
    spec = tiny(tmp_path, optim={"use_distributed_optimizer": True})
    assert actor_memory(spec.shape(), spec.cfg, spec.launch).optimizer == 12 * 53632 / 2
    # sequence parallel: everything / 2 -> (2*(256 + 736) + 16) / 2 = 1000 per token per layer
    spec = tiny(tmp_path, actor={"sequence_parallel": True})
    assert actor_memory(spec.shape(), spec.cfg, spec.launch).activations == 2 * 1000 * 256
    # full recompute, no SP: 2 layers x 2h = 128 B per token kept + one layer re-run (1256 B/token)
    spec = tiny(tmp_path, actor={"recompute": "full"})
    assert actor_memory(spec.shape(), spec.cfg, spec.launch).activations == 2 * 128 * 256 + 1256 * 256
    spec = tiny(tmp_path, actor={"recompute": "full", "recompute_num_layers": 2})
    assert actor_memory(spec.shape(), spec.cfg, spec.launch).activations == 2 * 128 * 256 + 2 * 1256 * 256
    # selective: the attention kernel's copy of its output (2*4*16/2) and statistics (16/2) go
    spec = tiny(tmp_path, actor={"recompute": "selective"})
    assert actor_memory(spec.shape(), spec.cfg, spec.launch).activations == 2 * (1256 - 64 - 8) * 256
    # without fusions the SiLU output is kept too: + 2*128/2 per token per layer
    spec = tiny(tmp_path, actor={"fusions": "off"})
    assert actor_memory(spec.shape(), spec.cfg, spec.launch).activations == 2 * (1256 + 128) * 256
    # unfused attention (padded rows): + (4 + 2) * 4 heads / 2 * 128 (the longest row) per token per layer
    spec = tiny(tmp_path, actor={"attention": "unfused", "pack_sequences": False})
    assert actor_memory(spec.shape(), spec.cfg, spec.launch).activations == 2 * (1256 + 6 * 2 * 128) * 256
    # fp32 actor: 4 + 4 + 8 bytes per parameter, activations and logits in 4-byte elements
    spec = tiny(tmp_path, actor={"precision": "fp32"})
    a = actor_memory(spec.shape(), spec.cfg, spec.launch)
    assert (a.weights, a.grads, a.optimizer) == (4 * 53632, 4 * 53632, 8 * 53632)
    assert a.activations == 2 * (1024 + (4 * 736 + 16) / 2) * 256
    # fp32: the hidden states' gradient is its own fp32 sum (no accumulator, no staging); the weight's gradient
    assert a.logits == 2 * 4 * 128 * 256 + 2 * 4 * 64 * 256 + 4 * 128 * 64


def test_moved_settings_are_named(tmp_path):
    from megatron_tepo.config import ConfigError
    with pytest.raises(ConfigError, match=r"launch.actor_precision \(.*tiny.yaml:\d+\): moved to actor.precision"):
        tiny(tmp_path, launch={"actor_precision": "bf16"})
    with pytest.raises(ConfigError, match=r"launch.recompute \(.*tiny.yaml:\d+\): moved to actor.recompute"):
        tiny(tmp_path, launch={"recompute": "full"})
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel .*moved to actor.sequence_parallel"):
        tiny(tmp_path, parallel={"sequence_parallel": True})


def test_tiny_pipeline_stages(tmp_path):
    spec = tiny(tmp_path, parallel={"tp": 1, "pp": 2})
    c = param_counts(spec.shape(), t=1, p=2)
    layer = 12288 + 128 + 32 + 3 * 64 * 128
    assert c["first"] == (layer + 256 * 64, 0) and c["last"] == (layer + 64 + 256 * 64, 0)
    a = actor_memory(spec.shape(), spec.cfg, spec.launch)
    # first stage: 2 micro-batches in flight x 1 layer (2000 B per token at TP=1) = 1,024,000 B of
    # activations; last: 1 x 1 layer + logits (4 * 256 B per token) = 774,144 B: the first is larger
    assert a.stage == "first" and a.logits == 0
    assert a.activations == 2 * (512 + 1472 + 16) * 256


def test_tiny_server_by_hand(tmp_path):
    spec = tiny(tmp_path)
    s = server_memory(spec.shape(), spec.cfg, spec.launch)
    assert s.weights == 2 * 53632
    assert s.kv_bytes_per_token == 2 * 2 * 1 * 16 * 2  # K and V, 2 layers, 2 groups / TP 2, d 16, bf16
    assert s.kv_tokens == 4 * 128 and s.kv_cache == 128 * 512
    assert s.servers == 2


def test_tiny_misfit_names_settings(tmp_path):
    spec = tiny(tmp_path, launch={"gpu_mem_gib": 0.001})
    with pytest.raises(FitError) as err:
        check_fit(spec.shape(), spec.cfg, spec.launch)
    msg = str(err.value)
    assert msg.startswith("actor does not fit:") and "GiB per GPU" in msg
    for setting in ("optim.use_distributed_optimizer", "parallel.tp", "actor.recompute"):
        assert setting in msg


def test_invalid_layout(tmp_path):
    spec = tiny(tmp_path, parallel={"tp": 3})
    with pytest.raises(FitError, match="parallel.tp=3 does not divide num_attention_heads=4"):
        check_fit(spec.shape(), spec.cfg, spec.launch)


def test_qwen3_14b_by_hand():
    spec = load_launch(MODELS / "qwen3_14b.yaml")
    m = spec.shape()
    assert total_params(m) == 14_768_307_200
    # TP=4: attention (5120*40*128 + 2*5120*8*128 + 40*128*5120)/4 + 5120 + 2*128 = 15,734,016
    #       MLP 3*5120*17408/4 + 5120 = 66,851,840; embedding = output = 151936*5120/4 = 194,478,080
    params = 40 * (15_734_016 + 66_851_840) + 2 * 194_478_080 + 5120
    assert params == 3_692_395_520
    r = check_fit(m, spec.cfg, spec.launch)
    a = r.actor
    assert a.dense_params == params and a.dp == 4 and a.tokens == 16384
    assert a.weights == 2 * params and a.grads == 4 * params and a.optimizer == 12 * params / 4
    # full recompute with SP: 40 layers x 2*5120/4 B + one layer (2*(4*5120 + 75776) + 4*40)/4 = 48,168 B
    # (75776 = (40 + 16)*128 q, k, v + 2*40*128 attention output + 48*128 q/k-norm inputs + 3*17408)
    assert a.activations == 40 * 2560 * 16384 + 48_168 * 16384 == 2_466_906_112
    # the fused LM head: two blocks of 1152 columns (1/32 of the 37984-row shard's logits, in 128s), per
    # token the gathered hidden states, their gradient and its fp32 sum, the shard's weight gradient, and
    # the fp32 staging of the block's weights (for a torch without the in-place mixed GEMM; the staged
    # rows of its gradient take the logits block's buffer); the logits would be 2,489,319,424
    assert a.logits == (2 * 2 * 1152 * 16384 + (2 * 2 + 4) * 5120 * 16384 + 2 * 37984 * 5120
                        + 4 * 1152 * 5120) == 1_159_135_232
    total = 2 * params + 4 * params + 3 * params + 2_466_906_112 + 1_159_135_232 + 4 * GiB
    assert a.total == total and round(total / GiB, 1) == 38.3
    s = r.server
    server_params = 40 * (62_914_560 // 2 + 5120 + 256 + 3 * 5120 * 17408 // 2 + 5120) + 2 * 151936 * 5120 // 2 + 5120
    assert s.params == server_params == 7_384_366_080
    assert s.kv_bytes_per_token == 2 * 40 * 4 * 128 * 2 == 81_920
    assert s.kv_cache == 81_920 * 64 * (2048 + 8192) == 50 * GiB
    assert round(s.total / GiB, 2) == 63.75 and s.budget == 0.85 * 80 * GiB


def test_qwen3_14b_failing_layout():
    spec = load_launch(MODELS / "qwen3_14b.yaml",
                       ["parallel.tp=1", "actor.sequence_parallel=false", "optim.use_distributed_optimizer=false"])
    with pytest.raises(FitError) as err:
        check_fit(spec.shape(), spec.cfg, spec.launch)
    msg = str(err.value)
    assert msg.startswith("actor does not fit: ") and "> 80 GiB per GPU" in msg
    assert "set optim.use_distributed_optimizer: true" in msg and "raise parallel.tp or parallel.pp" in msg


def test_server_misfit():
    spec = load_launch(MODELS / "qwen3_14b.yaml", ["launch.sglang.tp=1"])
    with pytest.raises(FitError, match="rollout servers do not fit: .*raise launch.sglang.tp"):
        check_fit(spec.shape(), spec.cfg, spec.launch)


@pytest.mark.parametrize("name", ["qwen3_14b", "qwen3_14b_32k", "qwen3_14b_tir", "qwen2.5_7b", "qwen3_32b",
                                  "qwen3_30b_a3b", "qwen3.5_27b", "qwen3.5_35b_a3b"])
def test_example_layouts_fit(name, tmp_path):
    spec = load_launch(MODELS / f"{name}.yaml")
    check_fit(spec.shape(), spec.cfg, spec.launch)
    out = write_run_config(spec, tmp_path / "run.yaml")
    cfg = load_config(out)
    assert cfg.parallel == spec.cfg.parallel and cfg.algorithm.loss == "tepo"


def test_published_sizes():
    # total parameters of the published configs (HF model cards: 14.8B, 7.61B, 32.8B, 30.5B)
    got = {n: total_params(load_launch(MODELS / f"{n}.yaml").shape())
           for n in ("qwen3_14b", "qwen2.5_7b", "qwen3_32b", "qwen3_30b_a3b")}
    assert got == {"qwen3_14b": 14_768_307_200, "qwen2.5_7b": 7_615_616_512,
                   "qwen3_32b": 32_762_123_264, "qwen3_30b_a3b": 30_532_122_624}


def test_published_hybrid_sizes():
    """#53: the Qwen3.5 files' text models (the model cards' 27B and 35B count the vision tower and the
    MTP layer too), their Gated DeltaNet layers priced as such: 48 of 64 and 30 of 40."""
    shapes = {n: load_launch(MODELS / f"{n}.yaml").shape() for n in ("qwen3.5_27b", "qwen3.5_35b_a3b")}
    assert {n: (s.linear_layers, s.num_hidden_layers) for n, s in shapes.items()} == {
        "qwen3.5_27b": (48, 64), "qwen3.5_35b_a3b": (30, 40)}
    assert {n: total_params(s) for n, s in shapes.items()} == {"qwen3.5_27b": 26_895_998_464,
                                                               "qwen3.5_35b_a3b": 34_660_610_688}


def test_hf_config_path_wins(tmp_path):
    import json
    cfg_json = tmp_path / "config.json"
    cfg_json.write_text(json.dumps(dict(TINY_ARCH, num_hidden_layers=4)))
    spec = load_launch(MODELS / "qwen3_14b.yaml", hf_config=cfg_json)
    assert spec.shape().num_hidden_layers == 4 and spec.architecture_source == str(cfg_json)


def test_cli(tmp_path, capsys):
    from tools.fit_check import cli
    assert cli(["--config", str(MODELS / "qwen3_14b.yaml"), "--gpu-mem-gib", "80"]) == 0
    assert "total 38.3 GiB of 80 GiB: fits" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli(["--config", str(MODELS / "qwen3_14b.yaml"), "--gpu-mem-gib", "36"])
    assert exit_.value.code == 2  # a user error
    err = capsys.readouterr().err
    assert "actor does not fit: 38.3 GiB > 36 GiB per GPU" in err and len(err.strip().splitlines()) == 1


def test_cli_bad_yaml_is_one_line_naming_line_and_column(tmp_path, capsys):
    from tools.fit_check import cli
    bad = tmp_path / "bad.yaml"
    bad.write_text("launch:\n  gpus_per_node: [8\n")
    with pytest.raises(SystemExit) as exit_:
        cli(["--config", str(bad)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert f"{bad}:3:1: invalid YAML" in err and "line 2, column 18" in err


# ---------------------------------------------------------------------------------- CPU mode
def cpu_launch(**kw):
    return dict(dict(device="cpu", gpus_per_node=2, actor_nodes=1, rollout_nodes=0,
                     sglang=dict(tp=1, servers_per_node=1, port=0, max_total_tokens=2048)), **kw)


def test_cpu_mode_skips_gpu_arithmetic(tmp_path):
    from megatron_tepo.launch import shell_vars
    spec = tiny(tmp_path, launch=cpu_launch(gpu_mem_gib=0.001))  # would never fit a GPU
    report = check_fit(spec.shape(), spec.cfg, spec.launch)
    assert report.actor is None and report.server is None and report.actor_fits and report.server_fits
    text = report.render()
    assert "memory: not checked (launch.device: cpu" in text
    assert "actor (cpu): 1 node(s) x 2 processes = 2; tp=2 pp=1 ep=1 dp=1" in text
    assert "1 SGLang server(s) on the actor node(s) (colocated)" in text
    v = shell_vars(spec)
    assert (v["FIT_DEVICE"], v["FIT_ROLLOUT_NODES"], v["FIT_SERVERS_PER_NODE"], v["FIT_SGLANG_PORT"],
            v["FIT_SGLANG_MAX_TOTAL_TOKENS"], v["FIT_GPUS_PER_NODE"]) == ("cpu", "0", "1", "0", "2048", "2")
    assert load_config(write_run_config(spec, tmp_path / "run.yaml")).parallel.tp == 2


def test_cpu_mode_still_checks_the_layout(tmp_path):
    spec = tiny(tmp_path, parallel=dict(tp=3), launch=cpu_launch(gpus_per_node=3))
    with pytest.raises(FitError, match="parallel.tp=3 does not divide num_attention_heads=4"):
        check_fit(spec.shape(), spec.cfg, spec.launch)
    spec = tiny(tmp_path, parallel=dict(tp=1), launch=cpu_launch(gpus_per_node=3, sglang=dict(tp=3)))
    with pytest.raises(FitError, match="launch.sglang.tp=3 does not divide num_attention_heads=4"):
        check_fit(spec.shape(), spec.cfg, spec.launch)
    assert tiny(tmp_path, launch=cpu_launch(sglang=dict(tp=1))).launch.servers_per_node == 1  # CPU default


def test_servers_on_the_actor_gpus_need_the_colocated_placement(tmp_path):
    from megatron_tepo.config import ConfigError
    with pytest.raises(ConfigError, match="rollout_nodes: 0 on cuda .* set launch.sglang.placement: colocated"):
        tiny(tmp_path, launch=dict(rollout_nodes=0))
    with pytest.raises(ConfigError, match="launch.device .*: expected one of 'cuda', 'cpu', found 'tpu'"):
        tiny(tmp_path, launch=dict(device="tpu"))
    with pytest.raises(ConfigError, match="servers_per_node: 3 servers x tp 2 need more"):
        tiny(tmp_path, launch=dict(sglang=dict(tp=2, servers_per_node=3)))


def test_gpu_servers_per_node_explicit(tmp_path):
    spec = tiny(tmp_path, launch=dict(rollout_nodes=2, sglang=dict(tp=2, servers_per_node=1)))
    s = server_memory(spec.shape(), spec.cfg, spec.launch)
    assert s.servers == 2  # 2 nodes x 1 server (instead of 4 GPUs / tp 2 = 2 per node)


def test_the_fit_check_prices_routing_replay():
    """Issue #41 point 6: with ``actor.routing_replay`` on an MoE model, the replayed expert ids (int64) of
    each micro-batch in flight on the GPU, and a step's routing (int8 for 128 experts) on each rank's
    host; nothing for a dense model or with replay off."""
    from megatron_tepo.launch import load_launch
    from megatron_tepo.launch.memory import actor_memory

    spec = load_launch(MODELS / "qwen3_30b_a3b.yaml")
    m, cfg, L = spec.shape(), spec.cfg, spec.launch
    a = actor_memory(m, cfg, L)
    assert cfg.actor.routing_replay == "r3" and (m.num_hidden_layers, m.num_experts_per_tok, m.num_experts) == (48, 8, 128)
    assert a.routing == 8 * a.tokens * 48 * 8
    longest = cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
    assert a.routing_host == cfg.rollout.prompts_per_step * cfg.rollout.n_samples * longest * 48 * 8
    assert a.total == pytest.approx(a.weights + a.grads + a.optimizer + a.activations + a.logits + a.reserve
                                    + a.routing + a.reference)
    off = load_launch(MODELS / "qwen3_30b_a3b.yaml", ["actor.routing_replay=off"])
    assert actor_memory(off.shape(), off.cfg, off.launch).routing == 0.0
    dense = load_launch(MODELS / "qwen3_14b.yaml")
    assert actor_memory(dense.shape(), dense.cfg, dense.launch).routing_host == 0.0


def test_the_async_saves_writer_and_staging_are_priced(tmp_path):
    """#50 row 2: with ``train.async_save`` the fit check prices NVRx's writer process's CUDA context
    on each trainer GPU where it takes the save's tensors by CUDA IPC (an allocator without expandable
    segments; with them -- the trainer's default -- the tensors are staged in host memory and the
    writer makes none), and the staging's host memory: the rank's weights and optimizer shard at the
    pinned allocator's bound (STAGING_ROUNDING)."""
    from megatron_tepo.launch.memory import NVRX_WORKER_CONTEXT, STAGING_ROUNDING, TRAINER_ALLOC_CONF

    spec = tiny(tmp_path)
    m = spec.shape()
    shm = actor_memory(m, spec.cfg, spec.launch)  # (the default: the trainer's allocator)
    assert TRAINER_ALLOC_CONF == "expandable_segments:True" and shm.writer_context == 0.0
    ipc = actor_memory(m, spec.cfg, spec.launch, alloc_conf="max_split_size_mb:512")
    assert ipc.writer_context == NVRX_WORKER_CONTEXT == 0.5 * GiB
    assert ipc.total - shm.total == NVRX_WORKER_CONTEXT
    assert shm.staging_host == STAGING_ROUNDING * (shm.weights + shm.optimizer) == 2.0 * (2 + 12) * 53632
    spec.cfg.train.async_save = False
    off = actor_memory(m, spec.cfg, spec.launch, alloc_conf="max_split_size_mb:512")
    assert (off.writer_context, off.staging_host) == (0.0, 0.0)


def test_the_fit_checks_allocator_default_is_lib_shs():
    """The trainer's allocator when PYTORCH_CUDA_ALLOC_CONF is unset is one setting: lib.sh's."""
    import os

    from megatron_tepo.launch.memory import TRAINER_ALLOC_CONF
    from megatron_tepo.launch.sequence import trainer_env

    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    assert trainer_env("cuda", env)["PYTORCH_CUDA_ALLOC_CONF"] == TRAINER_ALLOC_CONF
