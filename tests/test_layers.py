"""The package's layers point one way. Read from the source (every import, lazy ones included):
the top-level modules and packages of ``megatron_tepo`` import each other without a cycle, and so do
all its modules, one by one; the seams the restructuring drew hold: the models know names, not ranks (nothing of the megatron
backend, none of megatron-core's field names); the megatron backend knows nothing of the actor, the checkpoint tools or the trainer;
``checkpoint/`` and ``cli.py`` import nothing from ``actor/`` or ``trainer/``; ``launch/`` nothing of
megatron-core's side, the actor or the trainer (the SGLang fleet's process code in ``rollout/`` it may);
``environments/`` (the tool sandbox) nothing else of the package; megatron-core (and NVRx's checkpoint
writer) is imported only in ``megatron/``. (``rollout/``, ``algorithms/`` and
``environments/`` have their own tests: tests/rollout/test_import_direction.py,
tests/algorithms/test_import_purity.py, tests/environments/test_import_direction.py.)"""
from pathlib import Path

from tests.source_imports import PKG, import_cycle, imported_modules


def _unit(path: Path) -> str:
    return path.relative_to(PKG).with_suffix("").parts[0]


def _units():
    """Every top-level module and package of ``megatron_tepo``."""
    return {p.stem for p in PKG.glob("*.py") if p.name != "__init__.py"} | \
        {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}


def _imports_megatron_core(path: Path) -> bool:
    return any(m == "megatron" or m.startswith("megatron.") for m in imported_modules(path))


def _graph():
    edges = {}
    for f in sorted(PKG.rglob("*.py")):
        for m in imported_modules(f):
            if m.startswith("megatron_tepo."):
                target = m.split(".")[1]
                if target != _unit(f):
                    edges.setdefault(_unit(f), {}).setdefault(target, set()).add(str(f.relative_to(PKG)))
    return edges


def test_the_graph_is_read():
    edges = _graph()
    assert "megatron" in edges["actor"] and "layout" in edges["config"]  # the reader sees imports


def test_no_cycle_between_top_level_units():
    edges = _graph()
    cycle = import_cycle(edges)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)} ({edges[cycle[-2]][cycle[-1]]})"


def _module_graph():
    """Every module of the package -> the package's modules it imports (a package is its
    ``__init__``). A module's import of its own enclosing package is left out: Python runs the
    package before the module, so that is no circle."""
    def name(path: Path) -> str:
        parts = ("megatron_tepo",) + path.relative_to(PKG).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name(f): f for f in PKG.rglob("*.py")}
    return {n: {m for m in imported_modules(f) if m in files and m != n and not n.startswith(m + ".")}
            for n, f in files.items()}


def test_no_cycle_between_modules():
    """No two modules of the package import each other, directly or through others, inside a unit
    too (megatron/gpt.py and megatron/hybrid.py once did)."""
    edges = _module_graph()
    assert "megatron_tepo.megatron.spec" in edges["megatron_tepo.megatron.gpt"]  # the reader sees imports
    cycle = import_cycle(edges)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_seams_hold():
    edges = _graph()
    forbidden = {
        "models": {"megatron", "actor", "checkpoint", "trainer", "rollout", "launch"},
        "megatron": {"actor", "checkpoint", "trainer", "rollout", "launch"},
        "checkpoint": {"actor", "trainer"},
        "cli": {"actor", "trainer"},
        "layout": set(edges) - {"layout"},
        # the layer-kind table is read by models/, megatron/ and launch/: it reads only the shape
        "layer_kinds": _units() - {"layer_kinds", "layout"},
        # launch/ may import rollout/: the nemo-run launcher's steps reuse the SGLang fleet's process
        # code (its health wait and its stop of a server's process group) instead of a copy
        "launch": {"actor", "megatron", "trainer"},
        # the tool sandbox is standard library only: the trainer's episodes call it, never the reverse
        "environments": _units() - {"environments"},
    }
    broken = {f"{u} -> {v}": sorted(edges[u][v]) for u, bad in forbidden.items() for v in edges.get(u, {})
              if v in bad}
    assert broken == {}


