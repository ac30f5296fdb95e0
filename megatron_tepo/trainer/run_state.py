"""What a run carries from step to step besides the actor, and how it rides in the actor's
checkpoints so that a resumed run continues exactly (tested with a SIGKILL).

:class:`RunState`: the prompt stream (:class:`~megatron_tepo.trainer.groups.PromptStream`: the
order, its RNG and its cursor, saved once, as the rollout source says it stood:
:meth:`~megatron_tepo.trainer.sources.RolloutSource.stream_state`), the step the run starts at, the
count of steps in a row without an update (``fault.max_steps_without_update``: a resumed run goes
on counting) and the caller's JSON state. :meth:`RunState.to_checkpoint` is the JSON the actor's
checkpoint keeps (with the engine's sampling RNG:
:meth:`~megatron_tepo.rollout.engine.RolloutEngine.rng_state`); what the schedule's rollout source
carries between steps (the next step's rollout one step off, the partial-rollout buffer:
:class:`~megatron_tepo.trainer.sources.RolloutSource`) goes into the source's file beside it, under
the source's key; :meth:`RunState.restore` and :meth:`Checkpoints.resume` read both back.
:class:`Checkpoints` is the run's plumbing: which steps save (``train.save_every`` and always the
last), what rides along (``checkpoint_files``, the source's state), the asynchronous saves'
publication and pruning, and the resume from the newest checkpoint that loads.

Left out: the actor's own state (:mod:`megatron_tepo.actor.checkpointing`), the file layout of
the store (:mod:`megatron_tepo.checkpoint.store`) and what a source's state holds
(:mod:`megatron_tepo.trainer.sources`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from megatron_tepo.checkpoint.store import prune_checkpoints, remove_partial_checkpoints
from megatron_tepo.config import RunConfig
from megatron_tepo.rollout.engine import RolloutEngine
from megatron_tepo.trainer.driver import Driver
from megatron_tepo.trainer.groups import PromptStream
from megatron_tepo.trainer.policy import Policy
from megatron_tepo.trainer.sources import OneStepOff, Partial, RolloutSource

__all__ = ["RunState", "Checkpoints", "LOOP_KEYS"]

#: the loop state's own keys (every other key is the caller's JSON state); the sources' keys among them
LOOP_KEYS = ("step", "rng", "order", "cursor", "engine_rng", "steps_without_update", OneStepOff.state_key,
             Partial.state_key)


def _loop_state(step: int, stream: Dict, engine: RolloutEngine, extra: Dict, stalled: int = 0,
                source: Optional[RolloutSource] = None) -> Dict:
    """Everything besides the actor that a resumed run needs to continue exactly (JSON; ``stream``:
    the prompt stream's state; what the rollout source carries goes into its file beside it, named
    under its key)."""
    engine_rng = engine.rng_state()
    carried = {k: None for k in (OneStepOff.state_key, Partial.state_key)}
    if source is not None and source.state_key and source.state() is not None:
        carried[source.state_key] = source.state_file
    return {"step": step, **stream, "engine_rng": engine_rng.tolist() if engine_rng is not None else None,
            "steps_without_update": stalled, **carried, **extra}


def _restore_loop_state(state: Dict, stream: PromptStream, engine: RolloutEngine) -> int:
    stream.restore(state)
    if state.get("engine_rng") is not None:
        engine.set_rng_state(torch.tensor(state["engine_rng"], dtype=torch.uint8))
    return int(state["step"])


@dataclass
class RunState:
    """Everything besides the actor that a run carries from step to step (see the module docstring)."""
    stream: PromptStream  # the prompts' order and RNG (the group producer draws from it)
    extra: Dict = field(default_factory=dict)  # the caller's JSON state, saved with each checkpoint
    start: int = 1  # the first step this process runs
    stalled: int = 0  # steps in a row without an update (fault.max_steps_without_update)

    @classmethod
    def new(cls, cfg: RunConfig, n_prompts: int, extra: Optional[Dict] = None) -> "RunState":
        return cls(PromptStream.seeded(n_prompts, cfg.train.seed), extra if extra is not None else {})

    def to_checkpoint(self, step: int, engine: RolloutEngine, source: Optional[RolloutSource] = None) -> Dict:
        stream = source.stream_state(self.stream) if source is not None else self.stream.state()
        return _loop_state(step, stream, engine, self.extra, self.stalled, source)

    def restore(self, state: Dict, engine: RolloutEngine) -> None:
        """The state saved at a step (the run continues at the next one); the rollout source's is
        read by :meth:`Checkpoints.resume`, on the driver."""
        self.start = _restore_loop_state(state, self.stream, engine) + 1
        self.stalled = int(state.get("steps_without_update", 0))  # (0 in checkpoints written before it was saved)
        self.extra.update({k: v for k, v in state.items() if k not in LOOP_KEYS})


class Checkpoints:
    """The run's checkpoint plumbing (see the module docstring). ``root`` None: no checkpoints."""

    def __init__(self, cfg: RunConfig, actor: Policy, root: Optional[Path], files: Optional[Callable[[Path], None]],
                 driver: Driver):
        self.cfg, self.actor, self.root, self.files, self.driver = cfg, actor, root, files, driver

    def clean(self) -> None:
        """Remove the leftovers of interrupted saves."""
        if self.root:
            remove_partial_checkpoints(self.root)

    def resume(self, state: RunState, engine, report: Optional[Callable[[str], None]],
               source: Optional[RolloutSource] = None) -> Optional[Path]:
        """Collective: load the newest complete checkpoint that loads (a damaged one is reported and
        the one before it used) into the actor, ``state`` and (on the driver) the rollout
        ``source``; None when there is none to resume."""
        if not (self.root and self.cfg.train.resume):
            return None
        latest, saved = self.actor.load_newest_checkpoint(self.root, report)
        if latest is None:
            return None
        state.restore(saved, engine)
        if source is not None and source.state_key and saved.get(source.state_key):
            path = Path(latest) / saved[source.state_key]
            self.driver.local(lambda: source.restore(source.read_state(path)))
        state.extra["resumed_from"] = str(latest)
        return latest

    def due(self, step: int) -> bool:
        """Whether ``step`` writes a checkpoint: every ``train.save_every`` steps and the last one."""
        return _due(self.cfg, self.root, step)

    def save(self, step: int, state: RunState, engine, source: Optional[RolloutSource] = None) -> None:
        """Collective: publish an asynchronous save that is written by now, then this step's
        checkpoint when one is due (with what the rollout ``source`` carries, on the driver)."""
        _finalize_saves(self.actor)
        _save(self.cfg, self.actor, self.root, step, state.to_checkpoint(step, engine, source), self.files,
              self.driver, source)

    def finish(self) -> None:
        """Collective: every checkpoint complete (the asynchronous one in flight waited for)."""
        _finalize_saves(self.actor, blocking=True)


