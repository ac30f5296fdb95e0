"""Reward functions for the pool tests (top level, so spawn workers can import them)."""
import time


def sleepy(response: str, answer: str):
    """Hangs on responses that ask for it, like a pathological expression in sympy would."""
    if response.startswith("hang"):
        time.sleep(60)
    return (1.0 if response == answer else 0.0), "ok"


def raising(response: str, answer: str):
    raise RuntimeError("checker crashed")
