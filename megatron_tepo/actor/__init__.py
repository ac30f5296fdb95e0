"""The Megatron-core actor: token-budget micro-batching, the actor and its bucketed HF export.
Its parallel layout is :class:`megatron_tepo.layout.ParallelLayout`; the process groups, spec and
sharding it builds on are the megatron backend's (:mod:`megatron_tepo.megatron`). The batch it consumes is :class:`megatron_tepo.batch.RolloutBatch` (re-exported
here), shared with the trainer and the engines.

Imports of megatron-core happen lazily inside the functions that need it, so ``batching`` stays
usable without starting anything.
"""
from megatron_tepo.batch import RolloutBatch
from .batching import balance_to_count, equalize_micro_batch_count, plan_micro_batches

__all__ = ["RolloutBatch", "plan_micro_batches", "balance_to_count",
           "equalize_micro_batch_count", "MegatronActor", "OptimConfig", "actor_args", "build_policy"]


def actor_args(cfg) -> dict:
    """``MegatronActor``'s keyword arguments from the run config: the layout (``parallel``), how it
    computes (``actor``), the optimizer (``optim``), the seed, the LR horizon and the process
    groups' time-out (longer than the watchdog's longest phase, ``fault``)."""
    updates_per_step = cfg.train.epochs_per_step * (cfg.rollout.prompts_per_step // cfg.train.mini_batch_prompts)
    return dict(layout=cfg.parallel, optim=cfg.optim, actor_config=cfg.actor, seed=cfg.train.seed,
                total_steps=cfg.train.steps * updates_per_step,
                process_group_timeout_s=cfg.fault.process_group_timeout_s())


def build_policy(cfg, model_dir: str):
    """The trainer's policy backend ``megatron`` (:func:`megatron_tepo.trainer.policy.build_policy`):
    a :class:`MegatronActor` loaded from the HF checkpoint ``model_dir`` with ``cfg``'s settings."""
    from .actor import MegatronActor

    return MegatronActor(model_dir, hf_weights=model_dir, **actor_args(cfg))


def __getattr__(name):
    if name in ("MegatronActor", "OptimConfig"):
        from . import actor

        return getattr(actor, name)
    raise AttributeError(name)
