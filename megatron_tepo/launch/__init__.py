"""Launching a run on a cluster, before anything starts: the launch file and the fit check, read by
``tools/fit_check.py``, ``slurm/lib.sh`` and the nemo-run launcher. One module per concern:

* :mod:`.schema` -- the ``launch`` section (:class:`LaunchLayout`; its rollout servers,
  :class:`RolloutServers`: an engine of :mod:`.engines` and one server's options);
* :mod:`.engines` -- the rollout engines whose servers the launchers start (options type, serve module);
* :mod:`.shape` -- the model's shape from its HF config (:class:`ModelShape`);
* :mod:`.memory` -- parameters, activations, actor and server memory per GPU (pure arithmetic);
* :mod:`.report` -- the report text and the errors naming the settings (:class:`FitReport`);
* :mod:`.fit` -- the layout rules and the verdict (:func:`check_layout`, :func:`check_fit`);
* :mod:`.spec` -- the launch file (:func:`load_launch`), the run config it writes, the servers'
  serve command and the ``FIT_*`` shell variables;
* :mod:`.sequence` -- the job's steps after the fit check, in order, which slurm/lib.sh and the
  nemo-run launcher both follow (a colocated launch's ``release`` of the servers' memory among
  them: :mod:`.release` is its command), and lib.sh's rules the nemo-run launcher runs (python,
  trainer env);
* :mod:`.pythons` -- a GPU job's trainer and SGLang pythons, checked before anything starts
  (:func:`check_pythons`; each answers :mod:`.probe_python`, run under it);
* :mod:`.nemo_run` -- the nemo-run launcher (``tools/launch_nemo_run.py``; imports nemo-run).

The arithmetic and how the launchers use all this: docs/LAUNCH.md. Nothing here imports
megatron-core, the actor or the trainer; from ``megatron_tepo.rollout`` it takes one SGLang server's
options type (:mod:`.engines`, the schema of a launch file's servers), the SGLang fleet's process
code (health wait, stop; the nemo-run launcher) and its choice of the SGLang python (:mod:`.pythons`)."""
from .fit import FitError, check_fit, check_layout
from .pythons import check_pythons
from .report import FitReport
from .schema import LaunchLayout, RolloutServers
from .shape import ModelShape, model_shape
from .spec import LaunchSpec, load_launch, render_shell, serve_args, shell_vars, write_run_config

__all__ = ["FitError", "FitReport", "LaunchLayout", "LaunchSpec", "ModelShape", "RolloutServers", "check_fit",
           "check_layout", "check_pythons", "load_launch", "model_shape", "render_shell", "serve_args", "shell_vars",
           "write_run_config"]
