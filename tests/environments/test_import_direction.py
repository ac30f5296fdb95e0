"""``megatron_tepo.environments`` is standard library only: it imports nothing else of the package
(nothing of Megatron, the actor, the trainer, the engines) and no torch, and its modules import each
other without a cycle."""
from pathlib import Path

from tests.source_imports import import_cycle, imported_modules, modules_loaded_by

ENVIRONMENTS = Path(__file__).resolve().parents[2] / "megatron_tepo" / "environments"
MODULES = ("base", "sandbox", "settings", "processes", "remote", "choice", "python_tool", "python_env", "user_code",
           "guess_number", "python_session", "code_tests", "namespaces")


def test_it_imports_nothing_of_the_rest_of_the_package_and_no_torch():
    files = sorted(ENVIRONMENTS.glob("*.py"))
    assert {f.stem for f in files} == {"__init__", *MODULES}
    imports = {f.name: imported_modules(f) for f in files}
    assert "megatron_tepo.environments.sandbox" in imports["processes.py"]  # the reader sees imports
    foreign = ("megatron", "torch", "numpy", "transformers", "requests")
    outside = {name: sorted(m for m in mods if m.split(".")[0] in foreign
                            or (m.startswith("megatron_tepo") and not m.startswith("megatron_tepo.environments")))
               for name, mods in imports.items()}
    assert {k: v for k, v in outside.items() if v} == {}


def test_its_modules_import_each_other_without_a_cycle():
    prefix = "megatron_tepo.environments."
    edges = {f.stem: {m[len(prefix):] for m in imported_modules(f) if m.startswith(prefix)}
             for f in ENVIRONMENTS.glob("*.py") if f.stem != "__init__"}
    cycle = import_cycle(edges)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_importing_it_loads_no_torch():
    modules = modules_loaded_by("megatron_tepo.environments." + m for m in MODULES)
    assert {"megatron_tepo.environments." + m for m in MODULES} <= modules
    assert [m for m in modules if m.split(".")[0] in ("torch", "megatron", "numpy")] == []
