"""One SGLang server's options, once: :class:`ServerConfig`, one dataclass with one default per value,
written on a command line (:meth:`ServerConfig.to_argv`) and read back into the same type
(:meth:`ServerConfig.add_arguments`, :meth:`ServerConfig.from_argv`), and SGLang's own flags made
of it (:func:`server_command`).

Every hop of a server's options goes through this type: the launch file's ``launch.rollout``
section (``engine: sglang``; the old ``launch.sglang`` section) is read into it
(``megatron_tepo/launch/schema.py``, its keys the option names below), the launchers write it as
the serve command's options (``megatron_tepo/launch/spec.py``'s ``serve_args``), the serve command
parses them back (``serve.py``) and :func:`server_command` turns it into SGLang's command line, as
it does for the servers the fleet starts itself (``server.py``'s ``launch_server``).

Defaults: each field's own, except where the device decides, which is one rule
(:data:`DEVICE_DEFAULTS`, applied to the fields left at ``None`` when a config is made), and the
serve command's own (:data:`SERVE_COMMAND_DEFAULTS`: a GPU server, on loopback unless told).

The SGLang python: ``ServerConfig.python``, default ``$MTEPO_SGLANG_PYTHON`` or
``<repo>/.venv-sglang/bin/python`` (:func:`default_sglang_python`); the serve command's choice
(:func:`find_sglang_python`); the mark of ``tools/install_sglang_cpu.sh`` on its CPU build
(:data:`CPU_BUILD_MARKERS`), which :func:`server_command` refuses for a ``cuda`` server and the
fit check refuses for a ``launch.device: cuda`` job (``megatron_tepo/launch/pythons.py``). The CPU
flags are 0.5.23's, the version that script installs (``--cuda-graph-backend-*`` is not in 0.5.6
to 0.5.11, which name it ``--disable-cuda-graph``); the ``cuda`` flags are in every version of the
declared range (read in the 0.5.6, 0.5.10 and 0.5.11 ``server_args.py``).

Left out: starting, watching and stopping the process (``server.py``), the serve command's own
arguments (``serve.py``), what runs inside the server process (``launch.py``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[3]
# run by path with the SGLang venv's python (which need not have megatron_tepo installed)
SGLANG_LAUNCHER = str(Path(__file__).resolve().with_name("launch.py"))
API_KEY_ENV = "TEPO_SGLANG_API_KEY"  # the servers' key, in their environment (launch.py reads it)
#: colocated launches: the memory tags (comma-separated) the launcher released on every server before
#: the trainer started, so that the trainer's fleet knows the servers' state (slurm/lib.sh and the
#: nemo-run launcher set it; megatron_tepo/launch/sequence.py's ``release`` step)
RELEASED_ENV = "TEPO_SGLANG_RELEASED"
#: colocated launches: a file (in the attempt's log folder) that the trainer's fleet creates while a
#: weight sync waits for dead servers to come back, and removes after; slurm/lib.sh restarts a
#: server that exited only while it exists (before, the GPUs are the actor's)
RESTART_GATE_ENV = "TEPO_SGLANG_RESTART_GATE"

#: The one rule by which the device changes a default: what a field left at ``None`` becomes.
#: cpu: SGLang budgets ``mem_fraction_static`` of the machine's memory and counts what other
#: processes allocate while it loads as weights (0.05 failed on a busy machine), so the KV pool is
#: capped by ``max_total_tokens`` instead; SGLang's own number of running requests. cuda: 0.85 of
#: the GPU, SGLang's own KV sizing, 64 running requests (what the fit check prices). 0 in
#: ``max_total_tokens`` / ``max_running_requests``: SGLang's own (no flag).
DEVICE_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "cpu": {"mem_fraction_static": 0.5, "max_total_tokens": 4096, "max_running_requests": 0},
    "cuda": {"mem_fraction_static": 0.85, "max_total_tokens": 0, "max_running_requests": 64},
}
#: The serve command's own defaults (a server started by hand): a GPU server, listening on the
#: loopback interface only (the config's host, as SGLang's own default); the launchers pass
#: ``--host 0.0.0.0`` and an API key in the environment (serve.py refuses another address without a
#: key unless told ``--allow-open``).
SERVE_COMMAND_DEFAULTS: Dict[str, Any] = {"device": "cuda"}


def default_sglang_python() -> str:
    return os.environ.get("MTEPO_SGLANG_PYTHON", str(REPO / ".venv-sglang" / "bin" / "python"))


def _option(default: Any = None, option: Optional[str] = None, *, launch: bool = False, negate: bool = False,
            flag: bool = False, help: str = "") -> Any:
    """A field on the command line as ``--OPTION`` (``negate``: a flag that sets the bool False;
    ``flag``: a flag that sets it True); ``launch``: also a key of the launch file's server section
    (``OPTION`` with ``_``)."""
    return field(default=default, metadata={"option": option, "launch": launch, "negate": negate, "flag": flag,
                                            "help": help})


@dataclass
class ServerConfig:
    """How one SGLang server is started. The fields with an option are its command line (in this
    order); ``python``, ``env``, ``startup_timeout`` and ``log_dir`` are this machine's business
    (where the fleet starts it). ``None`` in ``mem_fraction_static``, ``max_total_tokens`` and
    ``max_running_requests``: the device's default (:data:`DEVICE_DEFAULTS`), filled in when the
    config is made (``dataclasses.replace`` with another device keeps the values already filled)."""
    model_path: Optional[str] = _option(None, "model-path", help="the HF checkpoint folder (needed to start)")
    host: str = _option("127.0.0.1", "host", help="the address the server listens on")
    python: str = field(default_factory=default_sglang_python)
    dtype: str = _option("bfloat16", "dtype")
    device: str = _option("cpu", "device", help="cpu or cuda")
    tp: int = _option(1, "tp", launch=True, help="GPUs per server (SGLang --tp-size)")
    mem_fraction_static: Optional[float] = _option(None, "mem-fraction-static", launch=True,
                                                   help="weights + KV pool share (default: the device's)")
    max_running_requests: Optional[int] = _option(None, "max-running-requests", launch=True,
                                                  help="concurrent sequences (default: the device's; 0: SGLang's)")
    threads_per_server: int = _option(1, "threads", launch=True, help="OMP threads of a CPU server")
    max_total_tokens: Optional[int] = _option(None, "max-total-tokens", launch=True,
                                              help="KV pool in tokens (default: the device's; 0: SGLang's)")
    context_length: Optional[int] = _option(None, "context-length", help="default: the model's")
    skip_warmup: bool = _option(True, "warmup", negate=True, help="let SGLang run its warm-up request")
    # SGLang's memory saver: release_memory_occupation frees the GPU memory (colocated launches on
    # cuda; torch_memory_saver is a CUDA library, so a CPU server releases without it, freeing nothing)
    enable_memory_saver: bool = _option(False, "enable-memory-saver", flag=True,
                                        help="SGLang's memory saver (colocated mode on GPUs)")
    # MoE routing replay (actor.routing_replay: r3): each answer carries the experts every token was
    # routed to (SGLang's --enable-return-routed-experts; the launchers set it when replay asks for it)
    enable_return_routed_experts: bool = _option(False, "enable-return-routed-experts", flag=True,
                                                 help="return each token's routed experts (MoE routing replay)")
    # LoRA adapters loaded at run time (actor.lora.sync: adapters; the launchers set both from actor.lora):
    # SGLang's --enable-lora with --max-lora-rank and --lora-target-modules (HF module names, comma-separated)
    max_lora_rank: Optional[int] = _option(None, "max-lora-rank", launch=True,
                                           help="serve LoRA adapters up to this rank (SGLang --enable-lora)")
    lora_target_modules: Optional[str] = _option(None, "lora-target-modules", launch=True,
                                                 help="the LoRA adapters' modules, comma-separated (default: all)")
    extra_args: Sequence[str] = ()  # SGLang flags of its own, after ``--`` on the command line
    env: Dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 180.0
    log_dir: Optional[str] = None

    def __post_init__(self):
        if self.device not in DEVICE_DEFAULTS:
            raise ValueError(f"ServerConfig.device: expected cpu or cuda, found {self.device!r}")
        for name, value in DEVICE_DEFAULTS[self.device].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.extra_args = tuple(self.extra_args)

    def invalid(self) -> List[Tuple[str, str]]:
        """What is out of range, as (launch key, why) pairs; [] when nothing is."""
        checks = (("tp", self.tp >= 1, "must be >= 1"),
                  ("mem_fraction_static", 0 < self.mem_fraction_static <= 1, "must be in (0, 1]"),
                  ("max_running_requests", self.max_running_requests >= 0, "must be >= 0 (0: SGLang's own)"),
                  ("max_total_tokens", self.max_total_tokens >= 0, "must be >= 0 (0: SGLang's own)"),
                  ("threads", self.threads_per_server >= 1, "must be >= 1"))
        return [(key, why) for key, ok, why in checks if not ok]

    @staticmethod
    def options() -> List[Any]:
        """The fields on the command line, in their order (dataclass fields with an option)."""
        return [f for f in fields(ServerConfig) if f.metadata.get("option")]

    @staticmethod
    def launch_keys() -> Dict[str, Any]:
        """The launch file's keys for a server (the option, ``_`` for ``-``) -> their field."""
        return {f.metadata["option"].replace("-", "_"): f for f in ServerConfig.options() if f.metadata["launch"]}

    def to_argv(self) -> List[str]:
        """The command line: ``--OPTION VALUE`` for every option that has a value (``None``: not
        set), the flag of a negated bool when it is False, ``-- EXTRA`` last. :meth:`from_argv` of it
        is an equal config."""
        out: List[str] = []
        for f in self.options():
            value, option = getattr(self, f.name), "--" + f.metadata["option"]
            if f.metadata["negate"]:
                out += [] if value else [option]
            elif f.metadata["flag"]:
                out += [option] if value else []
            elif value is not None:
                out += [option, str(value)]
        return out + (["--", *self.extra_args] if self.extra_args else [])

    @staticmethod
    def add_arguments(ap: argparse.ArgumentParser, required: Sequence[str] = (), **defaults: Any) -> None:
        """The options on ``ap``, typed as their fields, defaults the fields' (or ``defaults``, by
        field name), ``required`` by field name; ``extra_args`` takes what follows ``--``."""
        hints = typing.get_type_hints(ServerConfig)
        for f in ServerConfig.options():
            flag, default = "--" + f.metadata["option"], defaults.get(f.name, f.default)
            if f.metadata["negate"] or f.metadata["flag"]:
                ap.add_argument(flag, dest=f.name, action="store_false" if f.metadata["negate"] else "store_true",
                                default=default, help=f.metadata["help"])
                continue
            kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
            ap.add_argument(flag, dest=f.name, type=kind, default=default, required=f.name in required,
                            choices=tuple(DEVICE_DEFAULTS) if f.name == "device" else None, help=f.metadata["help"])
        ap.add_argument("extra_args", nargs=argparse.REMAINDER, help="after --: passed to SGLang's launch_server")

    @staticmethod
    def from_namespace(ns: argparse.Namespace, **more: Any) -> "ServerConfig":
        """The config of what :meth:`add_arguments` parsed (``more``: the fields not on a command line)."""
        extra = list(ns.extra_args)
        kw = {f.name: getattr(ns, f.name) for f in ServerConfig.options()}
        return ServerConfig(**kw, extra_args=extra[1:] if extra[:1] == ["--"] else extra, **more)

    @staticmethod
    def from_argv(argv: Sequence[str], **defaults: Any) -> "ServerConfig":
        """:meth:`to_argv` read back (``defaults``: as in :meth:`add_arguments`)."""
        ap = argparse.ArgumentParser(prog="ServerConfig")
        ServerConfig.add_arguments(ap, **defaults)
        return ServerConfig.from_namespace(ap.parse_args(list(argv)))


