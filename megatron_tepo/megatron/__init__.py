"""The megatron backend, the package's one home of megatron-core (no module outside it imports
megatron-core: tests/test_layers.py): the model stack (:mod:`.resolve`, :mod:`.gpt`, :mod:`.hybrid`, :mod:`.model`),
the process groups (:mod:`.parallel`), the dist checkpoints (:mod:`.dist_checkpoint`, the streaming
save :mod:`.dist_writer`, the asynchronous saves' writer :mod:`.async_save`), CPU work-arounds
(:mod:`.cpu_patches`) and the version glue (:mod:`.compat`)."""
from .cpu_patches import PATCHES, applied_patches, apply_cpu_patches, revert_cpu_patches

__all__ = ["PATCHES", "applied_patches", "apply_cpu_patches", "revert_cpu_patches"]
