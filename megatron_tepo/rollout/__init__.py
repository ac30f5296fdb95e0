"""Rollout engines: the interface (``engine``), the engines by name (``registry``), the embedded
in-process engine (``embedded``); the SGLang fleet in ``sglang/``. Nothing here imports Megatron.

The interface's names are loaded on first use: importing a submodule that needs no torch (the
SGLang server's options, which the fit check reads on a login node) loads no torch."""
import importlib

__all__ = ["RolloutEngine", "Sample", "Group", "SamplingParams", "FINISH_STOP", "FINISH_LENGTH", "FINISH_ABORT"]


def __getattr__(name):
    if name in __all__:
        return getattr(importlib.import_module(".engine", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
