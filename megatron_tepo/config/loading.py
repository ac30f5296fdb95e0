"""From YAML data to a typed, validated :class:`~megatron_tepo.config.schema.RunConfig`: every key
checked against the dataclasses (an unknown key names its dotted path, its file and line and the
closest valid keys; a moved key says where it lives now), every value coerced to its field's type
(``Literal`` choices included), dotted command-line overrides applied, the result validated
(:func:`~megatron_tepo.config.validation.validate`); and written back (:func:`dump_config`).

Left out: the cross-field rules (``validation``) and the YAML reading (``yaml_io``).
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Union

import yaml

from megatron_tepo.config.schema import ConfigError, RunConfig
from megatron_tepo.config.validation import validate
from megatron_tepo.config.yaml_io import BASE_KEY, _deep_merge, _read_bases, _read_yaml

__all__ = ["MOVED_KEYS", "from_dict", "from_file_data", "build_section", "to_dict", "apply_overrides", "load_config",
           "dump_config"]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str, where: Dict[str, str]) -> Any:
    loc = f" ({where[path]})" if path in where else ""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}{loc}: expected a mapping for section '{path}', "
                              f"found {type(value).__name__} {value!r}")
        return _build(tp, value, path, where)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and len(sections) == 1:  # an optional section: its own errors (the key)
            return _coerce(value, sections[0], path, where)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path, where)
            except ConfigError:
                pass
        raise ConfigError(f"{path}{loc}: expected {_type_name(tp)}, found {type(value).__name__} {value!r}")
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in typing.get_args(tp):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on / off as a boolean
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}{loc}: expected {_type_name(tp)}, found {value!r}")
        return value
    if origin in (list, List):
        if not isinstance(value, list):
            raise ConfigError(f"{path}{loc}: expected a list, found {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]", where) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}{loc}: expected a mapping, found {type(value).__name__} {value!r}")
        _, val_tp = typing.get_args(tp) or (str, Any)
        return {str(k): _coerce(v, val_tp, f"{path}.{k}", where) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}{loc}: expected bool (true/false), found {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}{loc}: expected int, found {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept numeric strings for floats.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"{path}{loc}: expected float, found {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}{loc}: expected str, found {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported schema type {tp!r}")  # pragma: no cover - schema bug


#: Keys that moved to another section: the error says where they live now.
MOVED_KEYS = {
    "parallel.sequence_parallel": "actor.sequence_parallel",
    "train.max_tokens_per_micro_batch": "actor.max_tokens_per_micro_batch",
    "model.dtype": "actor.precision (bf16 or fp32)",
    # a launch file's ``launch`` section (megatron_tepo/launch/schema.py reads it with build_section)
    "launch.actor_precision": "actor.precision",
    "launch.recompute": "actor.recompute",
}


def _build(cls: type, data: Dict[str, Any], prefix: str, where: Dict[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            path = f"{prefix}.{key}" if prefix else key
            loc = f" ({where[path]})" if path in where else ""
            if path in MOVED_KEYS:
                raise ConfigError(f"{path}{loc}: moved to {MOVED_KEYS[path]} (the 'actor' section holds "
                                  f"every setting of how the actor computes)")
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            section = f"section '{prefix}'" if prefix else "the top level"
            raise ConfigError(f"{path}{loc}: unknown key in {section}{hint} "
                              f"(valid keys: {', '.join(names)})")
    kwargs = {}
    for name in names:
        if name in data:
            path = f"{prefix}.{name}" if prefix else name
            kwargs[name] = _coerce(data[name], hints[name], path, where)
    return cls(**kwargs)


def from_dict(data: Dict[str, Any], where: Optional[Dict[str, str]] = None) -> RunConfig:
    """Build and validate a :class:`RunConfig` from plain data."""
    cfg = _build(RunConfig, data, "", where or {})
    validate(cfg)
    return cfg


def from_file_data(path: Union[str, Path], data: Dict[str, Any], where: Dict[str, str]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from the data of the file ``path``, already read
    (:func:`read_yaml_file` with ``where``) and patched by the caller -- the RunConfig part of a
    launch file --: its ``_base_`` files merged under it as :func:`load_config` does; errors name
    the file and line (or the override) of the key."""
    path = Path(path).resolve()
    data, own_where = dict(data), dict(where)
    merged = _read_bases(data.pop(BASE_KEY, []), path, where)
    where.update(own_where)
    return from_dict(_deep_merge(merged, data), where)


def build_section(cls: type, data: Any, prefix: str, where: Optional[Dict[str, str]] = None) -> Any:
    """One section (a dataclass) from plain data by the run config's own typed rules -- unknown
    keys with the closest valid ones, moved keys (:data:`MOVED_KEYS`), types, ``Literal`` choices --;
    errors name the dotted path under ``prefix`` and, where ``where`` knows it, the file and line.
    For sections that are not the run config's (a launch file's ``launch``)."""
    return _coerce(data, cls, prefix, where or {})


def to_dict(cfg: Any) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def apply_overrides(data: Dict[str, Any], overrides: List[str], where: Dict[str, str]) -> Dict[str, Any]:
    """Apply ``a.b.c=value`` strings to nested data (value parsed as YAML)."""
    data = _deep_merge({}, data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. algorithm.kl_coef=0.001")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: malformed key {key!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from None
        parts = key.split(".")
        node = data
        for depth, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[:depth + 1])}' is not a section")
            node = nxt
        node[parts[-1]] = value
        for depth in range(1, len(parts) + 1):  # so an error on any part of the key names it
            where.setdefault(".".join(parts[:depth]), f"override {item!r}")
        where[key] = f"override {item!r}"
    return data


def load_config(path: Optional[Union[str, Path, List[Union[str, Path]]]] = None,
                overrides: Optional[List[str]] = None) -> RunConfig:
    """Read ``path`` (with its ``_base_`` chain; a list of files is merged left to right, later
    files winning), apply ``overrides``, build and validate."""
    where: Dict[str, str] = {}
    paths = [] if not path else [path] if isinstance(path, (str, Path)) else list(path)
    data: Dict[str, Any] = {}
    for p in paths:
        data = _deep_merge(data, _read_yaml(Path(p), where))
    data = apply_overrides(data, list(overrides or []), where)
    return from_dict(data, where)


def dump_config(cfg: RunConfig, path: Union[str, Path]) -> None:
    """Write the resolved config (what actually ran) atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
    tmp.replace(path)
