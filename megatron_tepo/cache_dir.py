"""A directory built once and shared by every process that asks for it (a warm-up's weights, a
converted test model): :func:`build_once`. Several processes may ask at the same time (the test
suite's two pytest runs, benchmark runs side by side); one builds, the others wait for it and read
the result. Leaves out: locks across machines (``flock`` on a network file system may not hold)
and any check that a finished directory is still intact."""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable


def build_once(out: Path, build: Callable[[Path], None], done: str = "config.json") -> Path:
    """``out`` once ``out / done`` exists; else, under the lock file ``<out>.lock``, ``build(tmp)``
    writes a new directory ``tmp`` that is then renamed to ``out`` (so ``out`` is never half-written:
    a failed build leaves no ``out``). A process that finds the lock held waits, then returns what
    the other one built."""
    out = Path(out)
    if (out / done).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / done).exists():
            return out
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            build(tmp)
            tmp.replace(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
