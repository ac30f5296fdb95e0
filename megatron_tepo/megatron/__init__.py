"""megatron-core integration helpers: CPU work-arounds (:mod:`.cpu_patches`) and the version glue
(:mod:`.compat`)."""
from .cpu_patches import PATCHES, applied_patches, apply_cpu_patches, revert_cpu_patches

__all__ = ["PATCHES", "applied_patches", "apply_cpu_patches", "revert_cpu_patches"]