def _finalize_saves(actor: Policy, blocking: bool = False) -> None:
    """Collective: publish the policy's asynchronous checkpoint saves that are written (``blocking``:
    wait for them)."""
    actor.finalize_checkpoints(blocking=blocking)


def _due(cfg: RunConfig, root: Optional[Path], step: int) -> bool:
    t = cfg.train
    return bool(root) and (step == t.steps or bool(t.save_every and step % t.save_every == 0))


def _save(cfg: RunConfig, actor, root: Optional[Path], step: int, state: Dict, files, driver: Driver,
          source: Optional[RolloutSource] = None) -> None:
    """Checkpoint every ``train.save_every`` steps and always at the last one; prune old ones.
    What the rollout source carries between steps is saved with it (its ``state_file``)."""
    if not _due(cfg, root, step):
        return
    carried = source.state() if source is not None and source.state_key else None

    def write_extra(tmp: Path) -> None:
        if files is not None:
            files(tmp)
        if carried is not None:
            source.write_state(carried, tmp / source.state_file)

    def prune(_published: Path) -> None:  # once the new one is complete: the kept ones stay complete
        if cfg.train.keep_checkpoints:
            prune_checkpoints(root, cfg.train.keep_checkpoints)

    driver_only = driver.is_driver
    actor.save_checkpoint(Path(root) / f"step_{step}", state, write_extra=write_extra if driver_only else None,
                          asynchronous=cfg.train.async_save, on_publish=prune if driver_only else None)
