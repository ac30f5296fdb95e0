"""Start SGLang's HTTP server, or sglang-router, with its API key taken from the environment, not
the command line.

    <sglang python> <path of this file> [sglang.launch_server arguments]        (key: $TEPO_SGLANG_API_KEY)
    <sglang python> <path of this file> router [sglang_router.launch_router arguments]   (same key)

SGLang reads its API key only from ``--api-key``, and a command line is visible to every user of
the machine (``ps``, ``/proc/<pid>/cmdline``). This script is what
:func:`megatron_tepo.rollout.sglang.options.server_command` runs instead of
``python -m sglang.launch_server``: inside the server process it appends ``--api-key`` with the
value of ``TEPO_SGLANG_API_KEY`` (unset or empty: no key) to the list it parses, then does what
``python -m sglang.launch_server`` does: ``load_plugins()`` where SGLang has it,
``prepare_server_args``, ``run_server`` and, at exit, ``kill_process_tree`` of its children. The key
is also masked in the ``server_args=...`` line SGLang logs at start-up. A ``--api-key`` on the
command line is refused.

SGLang versions (``pyproject.toml``'s ``sglang`` extra: from 0.5.6, below 0.6). Run: 0.5.23 (the CPU
build of ``tools/install_sglang_cpu.sh``; the ``sglang`` tests start it through this file). Read,
not run: the ``sglang/launch_server.py``, ``server_args.py``, ``utils`` and ``entrypoints/engine.py``
of the 0.5.6, 0.5.10 and 0.5.11 wheels. What differs and is handled here:

* ``sglang.srt.plugins`` (``load_plugins``) first appears in 0.5.11; before it the launch loads no
  plugins, and neither does this file (a plugins module that is there but fails to import is an
  error, not skipped);
* 0.5.6 to 0.5.11 log ``server_args=ServerArgs(...)``, the dataclass's ``repr`` with the key in it;
  0.5.23 logs ``_server_args_for_logging(server_args)``, a dict. Each is masked.

The same in every version read: ``run_server`` in ``sglang.launch_server``, ``prepare_server_args``
in ``sglang.srt.server_args``, ``kill_process_tree(pid, include_parent=...)`` in
``sglang.srt.utils``, and ``--api-key``. sglang-router is a package of its own: run with 0.3.2
(the CPU install's), no other version read.

``router`` first: sglang-router instead (what :func:`megatron_tepo.rollout.sglang.router.launch_router`
runs), which also takes its key (the one it checks on every request and passes on to the servers)
only from ``--api-key``. The arguments after ``router``, plus ``--api-key`` from the environment,
are parsed by sglang_router's own parser (``sglang_router.launch_router.parse_router_args``) and
the router is started with them (``launch_router``), as ``python -m sglang_router.launch_router``
does, so the key lives in the router's memory only.

It runs under the SGLang venv's python, by path: it imports only the standard library and sglang
(or sglang_router) (nothing of megatron_tepo, which that venv need not have), and drops its own
folder from ``sys.path`` first so that the modules next to it cannot shadow others. That is why
it is a file of its own rather than part of ``server.py`` or ``serve.py``, which run in the trainer's venv (and
which SGLang's spawned children would re-import as their main module). The CPU patches of
``tools/install_sglang_cpu.sh`` load at interpreter start-up (a ``.pth`` file), as for
``python -m sglang.launch_server``. Left out: SGLang's other entry points (``sglang serve``, gRPC).
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ in ("__main__", "__mp_main__"):  # run by path (also re-run by spawned children)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

KEY_ENV = "TEPO_SGLANG_API_KEY"


def sglang_argv(argv, environ):
    """``argv`` plus ``--api-key <environ[KEY_ENV]>`` when that is set; refuses a key in ``argv``."""
    argv = list(argv)
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        raise SystemExit(f"{os.path.basename(__file__)}: --api-key on the command line is refused "
                         f"(ps shows it): pass the key in the environment variable {KEY_ENV}")
    key = environ.get(KEY_ENV)
    return argv + (["--api-key", key] if key else [])


def _load_plugins() -> bool:
    """SGLang's ``load_plugins()``, as its launch_server runs it, where SGLang has it (0.5.11 and
    later); False where ``sglang.srt.plugins`` does not exist (0.5.6 to 0.5.10: no plugins)."""
    try:
        from sglang.srt.plugins import load_plugins
    except ModuleNotFoundError as exc:
        if exc.name != "sglang.srt.plugins":  # there, but something it imports is missing
            raise
        return False
    load_plugins()
    return True


def _mask_key_in_startup_log(server_args) -> None:
    """SGLang logs the parsed arguments once at start-up: mask the key there."""
    if not getattr(server_args, "api_key", None):
        return
    try:
        from sglang.srt.entrypoints import engine
    except ImportError:  # pragma: no cover - another SGLang layout: nothing to mask
        return
    original = getattr(engine, "_server_args_for_logging", None)
    if original is None:  # 0.5.6 to 0.5.11: logger.info(f"{server_args=}"), the dataclass's repr
        _mask_key_in_repr(type(server_args))
        return

    def masked(server_args):
        out = original(server_args)
        if isinstance(out, dict) and out.get("api_key"):
            out = dict(out, api_key="***")
        return out

    engine._server_args_for_logging = masked


def _mask_key_in_repr(cls) -> None:
    plain = cls.__repr__

    def masked_repr(self):
        text, key = plain(self), getattr(self, "api_key", None)
        return text.replace(repr(key), repr("***")) if key else text

    cls.__repr__ = masked_repr


def router_main(argv) -> None:
    """sglang-router with ``argv`` (its own flags) and the key of the environment, parsed by
    sglang_router's parser and started in this process (no ``--api-key`` on any command line)."""
    args = sglang_argv(argv, os.environ)
    from sglang_router.launch_router import launch_router, parse_router_args

    launch_router(parse_router_args(args))


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["router"]:
        return router_main(argv[1:])
    args = sglang_argv(argv, os.environ)
    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    _load_plugins()
    server_args = prepare_server_args(args)
    _mask_key_in_startup_log(server_args)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
