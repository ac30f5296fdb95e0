"""The trainer's policy is a declared type (``trainer/policy.py:Policy``): the Megatron actor and
every fake the trainer's tests hand to ``train()`` or its phases implement all of it, each verb with
a signature that takes the trainer's calls."""
import inspect
import sys
import typing
from pathlib import Path

import pytest

from megatron_tepo.trainer.policy import Policy, build_policy

ROOT = Path(__file__).resolve().parents[2]


def _members():
    """The protocol's verbs and attributes, by name."""
    names = {n for n in Policy.__dict__ if not n.startswith("_")} | set(typing.get_type_hints(Policy))
    return sorted(names)


def _check(cls):
    missing = [n for n in _members() if not hasattr(cls, n) and n not in getattr(cls, "__annotations__", {})]
    assert missing == [], f"{cls.__name__} lacks {missing}"
    for name in _members():
        want = Policy.__dict__.get(name)
        if not inspect.isfunction(want):
            continue
        got = inspect.signature(getattr(cls, name))
        for p in list(inspect.signature(want).parameters.values())[1:]:  # every argument the trainer may pass
            assert p.name in got.parameters or any(q.kind == q.VAR_KEYWORD for q in got.parameters.values()), \
                f"{cls.__name__}.{name} takes no {p.name!r}"


def _fakes():
    sys.path.insert(0, str(ROOT / "tests" / "trainer"))
    from tests.fakes import FakePolicy
    from tests.trainer.test_no_update_stop import NanActor
    from tests.trainer.memory_phases_worker import Actor as MemoryPhasesActor

    return [FakePolicy, NanActor, MemoryPhasesActor]


def test_the_megatron_actor_implements_the_policy():
    from megatron_tepo.actor import MegatronActor

    _check(MegatronActor)


@pytest.mark.parametrize("index", range(3))
def test_every_fake_implements_the_policy(index):
    cls = _fakes()[index]
    _check(cls)
    assert isinstance(cls.__new__(cls), Policy) or issubclass(cls, _fakes()[0])


def test_a_fake_that_lacks_a_verb_is_found():
    class Partial:
        dp_rank, dp_size = 0, 1

        def forward_backward(self, batch, loss):
            return {}

    with pytest.raises(AssertionError, match="lacks"):
        _check(Partial)


def test_an_unknown_backend_is_one_line():
    with pytest.raises(ValueError, match="policy backend 'jax': expected one of \\['megatron'\\]"):
        build_policy("jax", None, "")
