"""The ``distributed`` weight sync: one broadcast per bucket over a process group between the
sender and every TP worker of every server.

The group (``/init_weights_update_group``; gloo on CPU, nccl on GPU) is made once and kept while
the live servers stay the same (a restarted server, a new incarnation, makes a new group). SGLang gives worker ``r`` of a server the rank
``rank_offset + r``, so the offsets are cumulative: server i gets ``1 + sum(tp_size of servers <
i)`` and the world is ``1 + sum(tp_size)``. A server's TP size is known when the fleet launched
it (``ServerConfig.tp``) and asked of it otherwise (``/server_info``: ``tp_size``). Per bucket one
``/update_weights_from_distributed`` with ``load_format="flattened_bucket"`` and one broadcast of
the bucket's bytes; the request is answered once the servers have received and loaded the bucket.

Ordering: request k+1 goes out only once every server answered request k. The bucket sizes a
server receives come from the requests, in the order its update handler takes them; two bucket
requests in flight at once may be taken in either order (two HTTP connections), and a server that
takes k+1 first posts a receive of the wrong size (a hang, or bytes loaded under the wrong
names). The completion of broadcast k does not rule that out: on gloo ``work.wait()`` returns once
the servers received bucket k, but on NCCL it only orders CUDA streams and the CPU goes on at
once. The answer is the one signal that holds on every backend. What still overlaps: the sender
does not wait for request k's answer before building bucket k+1 (the actor's gather), so the
servers' load of bucket k runs during the next gather; only the request's round trip is serial.

The address the servers connect back to (:func:`sync_master_address`): ``TEPO_SYNC_ADDRESS``,
else ``rollout.sync_address``, else this host's interface on the route to the servers.

Left out: what every mode shares (``base.py``); servers the sender cannot reach by TCP at
``master_address``.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
from datetime import timedelta
from typing import List, Optional, Tuple
from urllib.parse import urlparse

import torch

from megatron_tepo.buckets import FlatBucket
from megatron_tepo.dtypes import dtype_name
from megatron_tepo.net import free_port

from .base import WeightSync

log = logging.getLogger(__name__)
SYNC_ADDRESS_ENV = "TEPO_SYNC_ADDRESS"


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout: Optional[timedelta] = None):
    """A process group outside the default one (the trainer's own group is untouched).

    The same construction as ``sglang.srt.utils.init_custom_process_group`` (which the servers use
    on their side, joining ``init_method`` as clients): a TCP store, a ``PrefixStore(group_name)``,
    ``_new_process_group_helper``. Rank 0 (the sender) hosts the TCP store itself: torch's
    ``rendezvous()`` would, under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``), connect as a
    client to the elastic agent's store instead and wait forever.
    """
    from urllib.parse import urlparse

    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, default_pg_timeout)

    timeout = timeout or default_pg_timeout
    u = urlparse(init_method)
    if u.scheme != "tcp":
        raise ValueError(f"init_method must be tcp://host:port, got {init_method}")
    store = TCPStore(u.hostname, u.port, world_size, is_master=rank == 0, timeout=timeout,
                     wait_for_workers=False)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def sync_master_address(urls: List[str], setting: Optional[str] = None) -> str:
    """The address the servers reach this (sender) process at for ``sync_mode: distributed``.

    ``TEPO_SYNC_ADDRESS`` if set, else ``setting`` (``rollout.sync_address``): an IP address or a
    host name that resolves here (else a one-line :class:`ConfigError` naming the variable or
    field). Neither: the address of this host's interface on the route to the first server that is
    not on loopback (the first server when all are), found by connecting a UDP socket to it (no
    packet is sent) -- loopback for local servers. Not ``gethostbyname(gethostname())``, which is
    often 127.0.1.1 (/etc/hosts) or a management NIC the servers cannot reach."""
    from megatron_tepo.config import ConfigError

    env = os.environ.get(SYNC_ADDRESS_ENV, "").strip()
    explicit, name = (env, SYNC_ADDRESS_ENV) if env else ((setting or "").strip(), "rollout.sync_address")
    if explicit:
        try:
            socket.getaddrinfo(explicit, None)
        except (OSError, UnicodeError) as exc:
            raise ConfigError(f"{name}: {explicit!r} is not an IP address or a host name that resolves "
                              f"here ({exc})") from None
        return explicit
    if not urls:
        raise ValueError("sync_master_address: no server URL to find the route to")
    hosts = [(urlparse(u).hostname, urlparse(u).port or (443 if urlparse(u).scheme == "https" else 80))
             for u in urls]
    host, port = next((h for h in hosts if not _is_loopback(h[0])), hosts[0])
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP: picks the route and its source address, sends nothing
            return s.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"{SYNC_ADDRESS_ENV} / rollout.sync_address: unset, and no route to the SGLang server "
                          f"{host}:{port} to take this host's address from ({exc}); set one") from None


class DistributedSync(WeightSync):
    """``backend``: the group's (default nccl where CUDA is available, else gloo);
    ``master_address`` / ``master_port``: where the servers reach the sender (the port: a free
    one when None); ``group_name``: the group's name on both sides; ``group_timeout_s``: how long
    the sender's side of the group waits in one broadcast (default: the request time-out; a run
    gives its process groups' time-out, ``FaultConfig.process_group_timeout_s``, so that the
    watchdog's ``sync`` phase fires first)."""

    mode = "distributed"
    align_buckets = True  # a flattened bucket's tensors start at multiples of their item size

    def __init__(self, target, backend: Optional[str] = None, master_address: str = "127.0.0.1",
                 master_port: Optional[int] = None, group_name: str = "mtepo_weight_sync",
                 group_timeout_s: Optional[float] = None, **common):
        super().__init__(target, **common)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address, self.master_port = master_address, master_port
        self.group_name = group_name
        self.group_timeout_s = group_timeout_s or self.timeout
        self._pg = None
        self._pg_servers: Tuple[str, ...] = ()
        self._pending = None  # the last bucket's requests, until every server answered them
        self._bcast = None  # the last bucket's broadcast, until it completes

    @classmethod
    def options_from(cls, rollout, urls: List[str], fault=None) -> dict:
        options = {"master_address": sync_master_address(urls, rollout.sync_address)}
        if fault is not None:
            options["group_timeout_s"] = fault.process_group_timeout_s()
        return options

    def _prepare(self, servers) -> None:
        self._ensure_group(servers)

    def _ensure_group(self, servers) -> None:
        # a restarted server (a new incarnation, maybe at the same URL) joins a new group
        urls = tuple((s.url, getattr(s, "incarnation", 0)) for s in servers)
        if self._pg is not None and urls == self._pg_servers:
            return
        tp = [self._tp_size(s) for s in servers]  # each TP worker of a server joins the group
        self._destroy_group()
        port = self.master_port or free_port(self.master_address)
        world = 1 + sum(tp)
        offsets = [1 + sum(tp[:i]) for i in range(len(servers))]
        joining = self._start_each("/init_weights_update_group", [
            (s, {"master_address": self.master_address, "master_port": port, "rank_offset": off,
                 "world_size": world, "group_name": self.group_name, "backend": self.backend})
            for s, off in zip(servers, offsets)])
        pg = init_custom_process_group(self.backend, f"tcp://{self.master_address}:{port}", world, 0,
                                       self.group_name, timeout=timedelta(seconds=self.group_timeout_s))
        self._join(*joining, "/init_weights_update_group")
        self._pg, self._pg_servers = pg, urls

    def _destroy_group(self) -> None:
        if self._pg is None:
            return
        try:
            servers = [s for s in self.target.alive_servers()
                       if (s.url, getattr(s, "incarnation", 0)) in self._pg_servers]
            self._post_all("/destroy_weights_update_group", {"group_name": self.group_name}, servers or None)
        except Exception as e:  # noqa: BLE001 -- best effort on the way out
            log.warning("weight sync: destroying the update group failed: %s", e)
        try:
            torch.distributed.destroy_process_group(self._pg)
        except Exception:  # noqa: BLE001
            pass
        self._pg, self._pg_servers = None, ()

    def _send(self, bucket: FlatBucket, servers) -> None:
        """One request + one asynchronous broadcast, sent once every server answered the previous
        bucket's request (see the module docstring: on NCCL nothing else tells the sender that a
        server took request k before request k+1 arrives). The sender does not wait for this
        bucket's answer: it builds the next bucket meanwhile (the bucket's ``release`` makes the
        export wait for the broadcast before it reuses the buffer)."""
        self._wait_pending()  # request k-1 answered: the servers loaded bucket k-1
        self._wait_broadcast()
        payload = {"names": list(bucket.names), "dtypes": [dtype_name(d) for d in bucket.dtypes],
                   "shapes": [list(sh) for sh in bucket.shapes], "group_name": self.group_name,
                   "load_format": "flattened_bucket", "flush_cache": False}
        threads, errors = self._start_all("/update_weights_from_distributed", payload, servers)
        self._bcast = torch.distributed.broadcast(bucket.flat, src=0, group=self._pg, async_op=True)
        bucket.release = self._wait_broadcast
        self._pending = (threads, errors)

    def _in_flight(self):
        return (self._wait_broadcast, self._wait_pending)

    def _wait_broadcast(self) -> None:
        work, self._bcast = self._bcast, None
        if work is not None:
            work.wait()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._join(*pending, "/update_weights_from_distributed")

    def close(self) -> None:
        self._destroy_group()
        super().close()
