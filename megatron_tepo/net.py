"""Small network helpers: :func:`free_port`, the one way this package and its tools pick a port
(the SGLang fleet, the weight sync, the launchers, the converter's torchrun, the tests), and
:func:`single_process_env`, the ``env://`` variables of a one-process world.

Standard library only: ``rollout/`` (which imports nothing of megatron), ``slurm/lib.sh`` and the
test helpers import it without loading torch."""
from __future__ import annotations

import os
import random
import socket

__all__ = ["free_port", "ephemeral_range", "single_process_env"]

_LOWEST = 10000  # below this, ports of well-known services


def ephemeral_range() -> tuple:
    """The kernel's range for outgoing connections' local ports (Linux; else IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A TCP port that is free on ``host`` right now, chosen outside the kernel's ephemeral range.

    A port handed out by the OS (bind to 0) comes from the ephemeral range, which every outgoing
    TCP connection on the machine draws from too: a server that binds it only after a slow start
    (an SGLang server under load takes minutes) can find it taken. A random port between 10000 and
    the start of that range is not handed to outgoing connections; the OS's pick is the fallback."""
    lo, _ = ephemeral_range()
    if lo - _LOWEST >= 1000:
        rng = random.SystemRandom()
        for _ in range(tries):
            port = rng.randrange(_LOWEST, lo)
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """Outside torchrun (no ``RANK`` set): the ``env://`` variables of a one-process world on a
    free loopback port, so ``init_process_group`` works in a plain ``python`` run."""
    if "RANK" in os.environ:
        return
    port = free_port("127.0.0.1")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
