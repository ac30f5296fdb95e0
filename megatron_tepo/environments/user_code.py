"""A user's object by import path: ``package.module:name`` or ``path/to/file.py:name``
(:func:`load_object`), the one loader of user code (``environment.name``, ``reward.function``).
Standard library only.

Left out: installing anything; a module is found on ``sys.path``, then beside the working directory.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import zlib
from pathlib import Path
from typing import Any

__all__ = ["load_object", "is_import_path"]


def is_import_path(spec: Any) -> bool:
    """Whether ``spec`` has the form ``something:name``."""
    return isinstance(spec, str) and spec.count(":") == 1 and all(spec.split(":"))


def load_object(spec: str, where: str) -> Any:
    """The object ``spec`` names: ``package.module:name`` or ``path/to/file.py:name``. A
    ``ValueError`` of one line naming ``where`` when the spec is malformed, the module or file cannot
    be imported, or it has no such name."""
    if not is_import_path(spec):
        raise ValueError(f"{where}: expected 'package.module:name' or 'path/to/file.py:name', got {spec!r}")
    mod_name, attr = spec.split(":")
    try:
        if mod_name.endswith(".py") or "/" in mod_name or os.sep in mod_name:
            path = Path(mod_name).expanduser().resolve()
            if not path.is_file():
                raise ValueError(f"{where}: {mod_name}: no such file")
            name = f"mtepo_user_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
            module = sys.modules.get(name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[name] = module
                try:
                    loader_spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(name, None)
                    raise
        else:
            try:
                module = importlib.import_module(mod_name)
            except ModuleNotFoundError as exc:
                if exc.name is None or not mod_name.startswith(exc.name) or os.getcwd() in sys.path:
                    raise
                sys.path.insert(0, os.getcwd())  # (a module beside the command, as ``python -m`` finds it)
                module = importlib.import_module(mod_name)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 -- any failure of the user's import: one line naming the field
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{where}: cannot import {mod_name!r} ({type(exc).__name__}: {first})") from None
    if not hasattr(module, attr):
        raise ValueError(f"{where}: {mod_name!r} has no {attr!r}")
    return getattr(module, attr)
