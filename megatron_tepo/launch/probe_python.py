"""What a python offers a GPU job, as one JSON line on stdout (read by :mod:`megatron_tepo.launch.pythons`):

    <python> megatron_tepo/launch/probe_python.py
    {"executable": ..., "prefix": ..., "torch": {"version": "2.6.0+cu126", "cuda": "12.6", "hip": null} | null,
     "transformer_engine": true|false, "sglang": true|false, "sglang_version": "0.5.23" | null,
     "torch_memory_saver": true|false, "fla": true|false, "triton_version": "3.6.0" | null, "tilelang": true|false}

Run by path under the python it describes, which need not have megatron_tepo (an SGLang venv): the
standard library only, and it imports nothing it reports on. torch's build comes from its
``torch/version.py`` (``cuda`` / ``hip``: the toolkit it was built with, None in a CPU build), read
as literals, not imported: no CUDA initialisation, well under a second, and it answers on a login
node without a GPU. Transformer Engine, SGLang and its memory saver (``torch_memory_saver``, what a
colocated layout's servers start with): whether the package is installed
(``importlib.util.find_spec``), not whether it imports; SGLang's version from its installed
metadata (``importlib.metadata``), which the launch checks against the settings that need a later
release (``megatron_tepo/rollout/sglang/versions.py``). What a Qwen3.5 hybrid's Gated DeltaNet
needs (``megatron_tepo/gdn_kernels.py``): flash-linear-attention's kernels (the ``fla`` module of
fla-core: installed or not), Triton's version (the ``triton`` distribution, or ``pytorch-triton`` or
``pytorch-triton-rocm`` where a nightly or ROCm torch brings it) and tilelang (installed or not).
Left out: whether a GPU is there (the job's nodes have them; where this runs may not), the driver,
apex.
"""
import ast
import importlib.metadata
import importlib.util
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # run by path: the modules next to this file must not shadow others
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def torch_build():
    """``{"version", "cuda", "hip"}`` of the torch this python would import, or None without one."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "version.py")
    out = {"version": None, "cuda": None, "hip": None}
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return out
    names = {"__version__": "version", "cuda": "cuda", "hip": "hip"}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) and node.value is not None else None
        if isinstance(target, ast.Name) and target.id in names:
            try:
                out[names[target.id]] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def version(name: str):
    try:
        return importlib.metadata.version(name)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def probe() -> dict:
    return {"executable": sys.executable, "prefix": sys.prefix, "torch": torch_build(),
            "transformer_engine": installed("transformer_engine"), "sglang": installed("sglang"),
            "sglang_version": version("sglang"), "torch_memory_saver": installed("torch_memory_saver"),
            "fla": installed("fla"),
            "triton_version": version("triton") or version("pytorch-triton") or version("pytorch-triton-rocm"),
            "tilelang": installed("tilelang")}


if __name__ == "__main__":
    print(json.dumps(probe()))