#: files in a venv that tools/install_sglang_cpu.sh made (the first: its mark, written before it
#: installs anything; the second: its stamp, in venvs made before the mark was)
CPU_BUILD_MARKERS = (".mtepo-sglang-cpu", ".mtepo-sglang-installed")


def cpu_build_marker(python: str, prefix: Optional[str] = None) -> Optional[Path]:
    """The mark of tools/install_sglang_cpu.sh in the venv of ``python`` (``<venv>/bin/python``; a
    bare name is looked up on PATH) or in ``prefix`` (its ``sys.prefix``, where known), or None.
    A marked python is SGLang's CPU build, which cannot serve on a GPU."""
    if prefix is None:
        where = shutil.which(python) if os.sep not in python else python
        if where is None:
            return None
        prefix = str(Path(where).parent.parent)  # not resolved: a venv's python links elsewhere
    return next((Path(prefix) / m for m in CPU_BUILD_MARKERS if (Path(prefix) / m).is_file()), None)


def configured_sglang_python() -> Optional[str]:
    """``$MTEPO_SGLANG_PYTHON``, else ``<repo>/.venv-sglang/bin/python`` where it exists; None when
    neither: then the serve command's own python serves, if it imports sglang."""
    py = default_sglang_python()
    return py if Path(py).exists() or "MTEPO_SGLANG_PYTHON" in os.environ else None


