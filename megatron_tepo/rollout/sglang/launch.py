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

The server's log shows every request that changes its memory or weights, when it arrives and when
it is answered, ``[mtepo] > POST /resume_memory_occupation tags=weights`` and ``[mtepo] < POST
/resume_memory_occupation 200`` (:data:`LOGGED_ROUTES`, with the ``tags`` of a memory request): a
colocated server's log then reads as the order of its memory phases. With
``TEPO_SGLANG_LOG_REQUESTS=1`` every request is logged so, generations included (tests). An ASGI
middleware on SGLang's FastAPI app (``sglang.srt.entrypoints.http_server.app``, the app its HTTP
server runs in this process; with several tokenizer workers, ``--tokenizer-worker-num``, the
workers' apps are not wrapped).

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
``python -m sglang.launch_server``. With ``TEPO_SGLANG_EMPTY_CACHE_ON_RELEASE=1`` (a colocated server's environment), the processes
SGLang spawns, which run this file as ``__mp_main__``, empty torch's CUDA cache after each memory
release (:func:`empty_cache_after_release`). Left out: SGLang's other entry points (``sglang
serve``, gRPC).
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ in ("__main__", "__mp_main__"):  # run by path (also re-run by spawned children)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

KEY_ENV = "TEPO_SGLANG_API_KEY"
LOG_REQUESTS_ENV = "TEPO_SGLANG_LOG_REQUESTS"  # 1: the log shows every request, not only LOGGED_ROUTES
#: what the log always shows: the requests that change the server's memory or its weights
LOGGED_ROUTES = frozenset({
    "/release_memory_occupation", "/resume_memory_occupation", "/pause_generation", "/continue_generation",
    "/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group", "/flush_cache"})


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


class RequestLog:
    """ASGI middleware: ``[mtepo] > METHOD PATH [tags=...]`` when a request of ``routes`` (None:
    every one) arrives and ``[mtepo] < METHOD PATH STATUS`` when it is answered, flushed at once
    into the server's log. A memory request's body is read first (for its tags) and handed on."""

    def __init__(self, app, routes=LOGGED_ROUTES):
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or (self.routes is not None and scope.get("path") not in self.routes):
            return await self.app(scope, receive, send)
        what = f"{scope.get('method')} {scope.get('path')}"
        detail, inner = "", receive
        if scope.get("path", "").endswith("_memory_occupation"):
            messages, more = [], True
            while more:
                messages.append(await receive())
                more = messages[-1].get("more_body", False)
            detail, inner = f" tags={_tags(messages)}", _replay(messages, receive)
        print(f"[mtepo] > {what}{detail}", flush=True)

        async def answered(message):
            if message.get("type") == "http.response.start":
                print(f"[mtepo] < {what} {message.get('status')}", flush=True)
            await send(message)

        return await self.app(scope, inner, answered)


def _tags(messages) -> str:
    """The ``tags`` of a memory request's JSON body (``all`` when it names none)."""
    import json

    try:
        tags = json.loads(b"".join(m.get("body", b"") for m in messages) or b"{}").get("tags")
    except (ValueError, AttributeError):
        return "?"
    return ",".join(map(str, tags)) if tags else "all"


def _replay(messages, receive):
    """An ASGI ``receive`` that gives ``messages`` (read already) first, then ``receive``'s."""
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


def _log_requests(environ) -> bool:
    """SGLang's HTTP app wrapped in :class:`RequestLog` (every request with ``TEPO_SGLANG_LOG_REQUESTS=1``);
    False where SGLang has no such app (another layout: its requests are not logged so)."""
    try:
        from sglang.srt.entrypoints.http_server import app
    except ImportError:  # another SGLang layout (or a stand-in of one)
        return False
    app.add_middleware(RequestLog, routes=None if environ.get(LOG_REQUESTS_ENV) == "1" else LOGGED_ROUTES)
    return True


#: where SGLang's scheduler frees memory on ``/release_memory_occupation``: (module, class), by
#: version (read in the wheels: 0.5.23's ``scheduler_components/weight_updater.py``, 0.5.6's
#: ``scheduler_update_weights_mixin.py``). Neither empties torch's CUDA cache after a release.
RELEASE_SITES = (("sglang.srt.managers.scheduler_components.weight_updater", "SchedulerWeightUpdaterManager"),
                 ("sglang.srt.managers.scheduler_update_weights_mixin", "SchedulerUpdateWeightsMixin"))
#: 1: SGLang's scheduler processes empty torch's CUDA cache after each release (colocated servers:
#: ``options.MEMORY_SAVER_ENV``)
EMPTY_CACHE_ENV = "TEPO_SGLANG_EMPTY_CACHE_ON_RELEASE"


def empty_cache_after_release(sites=RELEASE_SITES) -> str:
    """Wrap the scheduler's ``release_memory_occupation`` so that torch's CUDA cache is emptied after
    it: the memory saver unmaps the weights, the KV cache and (with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1)
    the graphs, but the activations the forward passes left in torch's caching allocator stay
    cached, out of the actor's reach, unless emptied. Runs in SGLang's spawned scheduler processes
    (they run this file as ``__mp_main__`` before their work). Returns the ``module.class`` wrapped,
    or "" where no site is there (another layout: said in the server's log)."""
    import importlib

    for module, name in sites:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        release = cls.release_memory_occupation
        if not getattr(release, "_mtepo_empties_cache", False):
            def released(self, *args, _release=release, **kwargs):
                out = _release(self, *args, **kwargs)
                import torch

                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.empty_cache()  # back to the driver: the actor can allocate it
                return out

            released._mtepo_empties_cache = True
            cls.release_memory_occupation = released
        return f"{module}.{name}"
    print(f"[mtepo] {EMPTY_CACHE_ENV}=1: no release_memory_occupation found in {[m for m, _ in sites]}; torch's "
          f"CUDA cache is not emptied after a release", flush=True)
    return ""


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
    _log_requests(os.environ)
    server_args = prepare_server_args(args)
    _mask_key_in_startup_log(server_args)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and os.environ.get(EMPTY_CACHE_ENV) == "1":  # a scheduler process SGLang spawned
    empty_cache_after_release()
