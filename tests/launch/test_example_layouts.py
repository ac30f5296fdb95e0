"""Every launch file in examples/models/ builds through the trainer's own config path.

For each file: the fit check's run config (``write_run_config``, what ``slurm/lib.sh`` and the
nemo-run launcher hand to ``tools/train.py``) is read back with ``load_config``, and the actor's
arguments come from ``trainer.main.actor_args`` -- the function the trainer calls. The model is
scaled down (hidden 64, 2 layers per pipeline stage, 256-token vocabulary, heads, KV groups and
experts still divisible by the file's TP and EP) and everything else is the file's: precision,
attention, recompute, packing, sequence parallelism, TP, PP, EP, the distributed optimizer.

* Every ``actor`` setting reaches megatron's ``TransformerConfig`` (built by the actor's own
  ``actor_transformer_config``).
* Where the CPU can run the layout (``tiny_cpu.yaml``: TP=2, 2 processes), one optimizer step
  runs under torchrun through ``MegatronActor(model_dir, **actor_args(cfg))``.
* Where it cannot (the GPU files: sequence parallelism needs Transformer Engine, and 16 GPUs), the
  actor's pre-flight check (``plan_actor``, which runs before any process group) refuses with a
  one-line error naming the setting.
"""
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_tepo.config import load_config
from megatron_tepo.launch import load_launch, write_run_config
from tests.dist_utils import torchrun

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "examples" / "models").glob("*.yaml"))
WORKER = Path(__file__).parent / "layout_worker.py"


def scaled_architecture(arch: dict, tp: int, pp: int, ep: int) -> dict:
    """The file's HF config with small sizes that keep its layout valid (a conditional-generation
    config's ``text_config``: a hybrid's 4 layers a stage, one of them attention, its Gated DeltaNet
    heads divisible by TP)."""
    if "text_config" in arch:
        text = dict(scaled_architecture(arch["text_config"], tp, pp, ep), num_hidden_layers=4 * pp,
                    linear_num_key_heads=tp, linear_num_value_heads=2 * tp, linear_key_head_dim=8,
                    linear_value_head_dim=8)
        return dict(arch, text_config=text)
    heads = 2 * tp
    out = dict(arch, hidden_size=64, intermediate_size=32 * tp, num_hidden_layers=2 * pp, num_attention_heads=heads,
               num_key_value_heads=tp, vocab_size=256, max_position_embeddings=256)
    if "head_dim" in arch:
        out["head_dim"] = 8
    if arch.get("num_experts"):
        out.update(num_experts=2 * ep, num_experts_per_tok=2, moe_intermediate_size=16)
    return out


def _run_config(path: Path, tmp_path: Path):
    raw = load_launch(path)  # the file as written (its architecture gives the family)
    p = raw.cfg.parallel
    arch = tmp_path / "config.json"
    arch.write_text(json.dumps(scaled_architecture(raw.architecture, p.tp, p.pp, p.ep)))
    spec = load_launch(path, hf_config=arch)
    cfg = load_config(write_run_config(spec, tmp_path / "run.yaml"))
    return spec, cfg, json.loads(arch.read_text())


