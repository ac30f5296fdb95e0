"""rollout/sglang/launch.py against the SGLang layouts of the declared range (issue #32 row 1).

``pyproject.toml`` declares ``sglang>=0.5.6``, but the launcher imported ``sglang.srt.plugins``,
which first appears in 0.5.11: every 0.5.6 to 0.5.10 server died with an ImportError. Here the
launcher runs, as a server does (by path, in its own process), against a stand-in ``sglang``
package on ``sys.path`` shaped like each layout: 0.5.6-0.5.10 (no plugins; the start-up line is
``f"{server_args=}"``, the dataclass's repr) and 0.5.11+ (``load_plugins``). The stand-in records
what the launcher calls; the real 0.5.23 server runs in the ``sglang`` tests."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parents[2] / "megatron_tepo" / "rollout" / "sglang" / "launch.py"

RECORD = """
import json, os
def record(*what):
    with open(os.environ["STANDIN_CALLS"], "a") as f:
        f.write(json.dumps(list(what)) + "\\n")
"""
STANDIN = {
    "sglang/__init__.py": RECORD,
    "sglang/launch_server.py": """
        from sglang import record
        from sglang.srt.entrypoints import engine
        def run_server(server_args):
            engine.launch(server_args)
            record("run_server", server_args.model_path)
    """,
    "sglang/srt/__init__.py": "",
    "sglang/srt/server_args.py": """
        import argparse, dataclasses
        from typing import Optional
        from sglang import record
        @dataclasses.dataclass
        class ServerArgs:
            model_path: str
            port: int = 30000
            api_key: Optional[str] = None
        def prepare_server_args(argv):
            record("prepare_server_args", argv)
            ap = argparse.ArgumentParser()
            ap.add_argument("--model-path")
            ap.add_argument("--port", type=int, default=30000)
            ap.add_argument("--api-key", default=None)
            a = ap.parse_args(argv)
            return ServerArgs(a.model_path, a.port, a.api_key)
    """,
    "sglang/srt/utils/__init__.py": """
        import os
        from sglang import record
        def kill_process_tree(parent_pid, include_parent=True, skip_pid=None):
            record("kill_process_tree", parent_pid == os.getpid(), include_parent)
    """,
    "sglang/srt/entrypoints/__init__.py": "",
    # 0.5.6 to 0.5.11: engine._launch_subprocesses logs the dataclass's repr
    "sglang/srt/entrypoints/engine.py": """
        def launch(server_args):
            print(f"{server_args=}", flush=True)
    """,
}
PLUGINS = {  # 0.5.11 and later
    "sglang/srt/plugins/__init__.py": """
        from sglang import record
        def load_plugins():
            record("load_plugins")
    """,
}
ENGINE_0523 = {  # 0.5.23: the start-up line is a dict made by _server_args_for_logging
    "sglang/srt/entrypoints/engine.py": """
        import dataclasses
        def _server_args_for_logging(server_args):
            return dataclasses.asdict(server_args)
        def launch(server_args):
            print(f"server_args={_server_args_for_logging(server_args)}", flush=True)
    """,
}


def _standin(root: Path, *layers) -> Path:
    files = dict(STANDIN)
    for layer in layers:
        files.update(layer)
    for rel, text in files.items():
        path = root / "site" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "site"


def _run(tmp_path, site, *args, key="k-7f3a9e"):
    calls = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TEPO_SGLANG_API_KEY")}
    env.update(PYTHONPATH=str(site), STANDIN_CALLS=str(calls), TEPO_SGLANG_API_KEY=key)
    res = subprocess.run([sys.executable, str(LAUNCHER), *args], env=env, capture_output=True, text=True,
                         timeout=120)
    seen = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return res, seen


def test_an_sglang_without_plugins_starts(tmp_path):
    """0.5.6 to 0.5.10: no ``sglang.srt.plugins``; the launch goes on without it."""
    res, calls = _run(tmp_path, _standin(tmp_path), "--model-path", "/m", "--port", "31000")
    assert res.returncode == 0, res.stderr
    assert calls == [["prepare_server_args", ["--model-path", "/m", "--port", "31000", "--api-key", "k-7f3a9e"]],
                     ["run_server", "/m"], ["kill_process_tree", True, False]]
    # the start-up line of these versions, the dataclass's repr, without the key
    assert "server_args=ServerArgs(model_path='/m', port=31000, api_key='***')" in res.stdout
    assert "k-7f3a9e" not in res.stdout + res.stderr


def test_an_sglang_with_plugins_loads_them_first(tmp_path):
    """0.5.11 and later: ``load_plugins()`` before the arguments are parsed, as SGLang's own launch."""
    res, calls = _run(tmp_path, _standin(tmp_path, PLUGINS, ENGINE_0523), "--model-path", "/m")
    assert res.returncode == 0, res.stderr
    assert [c[0] for c in calls] == ["load_plugins", "prepare_server_args", "run_server", "kill_process_tree"]
    assert "'api_key': '***'" in res.stdout and "k-7f3a9e" not in res.stdout + res.stderr


def test_a_plugins_module_that_fails_to_import_is_an_error(tmp_path):
    """Only a missing ``sglang.srt.plugins`` means an older SGLang; a plugins module that is there
    but cannot import what it needs stops the server."""
    broken = {"sglang/srt/plugins/__init__.py": "import sglang_plugin_dependency_that_is_missing\n"}
    res, calls = _run(tmp_path, _standin(tmp_path, broken), "--model-path", "/m")
    assert res.returncode != 0 and "sglang_plugin_dependency_that_is_missing" in res.stderr
    assert calls == []


@pytest.mark.parametrize("layers", [(), (PLUGINS, ENGINE_0523)], ids=["0.5.6-layout", "0.5.23-layout"])
def test_no_key_leaves_the_startup_line_alone(tmp_path, layers):
    res, calls = _run(tmp_path, _standin(tmp_path, *layers), "--model-path", "/m", key="")
    assert res.returncode == 0, res.stderr
    assert calls[[c[0] for c in calls].index("prepare_server_args")] == ["prepare_server_args", ["--model-path", "/m"]]
    assert "api_key=None" in res.stdout or "'api_key': None" in res.stdout
