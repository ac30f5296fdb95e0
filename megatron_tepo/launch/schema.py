"""The ``launch`` section of a launch file: where the job runs (:class:`LaunchLayout`) and how its
SGLang servers are sized (:class:`SGLangLayout`), read by :func:`read_layout` with the run
config's own typed loader (:func:`megatron_tepo.config.build_section`: unknown and moved keys,
types and choices are errors naming the key and its file and line), then checked against each
other. What the settings mean: docs/LAUNCH.md. Left out: the rest of the file (the run config and
the architecture, :mod:`megatron_tepo.launch.spec`) and any memory arithmetic."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Optional

from megatron_tepo.config import ConfigError, build_section

__all__ = ["SGLangLayout", "LaunchLayout", "read_layout"]


@dataclass
class SGLangLayout:
    tp: int = 1  # GPUs per SGLang server
    max_running_requests: int = 64  # concurrent sequences per server (SGLang --max-running-requests)
    mem_fraction_static: float = 0.85  # SGLang --mem-fraction-static: weights + KV pool share
    port: int = 30000  # first server port on a node (server i uses port + i); 0: free ports picked
    # by the batch shell (one-node jobs whose servers run on the batch host only)
    servers_per_node: int = 0  # 0: gpus_per_node / tp on GPU, 1 on CPU
    max_total_tokens: int = 0  # SGLang --max-total-tokens (KV pool in tokens); 0: SGLang's sizing
    threads: int = 1  # OMP threads per CPU server (launch.device: cpu)


@dataclass
class LaunchLayout:
    device: Literal["cuda", "cpu"] = "cuda"  # cpu: no GPU arithmetic, gpus_per_node = processes
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    actor_nodes: int = 1
    rollout_nodes: int = 1
    reserve_gib: float = 4.0  # CUDA context + NCCL buffers + fragmentation, per actor GPU
    sglang: SGLangLayout = field(default_factory=SGLangLayout)

    @property
    def actor_gpus(self) -> int:
        return self.actor_nodes * self.gpus_per_node

    @property
    def colocated(self) -> bool:
        """The SGLang servers run on the actor nodes (``launch.rollout_nodes: 0``, CPU only)."""
        return self.rollout_nodes == 0

    @property
    def servers_per_node(self) -> int:
        if self.sglang.servers_per_node:
            return self.sglang.servers_per_node
        return 1 if self.device == "cpu" else self.gpus_per_node // self.sglang.tp

    @property
    def servers(self) -> int:
        return (self.actor_nodes if self.colocated else self.rollout_nodes) * self.servers_per_node


def read_layout(data: Any, where: Optional[Dict[str, str]] = None) -> LaunchLayout:
    """The ``launch`` section: typed by the run config's loader (``where``: dotted key -> file and
    line, as :func:`megatron_tepo.config.read_yaml_file` records them), then its cross-field rules."""
    out: LaunchLayout = build_section(LaunchLayout, data, "launch", where)
    for name in ("gpus_per_node", "actor_nodes"):
        if getattr(out, name) < 1:
            raise ConfigError(f"launch.{name}: must be >= 1, got {getattr(out, name)}")
    if out.rollout_nodes < 0:
        raise ConfigError(f"launch.rollout_nodes: must be >= 0, got {out.rollout_nodes}")
    if out.rollout_nodes == 0 and out.device != "cpu":
        raise ConfigError("launch.rollout_nodes: 0 (SGLang servers on the actor nodes) needs "
                          "launch.device: cpu; on GPUs give the servers their own nodes (>= 1)")
    if out.gpu_mem_gib <= 0 or out.reserve_gib < 0:
        raise ConfigError("launch.gpu_mem_gib must be > 0 and launch.reserve_gib >= 0")
    s = out.sglang
    if s.tp < 1 or out.gpus_per_node % s.tp:
        raise ConfigError(f"launch.sglang.tp: {s.tp} must be >= 1 and divide launch.gpus_per_node "
                          f"({out.gpus_per_node}); a server does not span nodes")
    if s.max_running_requests < 1:
        raise ConfigError("launch.sglang.max_running_requests: must be >= 1")
    if s.servers_per_node < 0 or s.max_total_tokens < 0 or s.threads < 1 or not 0 <= s.port < 65536:
        raise ConfigError("launch.sglang: servers_per_node and max_total_tokens must be >= 0, "
                          "threads >= 1, port in [0, 65535]")
    if out.device == "cuda" and s.servers_per_node * s.tp > out.gpus_per_node:
        raise ConfigError(f"launch.sglang.servers_per_node: {s.servers_per_node} servers x tp {s.tp} "
                          f"need more than launch.gpus_per_node ({out.gpus_per_node}) GPUs")
    if not 0 < s.mem_fraction_static <= 1:
        raise ConfigError("launch.sglang.mem_fraction_static: must be in (0, 1]")
    return out
