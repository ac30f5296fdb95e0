"""Rollout engines by name: what ``rollout.engine`` names, and how the trainer gets one.

An engine module registers itself with :func:`register_engine`: its name and an
:class:`EngineFactory` -- ``build`` makes the engine on the driver (global rank 0) from
:class:`EngineSettings`; ``follower_sync`` gives what every other rank holds to take part in the
engine's weight update (None: those ranks just read the actor's export, gathered to the driver);
``check`` raises the settings errors that should stop a run before the actor is built. The
trainer asks :func:`engine_factory` for the configured name and nothing else: a new engine is a
module that registers itself, plus a line in :data:`ENGINE_MODULES` (and a name in the config's
``rollout.engine`` choices). The modules are imported when their engine is first asked for, so a
run with the embedded engine never imports the SGLang client.

Left out: the engines themselves (``embedded.py``, ``sglang/``) and the object a follower rank
holds (the trainer's :class:`~megatron_tepo.trainer.loop.FollowerEngine` wraps ``follower_sync``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from megatron_tepo.config import FaultConfig, RolloutConfig
from megatron_tepo.rollout.engine import RolloutEngine
from megatron_tepo.routing import RoutingShape

# the engines of this package: name -> the module that registers it (imported on first use)
ENGINE_MODULES = {"embedded": "megatron_tepo.rollout.embedded", "sglang": "megatron_tepo.rollout.sglang.attach"}


@dataclass(frozen=True)
class EngineSettings:
    """What a factory builds an engine from: the run's ``rollout`` section, the HF checkpoint the
    actor starts from, the tokenizer's pad id, the run's seed, and its ``fault`` section (how
    long to wait for servers, how often to restart them), and the MoE routing the samples carry
    (``routing``, the routing contract: the model family's :class:`~megatron_tepo.routing.RoutingShape`,
    which the trainer reads from the family config; None: no routing returned)."""
    rollout: RolloutConfig
    model_dir: str
    pad_token_id: int
    seed: int
    fault: FaultConfig = field(default_factory=FaultConfig)
    # return each sample's routed experts (Sample.routed_experts) in this shape: actor.routing_replay r3
    routing: Optional[RoutingShape] = None
    # actor.lora.sync: adapters -- the policy reaches the engine as LoRA adapters, not merged weights
    lora_adapters: bool = False

    @property
    def return_routing(self) -> bool:
        return self.routing is not None


def _no_sync(settings: EngineSettings) -> None:
    return None


def _no_check(rollout: RolloutConfig) -> None:
    return None


@dataclass(frozen=True)
class EngineFactory:
    build: Callable[[EngineSettings], RolloutEngine]
    follower_sync: Callable[[EngineSettings], Optional[Any]] = _no_sync
    check: Callable[[RolloutConfig], None] = _no_check


_ENGINES: Dict[str, EngineFactory] = {}


def register_engine(name: str, build: Callable[[EngineSettings], RolloutEngine],
                    follower_sync: Callable[[EngineSettings], Optional[Any]] = _no_sync,
                    check: Callable[[RolloutConfig], None] = _no_check) -> EngineFactory:
    """Register the engine ``name`` (once: a second registration of a name is an error)."""
    if name in _ENGINES:
        raise ValueError(f"rollout engine {name!r} is registered already")
    _ENGINES[name] = EngineFactory(build, follower_sync, check)
    return _ENGINES[name]


def engine_names() -> List[str]:
    return sorted(set(ENGINE_MODULES) | set(_ENGINES))


def engine_factory(name: str) -> EngineFactory:
    """The factory of the engine ``name`` (``rollout.engine``); an unknown name is an error
    listing the known ones."""
    if name not in _ENGINES and name in ENGINE_MODULES:
        importlib.import_module(ENGINE_MODULES[name])
    if name not in _ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r}; choose one of {engine_names()}")
    return _ENGINES[name]
