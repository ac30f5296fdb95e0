"""The declared dependency ranges are the real ones (issue #22 rows 6 and 9).

torch: the package said ``torch>=2.4`` while the weight sync called
``_new_process_group_helper(..., backend_options=...)``, a keyword torch 2.6 introduced (it was
``pg_options`` before; SGLang's own copy of the helper switches on the version for this reason).
Here every versioned torch feature the package's source uses without a guard is listed with the
torch release that introduced it, and the declared minimum must be at least each of them (and at
least megatron-core's own torch minimum). A feature used only where the running torch has it
(imported inside ``try``) is listed apart and must stay guarded, and one called only where a probe
found it works (the fused LM head's in-place mixed-precision ``addmm``, torch 2.10 on CUDA; before
it the head is slower and says so once) must stay in its one probed file. A new versioned feature
gets a row here.

SGLang: ``pyproject.toml``'s ``sglang`` extra states the supported range; the README states the
same, and the version the CPU install and the tests use lies in it.
"""
import ast
import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_tepo"

# (regex over the source, torch version that introduced it, what it is)
REQUIRED = [
    (r"backend_options\s*=", "2.6", "distributed_c10d._new_process_group_helper(backend_options=) (was pg_options)"),
    (r"enable_gqa\s*=", "2.5", "scaled_dot_product_attention(enable_gqa=)"),
    (r"torch\.nn\.attention\.flex_attention", "2.5", "FlexAttention"),
    (r"causal_lower_right", "2.3", "torch.nn.attention.bias.causal_lower_right"),
    (r"torch\.library\.register_fake", "2.4", "torch.library.register_fake"),
]
# imported only where the running torch has it: must sit inside a try
GUARDED = ["torch.nn.attention.varlen"]
# called only where a probe found it works: (regex, the torch that has it, what, the one file that uses it
# and probes it inside a try)
PROBED = [
    (r"out_dtype\s*=", "2.10", "torch.addmm(fp32 acc, bf16, bf16, out_dtype=torch.float32, out=acc) on CUDA "
     "(2.8 and 2.9 want acc in the inputs' dtype)", "megatron_tepo/ops/lm_head.py"),
]


def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _declared(name: str, reqs) -> SpecifierSet:
    found = [Requirement(r) for r in reqs if Requirement(r).name == name]
    assert len(found) == 1, f"pyproject.toml declares {name} {len(found)} times"
    return found[0].specifier


def _minimum(spec: SpecifierSet) -> Version:
    lows = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
    assert lows, f"no lower bound in {spec}"
    return max(lows)


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_declared_torch_minimum_covers_every_feature_used():
    declared = _minimum(_declared("torch", _pyproject()["project"]["dependencies"]))
    too_new = []
    for path in _sources():
        text = path.read_text()
        for pattern, version, what in REQUIRED:
            if re.search(pattern, text) and Version(version) > declared:
                too_new.append(f"{path.relative_to(REPO)}: {what} needs torch>={version}")
    assert not too_new, f"pyproject.toml declares torch>={declared}, but: " + "; ".join(too_new)


def test_declared_torch_minimum_covers_megatron_core():
    declared = _minimum(_declared("torch", _pyproject()["project"]["dependencies"]))
    reqs = [Requirement(r) for r in metadata.requires("megatron-core") or []]
    torch_reqs = [r for r in reqs if r.name == "torch" and r.marker is None]
    assert torch_reqs, "megatron-core declares no torch requirement"
    for r in torch_reqs:
        assert declared >= _minimum(r.specifier), (declared, str(r))


def test_torch_features_newer_than_the_minimum_are_guarded():
    unguarded = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            mods = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if not any(m == g or m.startswith(g + ".") for m in mods for g in GUARDED):
                continue
            p = parents.get(node)
            while p is not None and not isinstance(p, ast.Try):
                p = parents.get(p)
            if p is None:
                unguarded.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not unguarded, f"imports of {GUARDED} outside a try: {unguarded}"


def test_probed_torch_features_stay_behind_their_probe():
    for pattern, _version, what, home in PROBED:
        users = [path.relative_to(REPO).as_posix() for path in _sources() if re.search(pattern, path.read_text())]
        assert users == [home], f"{what}: used in {users}, probed in {home} only"
        tree = ast.parse((REPO / home).read_text())
        probed = [node for node in ast.walk(tree) if isinstance(node, ast.Try)
                  and re.search(pattern, ast.unparse(node.body))]
        assert probed, f"{home} uses {what} without trying it inside a try"


def test_supported_sglang_range_is_stated_and_holds_the_tested_version():
    spec = _declared("sglang", _pyproject()["project"]["optional-dependencies"]["sglang"])
    assert any(s.operator == ">=" for s in spec) and any(s.operator == "<" for s in spec), spec
    raw = next(r for r in _pyproject()["project"]["optional-dependencies"]["sglang"] if r.startswith("sglang"))
    stated = raw[len("sglang"):].replace(" ", "")  # e.g. >=0.5.6,<0.6
    assert f"SGLang `{stated}`" in (REPO / "README.md").read_text(), \
        f"the README does not state the supported SGLang range {stated}"
    pinned = re.search(r'SGLANG_VERSION="\$\{MTEPO_SGLANG_VERSION:-([0-9.]+)\}"',
                       (REPO / "tools/install_sglang_cpu.sh").read_text())
    assert pinned and Version(pinned.group(1)) in spec, (pinned and pinned.group(1), spec)
    # the settings that need a later SGLang (issue #50 row 4): inside the range, above its floor (the
    # launch checks them), and served by the SGLang the tests run
    from megatron_tepo.rollout.sglang.versions import DECLARED_MINIMUM, MIN_VERSIONS

    assert Version(DECLARED_MINIMUM) == _minimum(spec)
    for setting, (need, _) in MIN_VERSIONS.items():
        assert Version(need) in spec and Version(need) > _minimum(spec), (setting, need)
        assert Version(need) <= Version(pinned.group(1)), (setting, need)
