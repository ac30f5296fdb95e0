"""The command-line tools, installed as console commands (``pyproject.toml``) and runnable from a
checkout as ``python tools/<name>.py``: ``mtepo-train``, ``mtepo-evaluate``,
``mtepo-convert-hf-to-megatron``, ``mtepo-convert-megatron-to-hf``, ``mtepo-fit-check``,
``mtepo-plot-metrics``. Each module's docstring is its manual. The Slurm / nemo-run launchers
(``slurm/``, ``tools/launch_nemo_run.py``) and ``tools/make_tiny_model.py`` need the checkout
(the batch scripts, the tiny task's sources) and stay there."""
