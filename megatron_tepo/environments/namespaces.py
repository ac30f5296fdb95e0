"""The user namespace a sandbox starts from: this process's uid map (:func:`read_uid_map`), the host
uid one of its uids is (:func:`host_uid`: a remapped root -- enroot's and pyxis's
``--container-remap-root`` -- is another host uid), and the process limit's caveat on kernels before
5.14 (:func:`nproc_caveat`). Pure functions of ``/proc`` text and a kernel release; the sandbox
(:mod:`.processes`) decides with them which uid bwrap runs as and what it says. Standard library only.

Left out: nested namespaces beyond one level up (the map names the parent's uids only).
"""
from __future__ import annotations

import re
from typing import List, Optional

__all__ = ["read_uid_map", "host_uid", "nproc_caveat"]


def read_uid_map(path: str = "/proc/self/uid_map") -> Optional[List[str]]:
    """This process's user namespace's uid map (``inside outside count`` lines), ``None`` if unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            return [" ".join(line.split()) for line in f if line.strip()]
    except OSError:
        return None


def host_uid(uid: int, uid_map: Optional[List[str]]) -> Optional[int]:
    """The uid that ``uid`` of this user namespace is in its parent's (the host's, one level up), from
    :func:`read_uid_map`'s lines; ``None`` when the map holds no such uid, or is unreadable."""
    for line in uid_map or ():
        try:
            inside, outside, count = (int(x) for x in line.split())
        except ValueError:
            continue
        if inside <= uid < inside + count:
            return outside + uid - inside
    return None


def nproc_caveat(release: str, uid: int, where: str = "sandbox") -> Optional[str]:
    """The line that says, on a kernel older than 5.14 (``release``: ``platform.release()``'s form),
    that ``RLIMIT_NPROC`` counts all the processes of the host uid ``uid`` bwrap runs as, not those of
    one sandbox's user namespace (per user namespace only from Linux 5.14: RHEL 8 and Ubuntu 20.04
    have older ones); ``None`` on 5.14 and later, or a release it cannot read."""
    m = re.match(r"(\d+)\.(\d+)", release)
    if m is None or (int(m.group(1)), int(m.group(2))) >= (5, 14):
        return None
    return (f"{where}.processes: on Linux {release} (< 5.14) RLIMIT_NPROC counts every process and thread of "
            f"uid {uid}, not one sandbox's: all the sandboxes running at once share one count of "
            f"{where}.processes, with every other process of that uid (a non-root trainer's own threads too), "
            f"so tool code may fail to start a thread or a process; a kernel >= 5.14 counts per sandbox")
