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
           "equalize_micro_batch_count", "MegatronActor", "OptimConfig"]


def __getattr__(name):
    if name in ("MegatronActor", "OptimConfig"):
        from . import actor

        return getattr(actor, name)
    raise AttributeError(name)
