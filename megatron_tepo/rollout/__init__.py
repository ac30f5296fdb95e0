"""Rollout engines: the interface (``engine``), the engines by name (``registry``), the embedded
in-process engine (``embedded``); the SGLang fleet in ``sglang/``. Nothing here imports Megatron."""
from .engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Group, RolloutEngine, Sample, SamplingParams

__all__ = ["RolloutEngine", "Sample", "Group", "SamplingParams", "FINISH_STOP", "FINISH_LENGTH", "FINISH_ABORT"]
