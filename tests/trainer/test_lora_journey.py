"""A LoRA run as a user runs it (``tools/train.py`` with ``actor.lora``): it leaves the adapters as a
PEFT adapter folder beside the merged HF model, ``peft`` puts them on the HF base as that merged
model, and a new run starts from the folder (``actor.lora.init_from``)."""
import json

import pytest
import torch

from tests.trainer.test_user_journey import steps, train

pytestmark = [pytest.mark.slow, pytest.mark.journey, pytest.mark.second_lane]  # (CI: the second lane's, tools/test.sh)


def test_a_lora_run_exports_a_peft_adapter_that_peft_loads_and_a_new_run_starts_from(tiny, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    train(tiny, out, "train.steps=2", "actor.lora.rank=4", "actor.lora.alpha=8", "optim.lr=1e-2")
    conf = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["lora_alpha"] == 8.0 and conf["base_model_name_or_path"] == str(tiny / "model")
    base = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(out / "peft")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32).eval()
    ids = torch.arange(1, 9)[None] * 3 % base.config.vocab_size
    with torch.no_grad():
        got, want = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), dtype=torch.float32).eval()(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-4, float((got - want).abs().max())
    assert float((plain - want).abs().max()) > 1e-4  # the adapters trained: not the base model
    again = tmp_path / "from_adapter"
    proc = train(tiny, again, "train.steps=1", "actor.lora.rank=4", "actor.lora.alpha=8",
                 f"actor.lora.init_from={out / 'peft'}")
    assert steps(again) == [1], proc.stdout[-2000:]