def find_sglang_python(explicit: Optional[str] = None) -> str:
    """The serve command's SGLang python: ``explicit``, else :func:`configured_sglang_python`, else
    this python if it imports sglang; FileNotFoundError naming the variable to set."""
    if explicit:
        return explicit
    py = configured_sglang_python()
    if py is not None:
        return py
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    raise FileNotFoundError(f"no SGLang python: {default_sglang_python()} does not exist and {sys.executable} "
                            "cannot import sglang; set MTEPO_SGLANG_PYTHON or --python "
                            "(CPU: bash tools/install_sglang_cpu.sh)")


#: torch's allocator settings, in the variables torch reads them from (the second is torch >= 2.8's
#: device-neutral name); a server gets them without ``expandable_segments`` (:func:`server_env`)
ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

#: What a server whose memory is released (``enable_memory_saver``: colocated mode on GPUs) runs with,
#: read in SGLang 0.5.23's ``srt/environ.py`` and ``srt/entrypoints/http_server.py``:
#: * ``/health`` answers without generating (default: it submits a one-token generation, which on a
#:   server whose KV cache is unmapped ends in an illegal address and kills its scheduler; the
#:   fleet's liveness checks and sglang-router's polls reach it during a release);
#: * its CUDA graphs' memory under the memory saver (default off: a release of ``cuda_graph`` freed
#:   nothing); both variables are in 0.5.6's ``environ.py`` too (the declared range's first);
#: * torch's CUDA cache emptied after each release, which SGLang does not do (the activations its
#:   forward passes left cached): ``launch.py``'s ``empty_cache_after_release``, in its scheduler
#:   processes.
MEMORY_SAVER_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false", "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1",
                    "TEPO_SGLANG_EMPTY_CACHE_ON_RELEASE": "1"}


