"""What a test may leave behind in pytest's own process that turns later tests red: a
torch.distributed process group, megatron's parallel state, and the rendezvous variables of an
``env://`` world (``RANK``, ``MASTER_PORT`` ...: a process a later test starts inherits them).

``tests/conftest.py`` snapshots them before every test and, after it, fails the test that left
any behind (naming it and what it left), then undoes them, so one leak shows as one error and
not as a cascade of later failures (a leaked gloo group once turned 13 later tests red in CI).
Left out: threads, open files and child processes (each test that starts one stops it itself).
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional

#: the ``env://`` rendezvous variables (torchrun's, and ``net.single_process_env``'s)
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def snapshot() -> Dict[str, Optional[str]]:
    """The rendezvous variables as they are now (None: unset)."""
    return {k: os.environ.get(k) for k in RENDEZVOUS}


def _parallel_state():
    """megatron's parallel state, if this process imported it (never imported here)."""
    return sys.modules.get("megatron.core.parallel_state")


def leaks(before: Dict[str, Optional[str]]) -> List[str]:
    """What is left now that was not there at ``before`` (:func:`snapshot`), one phrase each."""
    import torch.distributed as dist

    found = []
    if dist.is_available() and dist.is_initialized():
        found.append("a torch.distributed process group")
    ps = _parallel_state()
    if ps is not None and ps.model_parallel_is_initialized():
        found.append("megatron's parallel state (destroy_model_parallel)")
    changed = [f"{k}={os.environ.get(k)!r} (was {before.get(k)!r})" for k in RENDEZVOUS
               if os.environ.get(k) != before.get(k)]
    if changed:
        found.append("rendezvous variables " + ", ".join(changed))
    return found


def undo(before: Dict[str, Optional[str]]) -> None:
    """Destroy what :func:`leaks` finds and put the rendezvous variables back as ``before`` had them."""
    import torch.distributed as dist

    ps = _parallel_state()
    if ps is not None:
        ps.destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
