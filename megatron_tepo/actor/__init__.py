"""The Megatron-core actor: parallel layout, token-budget micro-batching, the actor and its
bucketed HF export. The batch it consumes is :class:`megatron_tepo.batch.RolloutBatch` (re-exported
here), shared with the trainer and the engines.

Imports of megatron-core happen lazily inside the functions that need it, so ``batching`` /
``parallel.validate_layout`` stay usable without starting anything.
"""
from megatron_tepo.batch import RolloutBatch
from .batching import balance_to_count, equalize_micro_batch_count, plan_micro_batches
from .parallel import ParallelLayout, destroy_parallel, initialize_parallel, validate_layout

__all__ = ["RolloutBatch", "ParallelLayout", "validate_layout", "initialize_parallel",
           "destroy_parallel", "plan_micro_batches", "balance_to_count",
           "equalize_micro_batch_count", "MegatronActor", "OptimConfig"]


def __getattr__(name):
    if name in ("MegatronActor", "OptimConfig"):
        from . import actor

        return getattr(actor, name)
    raise AttributeError(name)
