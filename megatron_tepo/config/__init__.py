"""Typed run configuration: YAML files plus dotted command-line overrides, validated on load.

A run is described by one :class:`RunConfig` (nested dataclasses, :mod:`.schema`). It is read from
a YAML file that may inherit from others (``_base_: other.yaml`` or a list of them, paths relative
to the file, :mod:`.yaml_io`), then patched by overrides such as ``algorithm.kl_coef=0.001`` (the
value is parsed as YAML, so ``true``, ``1e-3``, ``null`` and ``[1, 2]`` work, :mod:`.loading`).
Every key is checked against the dataclasses:

- an unknown key is an error naming its dotted path, the file and line it came from (or the
  override), and the closest valid keys;
- a value of the wrong type is an error naming the path, the expected type and what was found;
- cross-field rules (loss names, loss-specific arguments, the layout's settings) are checked in
  :func:`validate` (:mod:`.validation`), again naming the field.

What a resumed run may change is :mod:`.resume`'s. Deliberately left out: environment-variable
interpolation and config "groups"; a config is one file tree plus overrides, so what ran is
exactly what ``dump_config`` writes next to the run.
"""
from megatron_tepo.config.schema import (WATCHDOG_BACKSTOP_S, PG_TIMEOUT_MARGIN_S, UNWATCHED_PG_TIMEOUT_S,  # noqa: F401
                                         OFFLOAD_LEVELS,
                                         ActorConfig, AdvantageConfig, AlgorithmConfig, ConfigError, DataConfig,
                                         EnvironmentConfig,
                                         FaultConfig, LoraConfig, ModelConfig, OptimConfig, ParallelLayout, RewardConfig,
                                         RolloutConfig, RolloutCorrectionConfig, RunConfig, TrainConfig)
from megatron_tepo.config.yaml_io import read_yaml_file, yaml_error  # noqa: F401
from megatron_tepo.config.validation import validate  # noqa: F401
from megatron_tepo.config.loading import (MOVED_KEYS, apply_overrides, build_section, dump_config,  # noqa: F401
                                          from_dict, from_file_data, load_config, to_dict)
from megatron_tepo.config.resume import RESUME_MAY_CHANGE, changed_settings  # noqa: F401

__all__ = [
    "ConfigError", "RunConfig", "AlgorithmConfig", "RolloutCorrectionConfig", "AdvantageConfig", "RolloutConfig",
    "OptimConfig", "TrainConfig", "ParallelLayout", "ActorConfig", "ModelConfig", "DataConfig", "RewardConfig",
    "FaultConfig", "EnvironmentConfig", "LoraConfig", "load_config",
    "from_dict", "from_file_data", "build_section", "to_dict", "apply_overrides", "dump_config", "validate",
    "read_yaml_file",
    "RESUME_MAY_CHANGE", "changed_settings",
]
