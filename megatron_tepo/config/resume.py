"""What a resumed run may change against its checkpoint's config, and what did change.

Left out: the decision (``trainer/main.py:check_resume`` refuses, naming the changes, unless
``train.allow_config_change``).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

__all__ = ["RESUME_MAY_CHANGE", "changed_settings"]


#: Settings a resumed run may change without ``train.allow_config_change``: how long it runs, how
#: often it saves / evaluates, where it finds its servers and workers (a requeued job's servers
#: have new addresses), and where the run folder itself is (the checkpoint resumed from is found in
#: ``train.output_dir``, so a different one there means the folder was moved, or is named by
#: another path).
RESUME_MAY_CHANGE = (
    "train.steps", "train.save_every", "train.keep_checkpoints", "train.async_save", "train.eval_every",
    "train.export_hf",
    "train.resume", "train.allow_config_change", "train.output_dir", "rollout.sglang_urls",
    "rollout.request_timeout_s", "rollout.decode_floor_tokens_per_s", "rollout.router", "rollout.sync_address", "reward.workers", "fault", "notes",
)


def changed_settings(old: Dict[str, Any], new: Dict[str, Any], prefix: str = "",
                     defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Tuple[Any, Any]]:
    """Dotted key -> (old, new) for every leaf that differs between two ``to_dict`` trees. With
    ``defaults`` (``to_dict`` of the default config), a setting ``old`` lacks -- a checkpoint written
    before the setting existed, which then ran as its default does -- is no change while ``new`` keeps
    its default."""
    out: Dict[str, Tuple[Any, Any]] = {}
    defaults = defaults if isinstance(defaults, dict) else {}
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}.{key}" if prefix else key
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a is _ABSENT and key in defaults and b == defaults[key]:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and key != "loss_args":
            out.update(changed_settings(a, b, path, defaults.get(key)))
        elif a != b:
            out[path] = ("<absent>" if a is _ABSENT else a, "<absent>" if b is _ABSENT else b)
    return out


_ABSENT = object()
