"""``megatron_tepo.net.free_port``: the one port picker of the package, its tools, benchmarks and
tests (``actor/parallel.py``'s ``single_process_env`` aside, which moves elsewhere)."""
import ast
import json
import socket
import subprocess
import sys
from pathlib import Path

from megatron_tepo.net import ephemeral_range, free_port

REPO = Path(__file__).resolve().parents[1]
EXEMPT = {"megatron_tepo/net.py"}


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    """Server ports come from below the kernel's ephemeral range (outgoing connections cannot take
    them while a slow server starts), and are free when handed out."""
    lo, hi = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert all(10000 <= p < lo for p in ports), (ports, lo, hi)
    for p in ports[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_importing_it_loads_no_torch():
    code = "import json, sys; import megatron_tepo.net; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "megatron_tepo.net" in modules and not [m for m in modules if m.split(".")[0] in ("torch", "megatron")]


def test_no_other_port_picker():
    """No other file defines a port picker or asks the OS for one (a bind to port 0)."""
    offenders = []
    for folder in ("megatron_tepo", "tools", "tests", "benchmarks", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel in EXEMPT:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "free_port":
                    offenders.append(f"{rel}:{node.lineno}: def {node.name}")
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind"
                        and node.args and isinstance(node.args[0], ast.Tuple) and len(node.args[0].elts) == 2
                        and isinstance(node.args[0].elts[1], ast.Constant) and node.args[0].elts[1].value == 0):
                    offenders.append(f"{rel}:{node.lineno}: bind to port 0")
    assert offenders == []
