"""Each choice list once (issue #33): every ``Literal`` choice of the run config that names what a
registry or a tuple of the code knows equals that registry, so the two cannot drift apart (the
config's ``kl_estimator`` had lost ``abs``, which ``algorithms.KL_ESTIMATORS`` holds)."""
import typing

import pytest

from megatron_tepo import algorithms as A
from megatron_tepo import config as C


def _choices(cls, name):
    tp = typing.get_type_hints(cls)[name]
    if typing.get_origin(tp) is typing.Union:  # Optional[Literal[...]]
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    assert typing.get_origin(tp) is typing.Literal, (cls.__name__, name, tp)
    return set(typing.get_args(tp))


def _engines():
    from megatron_tepo.rollout.registry import ENGINE_MODULES

    return set(ENGINE_MODULES)


def _sync_modes():
    from megatron_tepo.rollout.sglang.weight_sync import MODES

    return set(MODES)


def _attentions():
    from megatron_tepo.megatron.spec import ATTENTIONS

    return set(ATTENTIONS) | {"auto"}


def _replay_modes():
    from megatron_tepo.megatron.routing_replay import REPLAY_MODES

    return set(REPLAY_MODES)


def _packed_modes():
    from megatron_tepo.megatron.attention import PACKED_MODES

    return set(PACKED_MODES) | {"auto"}


def _environments():
    from megatron_tepo.environments.choice import ENVIRONMENTS

    return set(ENVIRONMENTS) | {"none"}


def _tool_formats():
    from megatron_tepo.environments.python_tool import FORMATS

    return set(FORMATS)


@pytest.mark.parametrize("cls, name, registry", [
    (C.EnvironmentConfig, "name", _environments),
    (C.EnvironmentConfig, "format", _tool_formats),
    (C.AlgorithmConfig, "kl_estimator", lambda: set(A.KL_ESTIMATORS)),
    (C.AlgorithmConfig, "kl_mask", lambda: set(A.KL_MASKS)),
    (C.AlgorithmConfig, "agg", lambda: set(A.AGG_MODES)),
    (C.AlgorithmConfig, "delta_entropy", lambda: set(A.DELTA_ENTROPY_MODES)),
    (C.RolloutCorrectionConfig, "rollout_is", lambda: set(A.CORRECTION_LEVELS)),
    (C.RolloutCorrectionConfig, "rollout_rs", lambda: set(A.CORRECTION_LEVELS)),
    (C.ActorConfig, "offload", lambda: set(C.OFFLOAD_LEVELS) | {"auto"}),
    (C.RolloutConfig, "engine", _engines),
    (C.RolloutConfig, "sync_mode", _sync_modes),
    (C.ActorConfig, "attention", _attentions),
    (C.ActorConfig, "packed_attention", _packed_modes),
    (C.ActorConfig, "routing_replay", _replay_modes),
])
def test_a_config_choice_list_is_its_registry(cls, name, registry):
    assert _choices(cls, name) == registry()


def test_the_loss_is_checked_against_the_loss_registry():
    with pytest.raises(C.ConfigError, match="algorithm.loss: unknown loss 'nope'; valid: cispo"):
        C.from_dict({"algorithm": {"loss": "nope"}})
    for name in A.POLICY_LOSSES:
        assert C.from_dict({"algorithm": {"loss": name}}).algorithm.loss == name


@pytest.mark.parametrize("section, message", [
    ({"parallel": {"cp": 2}, "actor": {"pack_sequences": False}},
     "parallel.cp: context parallelism splits packed sequences: needs actor.pack_sequences=true, got 2"),
    ({"actor": {"sequence_parallel": True}}, "actor.sequence_parallel: needs parallel.tp > 1"),
])
def test_the_config_asks_the_layout_rules_and_names_the_field(section, message):
    """Each rule once (#33): the config's layout errors are ``validate_layout``'s own rules, told in
    the config's ``field: why`` style; the layout's message for the same rule stays its own."""
    from megatron_tepo.layout import LayoutError, ParallelLayout, validate_layout

    with pytest.raises(C.ConfigError) as err:
        C.from_dict(section)
    assert str(err.value).endswith(message), str(err.value)
    layout = ParallelLayout(**section.get("parallel", {}))
    with pytest.raises(LayoutError) as err:
        validate_layout(layout, None, None, sequence_parallel=bool(section.get("actor", {}).get("sequence_parallel")),
                        pack_sequences=section.get("actor", {}).get("pack_sequences", True))
    assert [field for field, _ in err.value.problems] == [message.split(":")[0]]
