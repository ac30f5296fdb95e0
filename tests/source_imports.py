"""What a source file of the package imports, read with ``ast`` (not by importing it): the shared
reader of the import-direction tests (tests/test_layers.py, tests/rollout/test_import_direction.py).
Leaves out imports made by string (``importlib.import_module``) and what the imported modules
import in turn."""
import ast
from pathlib import Path

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
