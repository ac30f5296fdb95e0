"""What a source file of the package imports, read with ``ast`` (not by importing it), the first
cycle of an import graph, and what importing modules loads in a fresh interpreter: the shared
reader of the import-direction tests (tests/test_layers.py, tests/rollout/test_import_direction.py,
tests/environments/test_import_direction.py). Leaves out imports made by string
(``importlib.import_module``) and what the imported modules import in turn."""
import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterable, List, Mapping, Optional

PKG = Path(__file__).resolve().parents[1] / "megatron_tepo"


def imported_modules(path: Path) -> set:
    """Every module ``path`` (a file under megatron_tepo/) imports, at any depth (lazy imports inside
    functions included), as absolute names: ``import a.b`` gives ``a.b``; ``from a import b`` gives
    ``a`` and ``a.b`` (``b`` may be a module); relative imports are resolved from the file's package
    (an ``__init__.py``'s own)."""
    parts = ("megatron_tepo",) + Path(path).resolve().relative_to(PKG).with_suffix("").parts
    pkg = list(parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def import_cycle(edges: Mapping[str, Iterable[str]]) -> Optional[List[str]]:
    """The first import cycle of ``edges`` (a module -> the modules it imports; a module importing
    itself does not count), as the path that closes it (``[a, b, a]``), or None. Depth first, in
    sorted order."""
    seen, stack = set(), []

    def visit(n):
        if n in stack:
            return stack + [n]
        if n in seen:
            return None
        stack.append(n)
        for m in sorted(set(edges.get(n, ())) - {n}):
            found = visit(m)
            if found:
                return found
        stack.pop()
        seen.add(n)
        return None

    for n in sorted(edges):
        found = visit(n)
        if found:
            return found
    return None


def modules_loaded_by(names: Iterable[str]) -> set:
    """Every module in ``sys.modules`` after a fresh interpreter imports ``names``."""
    code = f"import json, sys; import {', '.join(names)}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))
