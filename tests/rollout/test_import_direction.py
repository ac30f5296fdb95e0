"""The sync path points one way: ``megatron_tepo.rollout`` knows nothing of Megatron (no
``models/``, ``megatron/``, ``actor/``, ``trainer/`` and no megatron-core), its modules import each
other without a cycle, and the actor's export reaches the engines only through the shared
bucket format (``megatron_tepo.buckets``)."""
from pathlib import Path

from tests.source_imports import import_cycle, imported_modules, modules_loaded_by

ROLLOUT = Path(__file__).resolve().parents[2] / "megatron_tepo" / "rollout"
FORBIDDEN = ("megatron_tepo.models", "megatron_tepo.megatron", "megatron_tepo.actor", "megatron_tepo.trainer",
             "megatron_tepo.checkpoint", "megatron.")
# every module of the package (the check imports them all)
MODULES = ("engine", "registry", "embedded", "sglang.server", "sglang.launch", "sglang.fleet", "sglang.dispatch",
           "sglang.supervision", "sglang.interruptible", "sglang.memory",
           "sglang.attach", "sglang.weight_sync", "sglang.weight_sync.base", "sglang.weight_sync.distributed",
           "sglang.weight_sync.tensor", "sglang.weight_sync.disk")


def _module(path: Path) -> str:
    """A file's module name inside the package: ``engine``, ``sglang.fleet``, ``sglang.weight_sync``
    (a subpackage's ``__init__.py``); ``""`` for the package's own ``__init__.py``."""
    parts = path.relative_to(ROLLOUT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_rollout_file_imports_the_megatron_side():
    files = sorted(ROLLOUT.rglob("*.py"))
    assert set(MODULES) <= {_module(f) for f in files}  # the check reads the package, subpackages too
    offenders = {str(f.relative_to(ROLLOUT)): sorted(m for m in imported_modules(f) if m.startswith(FORBIDDEN) or m == "megatron")
                 for f in files}
    assert {f: m for f, m in offenders.items() if m} == {}


def test_rollout_modules_import_each_other_without_a_cycle():
    mods = {_module(f): f for f in ROLLOUT.rglob("*.py")}
    prefix = "megatron_tepo.rollout."
    edges = {name: {m[len(prefix):] for m in imported_modules(f) if m.startswith(prefix)} & set(mods)
             for name, f in mods.items()}
    assert "engine" in edges["sglang.fleet"] and "sglang.server" in edges["sglang.fleet"]  # the reader sees imports
    cycle = import_cycle(edges)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_importing_the_engines_and_the_sync_loads_no_megatron():
    modules = modules_loaded_by("megatron_tepo.rollout." + m for m in MODULES)
    assert {"megatron_tepo.rollout." + m for m in MODULES} | {"megatron_tepo.buckets"} <= modules
    assert [m for m in modules if m == "megatron" or m.startswith(FORBIDDEN)] == []


def test_the_launcher_that_runs_in_the_sglang_venv_imports_nothing_of_the_package():
    """sglang/launch.py runs by path under the SGLang venv's python, which need not have
    megatron_tepo: the standard library and sglang only."""
    assert {m for m in imported_modules(ROLLOUT / "sglang" / "launch.py") if m.startswith("megatron")} == set()