#: the server's environment variable that picks the wire dtype of the routing it returns
#: (``meta_info["routed_experts_dtype"]``; SGLang's source after 0.5.23:
#: ``srt/state_capturer/routed_experts_wire.py``; releases up to 0.5.23 ignore it and send int32)
ROUTED_EXPERTS_DTYPE_ENV = "SGLANG_ROUTED_EXPERTS_DTYPE"


def routed_experts_wire_dtype(model_path: Optional[str]) -> str:
    """The narrowest routing wire dtype (``uint8``, ``uint16``, ``int32``) that holds every expert id
    of the model in ``model_path`` (its ``config.json``'s ``num_experts`` / ``num_local_experts``);
    ``uint16``, which holds any real model's, where that file cannot be read here."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts"))
    except (OSError, ValueError, TypeError):
        return "uint16"
    return "uint8" if experts <= 256 else "uint16" if experts <= 65536 else "int32"


def without_expandable_segments(conf: str) -> str:
    """An allocator setting (``key:value,key:value``) without its ``expandable_segments`` entry."""
    return ",".join(item for item in conf.split(",")
                    if item.strip() and item.split(":", 1)[0].strip() != "expandable_segments")


def server_env(cfg: ServerConfig, base_env: Dict[str, str]) -> Dict[str, str]:
    """The variables :func:`server_command` sets or removes on top of the caller's environment, as
    ``{name: value}`` (``None``: removed); pure. Every server: torch's allocator settings without
    ``expandable_segments`` (torch_memory_saver refuses to start with them, and SGLang shares memory
    between its processes by CUDA IPC, which they break; a user's setting is the trainer's, see
    slurm/lib.sh); a server that releases its memory: :data:`MEMORY_SAVER_ENV`; a server that returns
    routing (``enable_return_routed_experts``): :data:`ROUTED_EXPERTS_DTYPE_ENV`, the narrowest dtype
    that holds the model's expert ids (:func:`routed_experts_wire_dtype`; the caller's own setting
    stays)."""
    out: Dict[str, Optional[str]] = {}
    for name in ALLOC_CONF_ENVS:
        if name in base_env:
            kept = without_expandable_segments(base_env[name])
            if kept != base_env[name]:
                out[name] = kept or None
    if cfg.enable_memory_saver:
        out.update(MEMORY_SAVER_ENV)
    if cfg.enable_return_routed_experts and ROUTED_EXPERTS_DTYPE_ENV not in base_env:
        out[ROUTED_EXPERTS_DTYPE_ENV] = routed_experts_wire_dtype(cfg.model_path)
    return out


def lora_flags(cfg: ServerConfig) -> List[str]:
    """SGLang's LoRA flags of ``cfg`` (none without ``max_lora_rank``): LoRA enabled for adapters up
    to that rank on ``lora_target_modules`` (default: every module SGLang adapts), two adapters in a
    batch at most (the weight sync's ``adapters`` mode loads the next version before it unloads the
    last: ``rollout/sglang/weight_sync/lora.py``); a CPU server computes them with the
    ``torch_native`` backend (the others are Triton kernels)."""
    if not cfg.max_lora_rank:
        return []
    modules = [m for m in (cfg.lora_target_modules or "all").split(",") if m]
    out = ["--enable-lora", "--max-lora-rank", str(int(cfg.max_lora_rank)), "--lora-target-modules", *modules,
           "--max-loras-per-batch", "2"]
    return out + (["--lora-backend", "torch_native"] if cfg.device == "cpu" else [])


def server_command(cfg: ServerConfig, port: int, api_key: Optional[str] = None,
                   base_env: Optional[Dict[str, str]] = None) -> Tuple[List[str], Dict[str, str]]:
    """The command line and environment of one SGLang server: the single place that knows SGLang's
    flags (the fleet's ``launch_server`` and the serve command, ``python -m
    megatron_tepo.rollout.sglang.server``, which slurm/lib.sh runs, both use it). Pure: ``base_env``
    (default ``os.environ``) is copied.

    The server is ``cfg.python megatron_tepo/rollout/sglang/launch.py ARGS``, SGLang's own launch
    with the API key read from the environment (``TEPO_SGLANG_API_KEY``, set here to ``api_key``;
    removed when there is none): no key on a command line, where ``ps`` shows it to every user.

    ``cfg.device == "cpu"`` adds the CPU engine's flags (torch-native attention, PyTorch sampling,
    no CUDA graphs, sleep when idle) and env (``SGLANG_USE_CPU_ENGINE=1``, no visible GPU, ``threads_per_server``
    OMP/MKL threads); ``"cuda"`` leaves the GPU choice to the caller's ``CUDA_VISIBLE_DEVICES``.
    The variables of :func:`server_env` (no expandable segments; a memory-saver server's settings;
    a routing server's wire dtype) come before ``cfg.env``, which is the caller's last word.
    """
    if not cfg.model_path:
        raise ValueError("ServerConfig.model_path is needed to launch SGLang servers")
    if cfg.device not in DEVICE_DEFAULTS:
        raise ValueError(f"ServerConfig.device: expected cpu or cuda, found {cfg.device!r}")
    if cfg.enable_memory_saver and cfg.device != "cuda":
        raise ValueError("ServerConfig.enable_memory_saver: SGLang's memory saver (torch_memory_saver) is CUDA's; "
                         "a cpu server releases its memory without it")
    marker = cpu_build_marker(cfg.python) if cfg.device == "cuda" else None
    if marker is not None:
        raise ValueError(f"device cuda: the SGLang python {cfg.python} is the CPU build of "
                         f"tools/install_sglang_cpu.sh ({marker}); set MTEPO_SGLANG_PYTHON (or --python) "
                         f"to a python with a CUDA build of SGLang")
    cmd = [cfg.python, SGLANG_LAUNCHER, "--model-path", str(cfg.model_path),
           "--host", cfg.host, "--port", str(int(port))]
    cmd += ["--dtype", cfg.dtype, "--device", cfg.device, "--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.skip_warmup:
        cmd += ["--skip-server-warmup"]
    if cfg.tp != 1:
        cmd += ["--tp-size", str(cfg.tp)]
    if cfg.max_total_tokens:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.max_running_requests:
        cmd += ["--max-running-requests", str(cfg.max_running_requests)]
    if cfg.context_length:
        cmd += ["--context-length", str(cfg.context_length)]
    if cfg.enable_memory_saver:
        cmd += ["--enable-memory-saver"]
    if cfg.enable_return_routed_experts:
        cmd += ["--enable-return-routed-experts"]
    cmd += lora_flags(cfg)
    env = dict(os.environ if base_env is None else base_env)
    if cfg.device == "cpu":
        cmd += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
                # an idle CPU scheduler busy-polls: measured 101% of a core (2% with this flag), which
                # the trainer sharing the node loses; a request wakes it at once (zmq poll)
                "--sleep-on-idle"]
        env.update({"SGLANG_USE_CPU_ENGINE": "1", "CUDA_VISIBLE_DEVICES": "",
                    "OMP_NUM_THREADS": str(cfg.threads_per_server),
                    "MKL_NUM_THREADS": str(cfg.threads_per_server)})
    cmd += list(cfg.extra_args)
    env.pop("PYTHONPATH", None)  # the server runs in its own venv
    for name, value in server_env(cfg, env).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env.update(cfg.env)
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    return cmd, env
