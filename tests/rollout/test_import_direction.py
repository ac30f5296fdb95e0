"""The sync path points one way: ``megatron_tepo.rollout`` knows nothing of Megatron (no
``models/``, ``megatron/``, ``actor/``, ``trainer/`` and no megatron-core), its modules import each
other without a cycle, and the actor's export reaches the engines only through the shared
bucket format (``megatron_tepo.buckets``)."""
import ast
import json
import subprocess
import sys
from pathlib import Path

ROLLOUT = Path(__file__).resolve().parents[2] / "megatron_tepo" / "rollout"
FORBIDDEN = ("megatron_tepo.models", "megatron_tepo.megatron", "megatron_tepo.actor", "megatron_tepo.trainer",
             "megatron_tepo.checkpoint", "megatron.")


def _imports(path: Path):
    """Every module a file imports, at any depth (lazy imports inside functions included)."""
    pkg = "megatron_tepo.rollout" + ("" if path.parent == ROLLOUT else "." + path.parent.name)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def test_no_rollout_file_imports_the_megatron_side():
    files = sorted(ROLLOUT.rglob("*.py"))
    assert len(files) >= 6  # the check reads the package
    offenders = {str(f.relative_to(ROLLOUT)): sorted(m for m in _imports(f) if m.startswith(FORBIDDEN) or m == "megatron")
                 for f in files}
    assert {f: m for f, m in offenders.items() if m} == {}


def test_rollout_modules_import_each_other_without_a_cycle():
    mods = {f.stem: f for f in ROLLOUT.glob("*.py") if f.stem != "__init__"}
    edges = {name: {m.rsplit(".", 1)[-1] for m in _imports(f) if m.startswith("megatron_tepo.rollout.")} & set(mods)
             for name, f in mods.items()}
    assert {"engine", "weight_sync"} <= edges["sglang_fleet"]  # (the edges are read)
    seen, stack = set(), []

    def visit(n):
        assert n not in stack, f"import cycle: {' -> '.join(stack + [n])}"
        if n in seen:
            return
        stack.append(n)
        for m in edges[n] - {n}:
            visit(m)
        stack.pop()
        seen.add(n)

    for n in mods:
        visit(n)


def test_importing_the_engines_and_the_sync_loads_no_megatron():
    code = ("import json, sys; import megatron_tepo.rollout.embedded, megatron_tepo.rollout.sglang_fleet, "
            "megatron_tepo.rollout.weight_sync, megatron_tepo.rollout.serve; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "megatron_tepo.rollout.weight_sync" in modules and "megatron_tepo.buckets" in modules
    assert [m for m in modules if m == "megatron" or m.startswith(FORBIDDEN)] == []
