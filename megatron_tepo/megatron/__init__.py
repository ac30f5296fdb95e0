"""megatron-core integration helpers (CPU work-arounds). See :mod:`.cpu_patches`."""
from .cpu_patches import PATCHES, applied_patches, apply_cpu_patches, revert_cpu_patches

__all__ = ["PATCHES", "applied_patches", "apply_cpu_patches", "revert_cpu_patches"]
