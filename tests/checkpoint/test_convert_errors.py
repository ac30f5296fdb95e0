"""Acceptance 4: bad inputs give an error naming the culprit and leave no output directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint.fixtures import make_hf_dir
from tests.dist_utils import REPO

TOOL = REPO / "tools" / "convert_hf_to_megatron.py"


def _run_tool(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)


def _no_output(out: Path):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(out.name + ".")], list(out.parent.iterdir())


def _rewrite(hf: Path, fn):
    from safetensors.torch import load_file, save_file

    f = hf / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


@pytest.fixture
def hf(tmp_path):
    return make_hf_dir(tmp_path / "hf", "qwen3", tie=False, tokenizer=False)


def _main(*args):
    """The tool's main() in-process: its input checks run before any process group or file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf_to_megatron_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        return mod.main(list(args))
    except SystemExit as exc:  # a user error: one line on stderr, status 2
        return exc.code


def test_missing_tensor(hf, tmp_path, capsys):
    _rewrite(hf, lambda s: s.pop("model.layers.1.self_attn.k_norm.weight"))
    assert _main("--hf", str(hf), "--out", str(tmp_path / "out")) == 2
    assert "model.layers.1.self_attn.k_norm.weight" in capsys.readouterr().err
    _no_output(tmp_path / "out")


def test_wrong_shape(hf, tmp_path, capsys):
    def cut(s):
        s["model.layers.2.mlp.up_proj.weight"] = s["model.layers.2.mlp.up_proj.weight"][:-1]
    _rewrite(hf, cut)
    assert _main("--hf", str(hf), "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "model.layers.2.mlp.up_proj.weight" in err and "(127, 64)" in err
    _no_output(tmp_path / "out")


def test_unexpected_tensor(hf, tmp_path, capsys):
    _rewrite(hf, lambda s: s.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)))
    assert _main("--hf", str(hf), "--out", str(tmp_path / "out")) == 2
    assert "model.layers.0.mlp.extra.weight" in capsys.readouterr().err
    _no_output(tmp_path / "out")


def test_unknown_architecture(hf, tmp_path, capsys):
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    (hf / "config.json").write_text(json.dumps(cfg))
    assert _main("--hf", str(hf), "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "GPTNeoXForCausalLM" in err and "unsupported architecture" in err
    _no_output(tmp_path / "out")


def test_a_qwen3_5_config_that_is_neither_kind(tmp_path, capsys):
    """A Qwen3.5 config with the conditional-generation model_type but no text_config: one line naming
    the file and the field."""
    hf = make_hf_dir(tmp_path / "hf", "qwen3_5", False, tokenizer=False)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(model_type="qwen3_5")
    (hf / "config.json").write_text(json.dumps(cfg))
    assert _main("--hf", str(hf), "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(line.endswith(f"{hf / 'config.json'}: model_type 'qwen3_5', architectures ['Qwen3_5ForCausalLM'] is "
                             "neither a text-only Qwen3.5 config (model_type 'qwen3_5_text' / 'qwen3_5_moe_text', "
                             "num_hidden_layers at the top) nor a *ForConditionalGeneration one: its text_config is "
                             "missing") for line in err), err
    _no_output(tmp_path / "out")


def test_tp_not_dividing_heads(hf, tmp_path, capsys):
    assert _main("--hf", str(hf), "--out", str(tmp_path / "out"), "--tp", "3") == 2
    err = capsys.readouterr().err
    assert "--tp=3 does not divide num_attention_heads=4" in err
    _no_output(tmp_path / "out")


def test_existing_output_refused(hf, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    assert _main("--hf", str(hf), "--out", str(tmp_path / "out")) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep").read_text() == "x"


@pytest.mark.distributed
def test_error_after_start_removes_tmp_dir(tmp_path):
    """An inconsistency only the streaming pass sees (a stored tied lm_head that differs from the
    embedding) fails inside the conversion, after the tmp dir exists: it is removed, the error
    names the tensor, the process exits non-zero. Runs the real tool (subprocess)."""
    hf = make_hf_dir(tmp_path / "hf", "llama", tie=True, tokenizer=False)
    _rewrite(hf, lambda s: s.__setitem__("lm_head.weight", s["model.embed_tokens.weight"] + 1))
    proc = _run_tool("--hf", str(hf), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "lm_head.weight" in proc.stderr
    _no_output(tmp_path / "out")


@pytest.fixture
def hf_moe(tmp_path):
    return make_hf_dir(tmp_path / "hf-moe", "qwen3_moe", tie=False, tokenizer=False)


def test_moe_missing_expert_tensor(hf_moe, tmp_path, capsys):
    _rewrite(hf_moe, lambda s: s.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    assert _main("--hf", str(hf_moe), "--out", str(tmp_path / "out"), "--ep", "2") == 2
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in capsys.readouterr().err
    _no_output(tmp_path / "out")


def test_moe_fused_expert_names_refused(hf_moe, tmp_path, capsys):
    """transformers' in-memory fused layout (mlp.experts.gate_up_proj [E, 2I, H]) is not a
    checkpoint layout: named as unexpected, the per-expert tensors as missing."""
    def fuse(s):
        for e in range(4):
            s.pop(f"model.layers.0.mlp.experts.{e}.gate_proj.weight")
        s["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 64, 64)
    _rewrite(hf_moe, fuse)
    assert _main("--hf", str(hf_moe), "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.experts.gate_up_proj" in err and "model.layers.0.mlp.experts.0.gate_proj.weight" in err
    _no_output(tmp_path / "out")


def test_an_moe_at_tp2_passes_the_input_check(hf_moe):
    """The 30B-A3B example's kind of layout (TP 2 with EP): an MoE layer at TP > 1 runs with
    sequence parallelism, which the stored weights do not depend on; the converter used to refuse
    it ("needs actor.sequence_parallel=true")."""
    from megatron_tepo.checkpoint import check_hf_input

    family_cfg, _, _ = check_hf_input(hf_moe, tp=2, ep=2, world_size=4)
    assert family_cfg.moe is not None


def test_ep_not_dividing_experts(hf_moe, tmp_path, capsys):
    assert _main("--hf", str(hf_moe), "--out", str(tmp_path / "out"), "--ep", "3") == 2
    assert "--ep=3 does not divide num_experts=4" in capsys.readouterr().err
    _no_output(tmp_path / "out")
