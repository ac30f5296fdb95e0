"""``RolloutBatch.routed_experts`` (MoE routing replay, issue 41): one entry per position of
``input_ids`` and MoE layer, carried through ``select``, ``split_for_data_parallel`` and
``padded`` like every per-position field, built by ``from_groups`` from the engines' samples; and
the config's ``actor.routing_replay`` rules. Pure torch."""
import dataclasses

import pytest
import torch

from megatron_tepo.batch import RolloutBatch
from megatron_tepo.routing import routing_dtype
from megatron_tepo.config import ConfigError, load_config
from megatron_tepo.rollout.engine import Sample


def _batch(rows=5, length=9, layers=3, topk=2):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (rows, length), generator=g)
    mask = torch.ones(rows, 4)
    routed = torch.randint(0, 8, (rows, length, layers, topk), generator=g).to(torch.int8)
    return RolloutBatch(input_ids=ids, prompt_lens=torch.full((rows,), 3), response_mask=mask, routed_experts=routed)


def test_routing_dtype_is_the_smallest_that_holds_the_ids():
    assert routing_dtype(8) == torch.int8
    assert routing_dtype(128) == torch.int8  # Qwen3-30B-A3B: ids 0..127
    assert routing_dtype(129) == torch.int16
    assert routing_dtype(40000) == torch.int32
    with pytest.raises(ValueError):
        routing_dtype(0)


def test_select_split_and_padded_carry_the_routing():
    b = _batch()
    sel = b.select([3, 1], max_len=6)
    assert torch.equal(sel.routed_experts, b.routed_experts[[3, 1], :6])
    share = b.split_for_data_parallel(1, 2)
    assert torch.equal(share.routed_experts, b.routed_experts[1::2])
    grown = b.padded(7, 12)
    assert grown.routed_experts.shape == (7, 12, 3, 2) and grown.routed_experts.dtype == torch.int8
    assert torch.equal(grown.routed_experts[:5, :9], b.routed_experts)
    assert int(grown.routed_experts[5:].max()) == -1 and int(grown.routed_experts[:, 9:].max()) == -1


def test_bad_routing_is_refused_naming_the_field():
    b = _batch()
    with pytest.raises(ValueError, match=r"^routed_experts must be \[B, L, moe_layers, topk\]"):
        dataclasses.replace(b, routed_experts=b.routed_experts[:, :4])
    with pytest.raises(ValueError, match=r"^routed_experts must be a signed integer tensor"):
        dataclasses.replace(b, routed_experts=b.routed_experts.float())


def test_from_groups_builds_the_routing_from_the_samples():
    def sample(n_resp, first):
        routed = torch.arange(first, first + 2 * 2).reshape(1, 2, 2).repeat(n_resp + 1, 1, 1).to(torch.int8)
        return Sample(list(range(n_resp)), [-0.1] * n_resp, "stop", routed_experts=routed)

    prompts = [[1, 2], [3]]
    groups = [[sample(3, 0)], [sample(1, 4)]]  # positions: 2 + 3 - 1 = 4 and 1 + 1 - 1 = 1
    b = RolloutBatch.from_groups(prompts, groups, pad_id=0)
    assert b.routed_experts.shape == (2, 5, 2, 2) and b.routed_experts.dtype == torch.int8
    assert b.routed_experts[0, :4].tolist() == [[[0, 1], [2, 3]]] * 4
    assert int(b.routed_experts[0, 4].max()) == -1  # the last token: never run by the engine
    assert b.routed_experts[1, :2].tolist() == [[[4, 5], [6, 7]]] * 2 and int(b.routed_experts[1, 2:].max()) == -1
    plain = Sample([1], [-0.1], "stop")
    assert RolloutBatch.from_groups(prompts, [[plain], [plain]], pad_id=0).routed_experts is None
    with pytest.raises(ValueError, match=r"^routed_experts: sample 1 of 2 carries none"):
        RolloutBatch.from_groups(prompts, [[sample(3, 0)], [plain]], pad_id=0)
    with pytest.raises(ValueError, match=r"^routed_experts must be \[positions, moe_layers, topk\]"):
        Sample([1], [-0.1], "stop", routed_experts=torch.zeros(2, 2, dtype=torch.int8))


def test_config_routing_replay_rules():
    assert load_config(None, []).actor.routing_replay == "off"
    assert load_config(None, ["actor.routing_replay=r3"]).actor.routing_replay == "r3"
    with pytest.raises(ConfigError, match="actor.routing_replay"):
        load_config(None, ["actor.routing_replay=r4"])
    # both engines return routing (the SGLang fleet asks its servers: rollout/sglang/routing.py); an
    # engine that did not would be refused in one line
    assert load_config(None, ["actor.routing_replay=r3", "rollout.engine=sglang"]).actor.routing_replay == "r3"
    from megatron_tepo.config import validation

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(validation, "ROUTING_ENGINES", ("embedded",))
        with pytest.raises(ConfigError, match=r"^actor.routing_replay: r3 replays the engine's routing, which "
                                              r"rollout.engine 'sglang' does not return"):
            load_config(None, ["actor.routing_replay=r3", "rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=r"^actor.routing_replay: r2 records the routing in the actor's "
                                          r"old-log-prob pass, which algorithm.old_log_prob: rollout skips"):
        load_config(None, ["actor.routing_replay=r2", "algorithm.old_log_prob=rollout"])
    assert load_config(None, ["actor.routing_replay=r2", "rollout.engine=sglang"]).actor.routing_replay == "r2"


def test_a_bare_off_in_yaml_is_the_choice_off(tmp_path):
    """YAML 1.1 reads ``off`` / ``on`` as booleans: a choice list holding them takes them back."""
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  routing_replay: off\n  fusions: on\n")
    cfg = load_config(path, ["actor.routing_replay=off"])
    assert cfg.actor.routing_replay == "off" and cfg.actor.fusions == "on"
    with pytest.raises(ConfigError, match="actor.routing_replay"):
        load_config(None, ["actor.routing_replay=on"])  # no "on" among its choices


@pytest.mark.parametrize("env", ["python", "guess_number"])
def test_r3_with_episodes_is_accepted_and_refused_with_partial_rollout_naming_the_field(env):
    """#58 item 3: a multi-turn episode's final turn is one request over the whole sequence, so r3
    works with an environment (before: refused, ``environment.name: ... prefills without returning
    their routing``) under the synchronous and one-step-off schedules, on both engines; under partial
    rollout an interrupted turn's routing is not returned, so r3 stays refused there, naming the field."""
    for extra in ([], ["rollout.max_staleness=1"], ["rollout.engine=sglang"]):
        cfg = load_config(None, ["actor.routing_replay=r3", f"environment.name={env}", *extra])
        assert cfg.actor.routing_replay == "r3" and cfg.environment.name == env
    with pytest.raises(ConfigError, match=r"^rollout.partial_rollout: an interrupted request's routing is not returned "
                                          r"\(a multi-turn episode's turn included\), which actor.routing_replay: r3"):
        load_config(None, ["actor.routing_replay=r3", f"environment.name={env}", "rollout.partial_rollout=true"])
