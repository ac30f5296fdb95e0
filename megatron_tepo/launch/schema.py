"""The ``launch`` section of a launch file: where the job runs (:class:`LaunchLayout`) and its
rollout servers (:class:`RolloutServers`: which engine, where, and one server's options), read by
:func:`read_layout` with the run config's own typed loader
(:func:`megatron_tepo.config.build_section`: unknown and moved keys, types and choices are errors
naming the key and its file and line), then checked against each other.

The servers' section names its engine and holds its options::

    launch:
      rollout:
        engine: sglang      # a name of megatron_tepo/launch/engines.py
        tp: 2               # the engine's options (sglang: ServerConfig's launch keys) ...
        port: 30000         # ... and where the servers run: port, servers_per_node, placement
      # or, the old form, the same as engine: sglang:  sglang: {tp: 2, port: 30000}

``placement: colocated`` puts the servers on the actor's nodes and GPUs (server i of a node on
its GPUs ``[i*tp, (i+1)*tp)``), taking turns with the actor for the memory (the run's
``rollout.colocated``): the job needs only the actor's nodes (``rollout_nodes`` is 0, its default
then). ``separate`` (the default) gives them their own nodes, or on CPU with ``rollout_nodes: 0``
runs them beside the trainer on its nodes (no turns: the tiny CPU job).

Its option keys and their defaults are the engine's own options type (one server's schema, whose
device-dependent defaults follow ``launch.device``); errors name the section the file used
(``launch.rollout.tp`` or ``launch.sglang.tp``). What the settings mean: docs/LAUNCH.md. Left out:
the rest of the file (the run config and the architecture, :mod:`megatron_tepo.launch.spec`), what
colocation makes of the run config (:mod:`megatron_tepo.launch.spec`) and any memory arithmetic
(a colocated server's ``mem_fraction_static`` is the fit check's: :mod:`megatron_tepo.launch.fit`)."""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Optional

from megatron_tepo.config import ConfigError, build_section
from megatron_tepo.launch.engines import ServedEngine, served_engine

__all__ = ["RolloutServers", "LaunchLayout", "read_layout"]

OLD_SECTION = "sglang"  # launch.sglang: the old name of launch.rollout with engine: sglang


@dataclass
class RolloutServers:
    """The rollout servers the launcher starts: ``engine`` (a name of
    :data:`~megatron_tepo.launch.engines.SERVED_ENGINES`), where they run, and one server's options
    (``server``: the engine's options type; None: its defaults for ``launch.device``)."""
    engine: str = "sglang"
    port: int = 30000  # first server port on a node (server i uses port + i); 0: free ports picked
    # by the batch shell (one-node jobs whose servers run on the batch host only)
    servers_per_node: int = 0  # 0: gpus_per_node / tp on GPU, 1 on CPU
    # separate: their own nodes (CPU: or beside the trainer with rollout_nodes 0); colocated: on the
    # actor's GPUs, taking turns with the actor for the memory (rollout.colocated)
    placement: Literal["separate", "colocated"] = "separate"
    server: Any = None
    key: str = "launch.rollout"  # the section the launch file set them in, for the errors


PLACEMENT = ("port", "servers_per_node", "placement")  # RolloutServers' keys beside the engine's options


@dataclass
class LaunchLayout:
    device: Literal["cuda", "cpu"] = "cuda"  # cpu: no GPU arithmetic, gpus_per_node = processes
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    actor_nodes: int = 1
    rollout_nodes: int = 1
    reserve_gib: float = 4.0  # CUDA context + NCCL buffers + fragmentation, per actor GPU
    # colocated placement on cuda (the fit check's phases, docs/LAUNCH.md): a server GPU's memory
    # outside SGLang's static pool while it generates (CUDA graphs, activations, sampling) ...
    server_reserve_gib: float = 3.0
    # ... and what it keeps after releasing its memory (CUDA context, NCCL communicators)
    server_released_gib: float = 1.5
    # host memory per node for the actor's pinned copies (colocated on cuda): None -- the node's, where
    # the fit check runs inside the job (the job's memory, else the node's MemTotal; not checked elsewhere,
    # e.g. a dry run); 0 -- not checked
    host_mem_gib: Optional[float] = None
    rollout: RolloutServers = field(default_factory=RolloutServers)

    def __post_init__(self):
        if self.rollout.server is None:
            self.rollout.server = served_engine(self.rollout.engine).options(device=self.device)

    @property
    def actor_gpus(self) -> int:
        return self.actor_nodes * self.gpus_per_node

    @property
    def shares_actor_nodes(self) -> bool:
        """The rollout servers run on the actor nodes (``launch.rollout_nodes: 0``)."""
        return self.rollout_nodes == 0

    @property
    def colocated(self) -> bool:
        """The servers share the actor's devices and take turns with it for the memory
        (``launch.rollout.placement: colocated``: the run's ``rollout.colocated``)."""
        return self.rollout.placement == "colocated"

    @property
    def servers_per_node(self) -> int:
        if self.rollout.servers_per_node:
            return self.rollout.servers_per_node
        return 1 if self.device == "cpu" else self.gpus_per_node // self.rollout.server.tp

    @property
    def servers(self) -> int:
        return (self.actor_nodes if self.shares_actor_nodes else self.rollout_nodes) * self.servers_per_node


