"""What a run carries from step to step besides the actor, and how it rides in the actor's
checkpoints so that a resumed run continues exactly (tested with a SIGKILL).

:class:`RunState`: the prompt order and its RNG, the step the run starts at, the count of steps in
a row without an update (``fault.max_steps_without_update``: a resumed run goes on counting), the
caller's JSON state, and with one-step-off generation the next step's rollout (:attr:`RunState.pending`).
:meth:`RunState.to_checkpoint` is the JSON the actor's checkpoint keeps (with the engine's sampling
RNG); the pending rollout goes into :data:`PENDING_FILE` beside it; :meth:`RunState.restore` reads
both back. :class:`Checkpoints` is the run's plumbing: which steps save (``train.save_every`` and
always the last), what rides along (``checkpoint_files``, the pending rollout), the asynchronous
saves' publication and pruning, and the resume from the newest checkpoint that loads.

Left out: the actor's own state (:mod:`megatron_tepo.actor.checkpointing`) and the file layout of
the store (:mod:`megatron_tepo.checkpoint.store`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from megatron_tepo.actor.checkpointing import load_newest_checkpoint
from megatron_tepo.checkpoint.store import prune_checkpoints, remove_partial_checkpoints
from megatron_tepo.config import RunConfig
from megatron_tepo.rollout.engine import Sample
from megatron_tepo.trainer.driver import Driver
from megatron_tepo.trainer.partial import BUFFER_FILE, read_buffer, write_buffer
from megatron_tepo.trainer.rollouts import Generated

__all__ = ["RunState", "Checkpoints", "PENDING_FILE", "LOOP_KEYS"]

PENDING_FILE = "pending_rollout.pt"
LOOP_KEYS = ("step", "rng", "order", "engine_rng", "pending_rollout", "steps_without_update", "rollout_buffer")


def _loop_state(step: int, rng: random.Random, order: List[int], engine, extra: Dict,
                pending: Optional[Generated] = None, stalled: int = 0, buffer: Optional[Dict] = None) -> Dict:
    """Everything besides the actor that a resumed run needs to continue exactly (JSON; the next
    step's rollout, generated one step off, goes into ``PENDING_FILE`` beside it)."""
    version, internal, gauss = rng.getstate()
    gen = getattr(engine, "generator", None)
    return {"step": step, "rng": [version, list(internal), gauss], "order": order,
            "engine_rng": gen.get_state().tolist() if gen is not None else None,
            "pending_rollout": PENDING_FILE if pending is not None else None,
            "steps_without_update": stalled, "rollout_buffer": BUFFER_FILE if buffer is not None else None, **extra}


def _write_pending(g: Generated, path: Path) -> None:
    torch.save({"prompts": g.prompts, "rewards": g.rewards, "stats": g.stats, "weights_version": g.weights_version,
                "groups": [[(s.token_ids, s.log_probs, s.finish_reason) for s in grp] for grp in g.groups]}, path)


def _read_pending(path: Path) -> Generated:
    try:
        d = torch.load(path, weights_only=True)
        groups = [[Sample(list(t), list(lp), fr) for t, lp, fr in grp] for grp in d["groups"]]
        rewards = d["rewards"]
        if isinstance(rewards, list):  # written before the rewards were one tensor: one per group
            rewards = torch.cat(rewards)
        return Generated(d["prompts"], groups, rewards, d["stats"], int(d["weights_version"]))
    except Exception as exc:  # noqa: BLE001 -- any unreadable file: one line naming it
        raise ValueError(f"{path}: the next step's rollout saved with this checkpoint cannot be read "
                         f"({type(exc).__name__}: {exc}); resume from an earlier checkpoint") from None


def _restore_loop_state(state: Dict, rng: random.Random, order: List[int], engine) -> int:
    version, internal, gauss = state["rng"]
    rng.setstate((version, tuple(internal), gauss))
    order[:] = state["order"]
    if state.get("engine_rng") is not None and getattr(engine, "generator", None) is not None:
        engine.generator.set_state(torch.tensor(state["engine_rng"], dtype=torch.uint8))
    return int(state["step"])


@dataclass
class RunState:
    """Everything besides the actor that a run carries from step to step (see the module docstring)."""
    rng: random.Random
    order: List[int]
    extra: Dict = field(default_factory=dict)  # the caller's JSON state, saved with each checkpoint
    start: int = 1  # the first step this process runs
    stalled: int = 0  # steps in a row without an update (fault.max_steps_without_update)
    pending: Optional[Generated] = None  # the next step's rollout (one-step-off), on the driver
    buffer: Optional[Dict] = None  # partial rollout: the rollout buffer at the last update, on the driver

    @classmethod
    def new(cls, cfg: RunConfig, n_prompts: int, extra: Optional[Dict] = None) -> "RunState":
        return cls(random.Random(cfg.train.seed), list(range(n_prompts)), extra if extra is not None else {})

    def to_checkpoint(self, step: int, engine) -> Dict:
        return _loop_state(step, self.rng, self.order, engine, self.extra, self.pending, self.stalled, self.buffer)

    def restore(self, state: Dict, engine) -> None:
        """The state saved at a step (the run continues at the next one); the pending rollout is
        read by :meth:`Checkpoints.resume`, on the driver."""
        self.start = _restore_loop_state(state, self.rng, self.order, engine) + 1
        self.stalled = int(state.get("steps_without_update", 0))  # (0 in checkpoints written before it was saved)
        self.extra.update({k: v for k, v in state.items() if k not in LOOP_KEYS})


class Checkpoints:
    """The run's checkpoint plumbing (see the module docstring). ``root`` None: no checkpoints."""

    def __init__(self, cfg: RunConfig, actor, root: Optional[Path], files: Optional[Callable[[Path], None]],
                 driver: Driver):
        self.cfg, self.actor, self.root, self.files, self.driver = cfg, actor, root, files, driver

    def clean(self) -> None:
        """Remove the leftovers of interrupted saves."""
        if self.root:
            remove_partial_checkpoints(self.root)

    def resume(self, state: RunState, engine, report: Optional[Callable[[str], None]]) -> Optional[Path]:
        """Collective: load the newest complete checkpoint that loads (a damaged one is reported and
        the one before it used) into the actor and ``state``; None when there is none to resume."""
        if not (self.root and self.cfg.train.resume):
            return None
        latest, saved = load_newest_checkpoint(self.actor, self.root, report)
        if latest is None:
            return None
        state.restore(saved, engine)
        if saved.get("pending_rollout"):
            state.pending = self.driver.local(partial(_read_pending, Path(latest) / saved["pending_rollout"]))
        if saved.get("rollout_buffer"):
            state.buffer = self.driver.local(partial(read_buffer, Path(latest) / saved["rollout_buffer"]))
        state.extra["resumed_from"] = str(latest)
        return latest

    def due(self, step: int) -> bool:
        """Whether ``step`` writes a checkpoint: every ``train.save_every`` steps and the last one."""
        return _due(self.cfg, self.root, step)

    def save(self, step: int, state: RunState, engine) -> None:
        """Collective: publish an asynchronous save that is written by now, then this step's
        checkpoint when one is due."""
        _finalize_saves(self.actor)
        _save(self.cfg, self.actor, self.root, step, state.to_checkpoint(step, engine), self.files, self.driver,
              state.pending, state.buffer)

    def finish(self) -> None:
        """Collective: every checkpoint complete (the asynchronous one in flight waited for)."""
        _finalize_saves(self.actor, blocking=True)


def _finalize_saves(actor, blocking: bool = False) -> None:
    """Collective: publish the actor's asynchronous checkpoint saves that are written (``blocking``:
    wait for them)."""
    finalize = getattr(actor, "finalize_checkpoints", None)
    if finalize is not None:
        finalize(blocking=blocking)


def _due(cfg: RunConfig, root: Optional[Path], step: int) -> bool:
    t = cfg.train
    return bool(root) and (step == t.steps or bool(t.save_every and step % t.save_every == 0))


def _save(cfg: RunConfig, actor, root: Optional[Path], step: int, state: Dict, files, driver: Driver,
          pending: Optional[Generated] = None, buffer: Optional[Dict] = None) -> None:
    """Checkpoint every ``train.save_every`` steps and always at the last one; prune old ones.
    With one-step-off generation the next step's rollout is saved with it (``PENDING_FILE``)."""
    if not _due(cfg, root, step):
        return

    def write_extra(tmp: Path) -> None:
        if files is not None:
            files(tmp)
        if pending is not None:
            _write_pending(pending, tmp / PENDING_FILE)
        if buffer is not None:
            write_buffer(buffer, tmp / BUFFER_FILE)

    def prune(_published: Path) -> None:  # once the new one is complete: the kept ones stay complete
        if cfg.train.keep_checkpoints:
            prune_checkpoints(root, cfg.train.keep_checkpoints)

    driver_only = driver.is_driver
    actor.save_checkpoint(Path(root) / f"step_{step}", state, write_extra=write_extra if driver_only else None,
                          asynchronous=cfg.train.async_save, on_publish=prune if driver_only else None)
