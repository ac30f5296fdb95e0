"""Reward functions for the pool tests (top level, so spawn workers can import them)."""
import time


def sleepy(response: str, answer: str):
    """Hangs on responses that ask for it, like a pathological expression in sympy would."""
    if response.startswith("hang"):
        time.sleep(60)
    return (1.0 if response == answer else 0.0), "ok"


def raising(response: str, answer: str):
    raise RuntimeError("checker crashed")


_started = False


def _start():
    global _started
    if not _started:
        _started = True
        time.sleep(3.5)


def slow_start(response: str, answer: str):
    """``sleepy`` in a worker that pays a 3.5 s start before its first answer (math-verify's import
    and parser set-up on a loaded machine), done by ``warm_up`` when the pool calls it."""
    _start()
    return sleepy(response, answer)


slow_start.warm_up = _start