def test_every_example_is_covered():
    assert {f.stem for f in FILES} >= {"qwen3_14b", "qwen3_14b_32k", "qwen2.5_7b", "qwen3_32b", "qwen3_30b_a3b",
                                       "qwen3.5_27b", "qwen3.5_35b_a3b", "tiny_cpu",
                                       "qwen3_14b_lora", "qwen3_32b_lora"}


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_layout_settings_reach_the_transformer_config(path, tmp_path):
    from megatron_tepo.actor.actor import actor_transformer_config
    from megatron_tepo.megatron.resolve import family_spec, resolve_actor_config
    from megatron_tepo.models import family_config_from_hf
    from megatron_tepo.actor import actor_args

    spec, cfg, arch = _run_config(path, tmp_path)
    assert cfg.actor == spec.cfg.actor and cfg.parallel == spec.cfg.parallel  # the run config is the file's
    kw = actor_args(cfg)
    assert kw["actor_config"] == cfg.actor and kw["optim"] == cfg.optim
    a = cfg.actor
    settings = resolve_actor_config(kw["actor_config"])
    tc = actor_transformer_config(family_config_from_hf(arch, spec=family_spec(settings)), kw["layout"], settings)
    assert tc.bf16 == (a.precision == "bf16")
    assert tc.params_dtype == (torch.bfloat16 if a.precision == "bf16" else torch.float32)
    assert tc.sequence_parallel == a.sequence_parallel
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.expert_model_parallel_size,
            tc.context_parallel_size) == (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.cp)
    if a.recompute == "full":  # (counted in HF layers: a hybrid stack has two layers per HF layer)
        per = 2 if settings.model_builder == "hybrid" else 1
        assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == (
            "full", "uniform", a.recompute_num_layers * per)
    else:
        assert tc.recompute_granularity == (None if a.recompute == "none" else "selective")
    assert tc.bias_activation_fusion == (settings.fusions == "on")
    if path.stem != "tiny_cpu":  # the GPU files: bf16, packed, sequence parallel, full recompute (with
        # context parallelism, qwen3_14b_32k.yaml, selective: CP halves the activations it keeps)
        assert (a.precision, a.pack_sequences, a.sequence_parallel) == ("bf16", True, True)
        assert a.recompute == ("full" if cfg.parallel.cp == 1 else "selective")
        assert spec.launch.device == "cuda"


@pytest.mark.parametrize("path", [f for f in FILES if f.stem != "tiny_cpu"], ids=lambda f: f.stem)
def test_gpu_layouts_pass_the_actors_own_check_on_cpu_too(path, tmp_path):
    """The actor's check of the GPU files' layouts (sequence parallel, TP > 1, MoE at TP > 1 for the
    30B-A3B) holds on this CPU machine without Transformer Engine: the local spec's torch norms run
    sequence parallelism (megatron/spec.py). (That a GPU job's python has TE: the launch checks.)"""
    from megatron_tepo.actor.actor import plan_actor
    from megatron_tepo.actor import actor_args

    spec, cfg, arch = _run_config(path, tmp_path)
    kw = actor_args(cfg)
    resolved, family_cfg = plan_actor(arch, kw["layout"], kw["actor_config"], world_size=spec.launch.actor_gpus)
    assert resolved.sequence_parallel and cfg.parallel.tp > 1 and resolved.attention != "te"
    assert family_cfg.spec == "local"
    if family_cfg.moe is not None:  # and an MoE layer at TP > 1 cannot do without it
        with pytest.raises(ValueError, match=r"MoE with parallel.tp=\d+ needs actor.sequence_parallel=true") as err:
            plan_actor(arch, kw["layout"], kw["actor_config"], world_size=spec.launch.actor_gpus,
                       sequence_parallel=False)
        assert "\n" not in str(err.value)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_cpu_layout_runs_one_step(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec, cfg, arch = _run_config(ROOT / "examples" / "models" / "tiny_cpu.yaml", tmp_path)
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**arch)).save_pretrained(model_dir)
    nproc = spec.launch.gpus_per_node * spec.launch.actor_nodes
    per_rank = torchrun(WORKER, nproc, json.dumps({"run_config": str(tmp_path / "run.yaml"), "model_dir": str(model_dir)}),
                        tmp_path=tmp_path, timeout=280)
    for r in per_rank:
        assert r["tc"]["tp"] == cfg.parallel.tp == 2 and r["tc"]["bf16"] is (cfg.actor.precision == "bf16")
        assert r["attention"] == "sdpa" and r["core_attention"] == "SDPACoreAttention" and r["packed"]
        assert r["moved"] and math.isfinite(r["loss"])