@functools.lru_cache(maxsize=None)
def section_type(engine: ServedEngine) -> type:
    """The servers' section as a dataclass for the typed loader: the placement keys and the
    engine's option keys, typed and defaulted by the options type (not copied: made from it)."""
    hints, own_hints = typing.get_type_hints(engine.options), typing.get_type_hints(RolloutServers)
    own = {f.name: f for f in dataclasses.fields(RolloutServers)}
    specs = [(k, own_hints[k], field(default=own[k].default)) for k in PLACEMENT]
    specs += [(k, hints[f.name], field(default=f.default)) for k, f in engine.options.launch_keys().items()]
    return dataclasses.make_dataclass(f"{engine.name}_servers", specs)


def read_servers(section: Any, key: str, device: str, where: Dict[str, str]) -> RolloutServers:
    """``launch.rollout`` (``key``; ``launch.sglang``: the old form, engine sglang) for ``device``."""
    if not isinstance(section, dict):
        loc = f" ({where[key]})" if key in where else ""
        raise ConfigError(f"{key}{loc}: expected a mapping for section '{key}', found "
                          f"{type(section).__name__} {section!r}")
    section = dict(section)
    name = section.pop("engine", "sglang") if key == "launch.rollout" else "sglang"
    engine = served_engine(name, f"{key}.engine", where.get(f"{key}.engine"))
    typed = build_section(section_type(engine), section, key, where)
    options = {f.name: getattr(typed, k) for k, f in engine.options.launch_keys().items()}
    if typed.placement == "colocated" and device == "cuda" and options.get("mem_fraction_static") is not None:
        loc = f" ({where[key + '.mem_fraction_static']})" if key + ".mem_fraction_static" in where else ""
        raise ConfigError(f"{key}.mem_fraction_static{loc}: {key}.placement: colocated derives it (the fit check: "
                          f"what the GPUs leave the servers beside the actor); remove it, and size the servers "
                          f"with {key}.max_running_requests")
    return RolloutServers(engine=name, port=typed.port, servers_per_node=typed.servers_per_node,
                          placement=typed.placement, server=engine.options(device=device, **options), key=key)


def read_layout(data: Any, where: Optional[Dict[str, str]] = None) -> LaunchLayout:
    """The ``launch`` section: typed by the run config's loader (``where``: dotted key -> file and
    line, as :func:`megatron_tepo.config.read_yaml_file` records them), then its cross-field rules."""
    where = where or {}
    sections = {}
    explicit_rollout_nodes = isinstance(data, dict) and "rollout_nodes" in data
    if isinstance(data, dict):
        data = dict(data)
        sections = {k: data.pop(k) for k in ("rollout", OLD_SECTION) if k in data}
    if len(sections) == 2:
        raise ConfigError(f"launch.{OLD_SECTION}: the old name of launch.rollout (engine: sglang); "
                          f"give one of the two sections")
    out: LaunchLayout = build_section(LaunchLayout, data, "launch", where)
    for name, section in sections.items():
        out.rollout = read_servers(section, f"launch.{name}", out.device, where)
    for name in ("gpus_per_node", "actor_nodes"):
        if getattr(out, name) < 1:
            raise ConfigError(f"launch.{name}: must be >= 1, got {getattr(out, name)}")
    r, k = out.rollout, out.rollout.key
    if out.colocated:
        if explicit_rollout_nodes and out.rollout_nodes != 0:
            loc = f" ({where['launch.rollout_nodes']})" if "launch.rollout_nodes" in where else ""
            raise ConfigError(f"launch.rollout_nodes{loc}: {out.rollout_nodes}, but {k}.placement: colocated puts "
                              f"the servers on the actor's nodes; set launch.rollout_nodes: 0 (or leave it out)")
        out.rollout_nodes = 0
    if out.rollout_nodes < 0:
        raise ConfigError(f"launch.rollout_nodes: must be >= 0, got {out.rollout_nodes}")
    if out.rollout_nodes == 0 and out.device != "cpu" and not out.colocated:
        raise ConfigError(f"launch.rollout_nodes: 0 on cuda puts the rollout servers on the actor's GPUs: set "
                          f"{k}.placement: colocated (they take turns with the actor for the memory), or give "
                          f"them their own nodes (>= 1)")
    if out.gpu_mem_gib <= 0 or min(out.reserve_gib, out.server_reserve_gib, out.server_released_gib,
                                   0 if out.host_mem_gib is None else out.host_mem_gib) < 0:
        raise ConfigError("launch.gpu_mem_gib must be > 0, and launch.reserve_gib, server_reserve_gib, "
                          "server_released_gib and host_mem_gib >= 0")
    tp = r.server.tp
    if tp < 1 or out.gpus_per_node % tp:
        raise ConfigError(f"{k}.tp: {tp} must be >= 1 and divide launch.gpus_per_node "
                          f"({out.gpus_per_node}); a server does not span nodes")
    for option, why in r.server.invalid():
        raise ConfigError(f"{k}.{option}: {why}, got {getattr(r.server, r.server.launch_keys()[option].name)}")
    if r.servers_per_node < 0 or not 0 <= r.port < 65536:
        raise ConfigError(f"{k}: servers_per_node must be >= 0 and port in [0, 65535]")
    if out.device == "cuda" and r.servers_per_node * tp > out.gpus_per_node:
        raise ConfigError(f"{k}.servers_per_node: {r.servers_per_node} servers x tp {tp} "
                          f"need more than launch.gpus_per_node ({out.gpus_per_node}) GPUs")
    return out
