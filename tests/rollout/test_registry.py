"""Engines are chosen by name through the registry (megatron_tepo.rollout.registry): the names are
the config's ``rollout.engine`` choices, each engine module registers itself when first asked
for, and the trainer builds whatever the registry gives for the configured name (no engine
names in the trainer)."""
import typing

import pytest

from megatron_tepo.config import RolloutConfig, RunConfig
from megatron_tepo.rollout import registry
from megatron_tepo.rollout.registry import EngineSettings, engine_factory, engine_names


def test_the_names_are_the_configs_choices():
    choices = typing.get_args(typing.get_type_hints(RolloutConfig)["engine"])
    assert engine_names() == sorted(choices)
    for name in choices:
        assert engine_factory(name).build is not None
    with pytest.raises(ValueError, match=r"rollout.engine: unknown engine 'vllm'; choose one of \['embedded', 'sglang'\]"):
        engine_factory("vllm")
    with pytest.raises(ValueError, match="registered already"):
        registry.register_engine("embedded", lambda s: None)


def test_embedded_needs_no_follower_sync_and_checks_nothing():
    factory = engine_factory("embedded")
    settings = EngineSettings(RolloutConfig(), "/nowhere", 0, 0)
    assert factory.follower_sync(settings) is None and factory.check(settings.rollout) is None


def test_sglang_checks_its_servers_and_followers_drain(monkeypatch):
    from megatron_tepo.rollout.sglang.weight_sync import DiskSync, DistributedSync

    monkeypatch.delenv("TEPO_SGLANG_URLS", raising=False)
    monkeypatch.delenv("TEPO_SYNC_ADDRESS", raising=False)
    factory = engine_factory("sglang")
    with pytest.raises(ValueError, match="TEPO_SGLANG_URLS.*rollout.sglang_urls"):
        factory.check(RolloutConfig())
    with pytest.raises(ValueError, match="not an http"):
        factory.check(RolloutConfig(sglang_urls=["127.0.0.1:30000"]))
    monkeypatch.setenv("TEPO_SGLANG_URLS", "http://127.0.0.1:30000")
    factory.check(RolloutConfig())
    sync = factory.follower_sync(EngineSettings(RolloutConfig(), "/m", 0, 0))
    assert isinstance(sync, DistributedSync) and not sync.is_sender and sync.master_address == "127.0.0.1"
    sync = factory.follower_sync(EngineSettings(RolloutConfig(sync_mode="disk", sync_dir="/shared"), "/m", 0, 0))
    assert isinstance(sync, DiskSync) and sync.shared_dir == "/shared"


def test_the_trainer_builds_what_the_registry_gives(monkeypatch):
    from megatron_tepo.trainer.loop import FollowerEngine
    from megatron_tepo.trainer.main import build_engine

    built = []

    def build(settings):
        built.append(settings)
        return "an engine"

    monkeypatch.setitem(registry._ENGINES, "test-engine", registry.EngineFactory(build, lambda s: "its sync"))
    cfg = RunConfig()
    cfg.rollout.engine = "test-engine"
    assert build_engine(cfg, "/model", 7) == "an engine"
    assert built == [EngineSettings(cfg.rollout, "/model", 7, cfg.train.seed)]
    follower = build_engine(cfg, "/model", 7, driver=False)
    assert isinstance(follower, FollowerEngine) and follower.weight_sync == "its sync"
