"""Launching a run on a cluster: the memory fit check (:mod:`.fit`) used by ``tools/fit_check.py``
and ``slurm/lib.sh`` before anything starts."""
from .fit import FitError, LaunchLayout, SGLangLayout, check_fit, load_launch, model_shape

__all__ = ["FitError", "LaunchLayout", "SGLangLayout", "check_fit", "load_launch", "model_shape"]
