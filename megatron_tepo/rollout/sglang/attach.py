"""The SGLang engine of a run (``rollout.engine: sglang``): the fleet attached to the servers the
run config names, with the weight sync of ``rollout.sync_mode``; registered with the engine
registry (:mod:`megatron_tepo.rollout.registry`).

The servers are ``TEPO_SGLANG_URLS`` (comma-separated; the Slurm launchers set it) if set, else
``rollout.sglang_urls``; their API key is ``TEPO_SGLANG_API_KEY``. ``TEPO_SGLANG_RELEASED``
(comma-separated memory tags; a colocated launch sets it after releasing every server's memory
before the trainer starts) is the fleet's initial memory state; it needs ``rollout.colocated``,
whose phases take the memory back; ``TEPO_SGLANG_RESTART_GATE`` is the file its weight syncs
open for the launcher's server restarts (``FleetConfig.restart_gate``). The driver builds the fleet
and the sending weight sync; every other rank builds only a weight sync that drains its part of
the actor's export (``is_sender=False``), so that the export's collectives match.

Left out: launching servers (the Slurm launchers and the tests start them; ``server.py``,
``serve.py``).
"""
from __future__ import annotations

import os
from typing import List, Tuple
from urllib.parse import urlparse

import torch

from megatron_tepo.config import RolloutConfig
from megatron_tepo.time_limits import request_limit_s
from megatron_tepo.rollout.registry import EngineSettings, register_engine
from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet, memory_tags
from megatron_tepo.rollout.sglang.options import API_KEY_ENV, RELEASED_ENV, RESTART_GATE_ENV
from megatron_tepo.rollout.sglang.weight_sync import SYNC_MODES, LoraAdapterSync, WeightSync, make_weight_sync

URLS_ENV = "TEPO_SGLANG_URLS"


def sglang_urls(rollout: RolloutConfig) -> List[str]:
    """The SGLang servers to attach to: env ``TEPO_SGLANG_URLS`` (comma-separated; set by the Slurm
    launchers) if set, else ``rollout.sglang_urls``."""
    env = os.environ.get(URLS_ENV, "").strip()
    urls = [u.strip() for u in env.split(",") if u.strip()] if env else list(rollout.sglang_urls)
    if not urls:
        raise ValueError("rollout.engine is 'sglang' but no server is given: set TEPO_SGLANG_URLS "
                         "(comma-separated URLs) or rollout.sglang_urls")
    for u in urls:
        if urlparse(u).scheme not in ("http", "https") or not urlparse(u).hostname:
            raise ValueError(f"rollout.sglang_urls / TEPO_SGLANG_URLS: {u!r} is not an http(s) URL")
    return urls


def released_tags(rollout: RolloutConfig) -> Tuple[str, ...]:
    """The memory tags the launcher released on the servers before the trainer started
    (``TEPO_SGLANG_RELEASED``, comma-separated; unset or empty: none). An unknown tag, or tags
    released for a run that is not colocated (nothing would take them back), is an error."""
    raw = os.environ.get(RELEASED_ENV, "")
    tags = [t.strip() for t in raw.split(",") if t.strip()]
    try:
        memory_tags(tags)
    except ValueError as exc:
        raise ValueError(f"{RELEASED_ENV}={raw!r}: {exc}") from None
    if tags and not rollout.colocated:
        raise ValueError(f"{RELEASED_ENV}={raw!r}: the launcher released the servers' memory (a colocated launch) "
                         "but rollout.colocated is false, so nothing would take it back; set rollout.colocated: true")
    return tuple(tags)


def check(rollout: RolloutConfig) -> None:
    """The settings errors of an SGLang run, before the actor is built."""
    sglang_urls(rollout)
    released_tags(rollout)


def weight_sync(rollout: RolloutConfig, fleet, urls: List[str], is_sender: bool, fault=None,
                lora_adapters: bool = False) -> WeightSync:
    """The weight sync of ``rollout.sync_mode`` to ``fleet`` (None on a rank that only drains the
    export); the mode's own options from ``rollout``, the servers' ``urls`` and the run's ``fault``
    section (the update group's time-out). ``lora_adapters`` (``actor.lora.sync: adapters``): the
    LoRA adapters' sync instead (``weight_sync/lora.py``)."""
    if lora_adapters:
        return LoraAdapterSync(fleet, wire_dtype=getattr(torch, rollout.sync_dtype), is_sender=is_sender)
    mode = rollout.sync_mode
    return make_weight_sync(mode, fleet, bucket_bytes=rollout.sync_bucket_mb << 20,
                            wire_dtype=getattr(torch, rollout.sync_dtype), is_sender=is_sender,
                            keep_buffers=rollout.sync_keep_buffers,
                            **SYNC_MODES[mode].options_from(rollout, urls, fault))


def attach_fleet(settings: EngineSettings) -> SGLangFleet:
    """The driver's engine: the fleet of the configured servers, with its sending weight sync."""
    r = settings.rollout
    urls = sglang_urls(r)
    keys = [os.environ.get(API_KEY_ENV) or None] * len(urls)
    f = settings.fault
    request_s = request_limit_s(r)  # (time_limits.py: from max_new_tokens where not set)
    fleet = SGLangFleet(FleetConfig(urls=urls, api_keys=keys, request_timeout=request_s,
                                    router=r.router,  # (a call's limit: its waves on the servers' slots)
                                    probe_timeout=f.probe_timeout_s, return_timeout=f.server_return_timeout_s,
                                    server_restarts=f.server_restarts, restart_backoff=f.restart_backoff_s,
                                    released=released_tags(r), restart_gate=os.environ.get(RESTART_GATE_ENV, ""),
                                    routing=settings.routing))
    fleet.weight_sync = weight_sync(r, fleet, urls, True, f, lora_adapters=settings.lora_adapters)
    return fleet


def follower_sync(settings: EngineSettings) -> WeightSync:
    """What a rank other than the driver holds: a weight sync that drains its part of the export."""
    return weight_sync(settings.rollout, None, sglang_urls(settings.rollout), False, settings.fault,
                       lora_adapters=settings.lora_adapters)


register_engine("sglang", attach_fleet, follower_sync=follower_sync, check=check)
