"""YAML with line numbers: every key of a config file is recorded with ``file:line`` (``where``), so
that an error names where the key came from; ``_base_: other.yaml`` (or a list) inherits, paths
relative to the file, merged under it.

Left out: environment-variable interpolation, YAML tags beyond the safe loader's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import yaml

from megatron_tepo.config.schema import ConfigError

__all__ = ["BASE_KEY", "read_yaml_file", "yaml_error"]


BASE_KEY = "_base_"


def _construct(node: yaml.Node, where: Dict[str, str], path: str, source: str) -> Any:
    """Turn a composed YAML node into Python data, recording ``file:line`` of every key."""
    if isinstance(node, yaml.MappingNode):
        out: Dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = yaml.safe_load(yaml.serialize(key_node)) if not isinstance(key_node, yaml.ScalarNode) \
                else key_node.value
            if not isinstance(key, str):
                raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: key {key!r} is not a string")
            sub = f"{path}.{key}" if path else key
            if key in out:
                raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: duplicate key '{sub}'")
            where[sub] = f"{source}:{key_node.start_mark.line + 1}"
            out[key] = _construct(value_node, where, sub, source)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, where, f"{path}[{i}]", source) for i, v in enumerate(node.value)]
    return yaml.safe_load(yaml.serialize(node))


def yaml_error(path: Union[str, Path], exc: "yaml.YAMLError") -> ConfigError:
    """``<file>:<line>:<column>: invalid YAML: <problem>`` (1-based) for a YAML parse error."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    context, ctx_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and ctx_mark is not None and ctx_mark is not mark:
        context += f" (from line {ctx_mark.line + 1}, column {ctx_mark.column + 1})"
    problem = ", ".join(filter(None, [context, getattr(exc, "problem", None)])) or str(exc)
    return ConfigError(f"{where}: invalid YAML: {' '.join(problem.split())}")


def read_yaml_file(path: Union[str, Path], where: Optional[Dict[str, str]] = None) -> Any:
    """A plain YAML file's data (launch files, benchmark lists); errors name file, line, column.
    ``where``, when given, gets the ``file:line`` of every key (dotted path), as the run config's
    own reader records them, and a duplicate key is then an error; ``_base_`` is left as data."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if where is None:
            return yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise yaml_error(path, exc) from None
    return None if node is None else _construct(node, where, "", str(path))


def _read_yaml(path: Path, where: Dict[str, str], _seen: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"{path}: circular {BASE_KEY} chain: " + " -> ".join(map(str, _seen + (path,))))
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise yaml_error(path, exc) from None
    if node is None:
        return {}
    own_where: Dict[str, str] = {}
    data = _construct(node, own_where, "", str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, found {type(data).__name__}")
    own_where.pop(BASE_KEY, None)
    merged = _read_bases(data.pop(BASE_KEY, []), path, where, _seen)
    where.update(own_where)
    return _deep_merge(merged, data)


def _read_bases(bases: Any, path: Path, where: Dict[str, str], _seen: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    """The ``_base_`` files of ``path`` (relative to its folder), merged left to right."""
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: {BASE_KEY} must be a file name or a list of file names")
    merged: Dict[str, Any] = {}
    for base in bases:
        merged = _deep_merge(merged, _read_yaml(path.parent / base, where, _seen + (path,)))
    return merged


def _deep_merge(base: Dict[str, Any], top: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "loss_args":
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
