"""The model's shape from a Hugging Face config, for the fit check: :func:`model_shape` reads it through
:func:`megatron_tepo.models.family_config_from_hf`, the project's one reading of HF configs, into
:class:`megatron_tepo.layout.ModelShape`, the one shape type (the layout rules read it too). Left out:
anything of ranks or bytes (:mod:`megatron_tepo.launch.memory`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Union

from megatron_tepo.layout import ModelShape

__all__ = ["ModelShape", "model_shape"]


def model_shape(hf_config: Union[Dict[str, Any], str, Path]) -> ModelShape:
    """Read an HF config (dict or ``config.json`` path) through ``family_config_from_hf``."""
    if not isinstance(hf_config, dict):
        hf_config = json.loads(Path(hf_config).read_text(encoding="utf-8"))
    from megatron_tepo.models import family_config_from_hf

    return family_config_from_hf(hf_config, spec="local").dims()