#: megatron-core's own field names for a family's architecture (``TransformerConfig``, ``GPTModel``),
#: none of which is an HF config's name: megatron/family_kwargs.py spells them, models/ never does
MEGATRON_FIELDS = {"kv_channels", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff",
                   "moe_router_load_balancing_type", "moe_shared_expert_intermediate_size", "add_qkv_bias",
                   "layernorm_zero_centered_gamma", "gated_linear_unit", "attention_softmax_in_fp32",
                   "share_embeddings_and_output_weights", "position_embedding_type", "max_sequence_length"}


def test_the_models_spell_no_megatron_core_field():
    """models/ knows HF configs and names; megatron's config fields are the megatron backend's. Read
    from the code (keyword arguments, strings), not from docstrings or comments."""
    import ast

    found = {}
    for f in sorted((PKG / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            name = (node.arg if isinstance(node, ast.keyword) else
                    node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
            if name in MEGATRON_FIELDS:
                found.setdefault(str(f.relative_to(PKG)), set()).add(name)
    assert found == {}
    spelled = (PKG / "megatron" / "family_kwargs.py").read_text()
    assert all(name in spelled for name in MEGATRON_FIELDS)  # the list names megatron's fields


def test_the_checkpoint_package_keeps_its_public_names():
    """convert.py was split (hf_to_megatron, megatron_to_hf, dcp_reader, sidecars, common): the
    package still answers every name callers imported from it before."""
    import megatron_tepo.checkpoint as checkpoint

    before = {"convert_hf_to_megatron", "convert_megatron_to_hf", "build_gpt_model", "load_checkpoint_into",
              "read_checkpoint_info", "check_hf_input", "ensure_process_group", "export_actor_to_hf",
              "write_conversion_sidecars"}
    assert before <= set(checkpoint.__all__)
    assert all(callable(getattr(checkpoint, name)) for name in checkpoint.__all__)


def test_the_trainer_imports_nothing_of_megatron():
    """#33: the trainer composes the actor, the engines and the losses; the megatron stack is the
    actor's (its one home is ``megatron/model.py``), so no trainer module imports the megatron
    backend or megatron-core, even lazily."""
    edges = _graph()
    assert "megatron" not in edges.get("trainer", {}), edges["trainer"].get("megatron")
    core = sorted(str(f.relative_to(PKG)) for f in (PKG / "trainer").rglob("*.py") if _imports_megatron_core(f))
    assert core == []


def test_only_the_megatron_backend_imports_megatron_core():
    """#51: megatron-core has one home, ``megatron/``: no module outside it imports megatron-core
    (``megatron.*``) or the NVRx checkpoint writer megatron-core hands saves to
    (``nvidia_resiliency_ext``), even lazily. The dist-checkpoint save and load, the RNG tracker's
    states and the optimizer's steps (``megatron/dist_checkpoint.py``), the asynchronous saves'
    writer and its choice (``megatron/async_save.py``), the streaming torch_dist strategy
    (``megatron/dist_writer.py``) and the parallel state's groups and sizes
    (``megatron/parallel.py``) live there; the actor, the checkpoint tools and ``children.py`` call
    them with plain arguments. (Names of megatron-core's modules in strings, such as the warning
    filters of ``megatron_tepo/__init__.py``, are no imports.)"""
    def outside(f: Path) -> bool:
        return _unit(f) != "megatron"

    core = sorted(str(f.relative_to(PKG)) for f in PKG.rglob("*.py") if outside(f) and _imports_megatron_core(f))
    assert core == []
    nvrx = sorted(str(f.relative_to(PKG)) for f in PKG.rglob("*.py") if outside(f)
                  and any(m.split(".")[0] == "nvidia_resiliency_ext" for m in imported_modules(f)))
    assert nvrx == []
    # the reader sees the backend's own imports of it, lazy ones included
    assert _imports_megatron_core(PKG / "megatron" / "dist_checkpoint.py")


def test_the_trainer_imports_nothing_of_the_actor():
    """#51: the trainer drives its policy through the declared interface
    (``trainer/policy.py:Policy``), never the Megatron actor's modules, even lazily: the backend is
    built by name (``POLICY_BACKENDS``), so another backend, LoRA or a reference policy plugs in
    there."""
    edges = _graph()
    assert "actor" not in edges.get("trainer", {}), edges["trainer"].get("actor")
