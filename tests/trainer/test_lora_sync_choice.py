"""What a LoRA run's weight sync sends (``trainer/rollouts.py``): the merged export unless
``actor.lora.sync: adapters`` (then the actor's PEFT adapters), and a fresh run that starts from a
PEFT adapter (``actor.lora.init_from``) syncs before its first generation."""
from types import SimpleNamespace

from megatron_tepo.config import LoraConfig
from megatron_tepo.trainer.rollouts import starts_from_adapter, sync_weights
from megatron_tepo.trainer.step import sync_resumed


class _Actor:
    def __init__(self, lora):
        self.settings = SimpleNamespace(lora=lora)

    def export_hf_state(self):
        return "merged"

    def export_adapters(self):
        return "adapters"


class _Engine:
    def __init__(self):
        self.got = []

    def update_weights(self, stream):
        self.got.append(stream)


class _Phase:
    def phase(self, name):
        from contextlib import nullcontext

        return nullcontext()


def test_the_sync_sends_adapters_only_when_the_config_says_so_and_an_adapter_start_syncs_first():
    for lora, want in ((None, "merged"), (LoraConfig(), "merged"), (LoraConfig(sync="adapters"), "adapters")):
        engine = _Engine()
        sync_weights(_Actor(lora), engine)
        assert engine.got == [want], lora
    assert not starts_from_adapter(_Actor(None)) and not starts_from_adapter(_Actor(LoraConfig()))
    assert starts_from_adapter(_Actor(LoraConfig(init_from="/a/peft")))
    for lora, syncs in ((LoraConfig(), 0), (LoraConfig(init_from="/a/peft", sync="adapters"), 1)):
        engine = _Engine()
        sync_resumed(SimpleNamespace(resumed_from=None, actor=_Actor(lora), engine=engine, watchdog=_Phase()), None)
        assert engine.got == ["adapters"] * syncs, lora
