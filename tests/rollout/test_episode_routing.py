"""MoE routing replay ``r3`` with multi-turn episodes (#58 item 3): the episode engine keeps the
routing its engine returned for the final turn's request, whose input is the whole episode so far
(the prompt, the earlier turns, the environment's answers), and the episode's sample carries it as
a one-turn sample does (``[prompt + response - 1, moe_layers, topk]``).

On the embedded engine and a tiny Qwen3-MoE, episodes of three turns with two answers: the routing
equals the experts a plain forward of the whole sequence chooses, wherever its router has no near
tie (the single-turn test's rule, ``test_embedded_routing.py``), the earlier turns' and the answers'
positions included; and the model with its routers forced to that routing scores the model's tokens
at the episode's own log-probs (fp32: within the single-turn run's 1e-4, ``test_routing_replay_run.py``),
while a shuffled routing moves them (the comparison could fail). On the SGLang fleet (stand-in
servers that route by position): every turn asks for its routing and the episode's sample carries
the final turn's, whole."""
import sys
from pathlib import Path

import pytest
import torch

from megatron_tepo.batch import RolloutBatch
from megatron_tepo.environments import Environment, Reply
from megatron_tepo.rollout.embedded import EmbeddedEngine
from megatron_tepo.rollout.episode import EpisodeEngine, EpisodeLimits, TurnFormat
from megatron_tepo.routing import RoutingShape
from tests.megatron.helpers import make_hf_model, tiny_hf_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "tiny_tir"))
import tir  # noqa: E402

LAYERS, TOPK, EXPERTS = 3, 2, 8
SHAPE = RoutingShape(LAYERS, tuple(range(LAYERS)), TOPK, EXPERTS)
TOK = tir.hf_tokenizer()
PROMPTS = [tir.prompt_ids(TOK, "37*45"), tir.prompt_ids(TOK, "12*3")]


class ThreeTurns(Environment):
    """Answers the first two turns (whatever they say), ends the episode at the third."""
    name = "three-turns"

    def respond(self, turn, turn_index):
        return Reply(done=True) if turn_index >= 2 else Reply(done=False, message="1665")


@pytest.fixture(scope="module")
def moe():
    cfg = tiny_hf_config("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=TOPK, num_hidden_layers=LAYERS,
                         vocab_size=tir.VOCAB)  # (the tokenizer's ids: the environment reads the turns' text)
    return make_hf_model(cfg, seed=3).eval()


def _routers(model, forced=None, topk=TOPK):
    """Hooks on every router: each records its top-k and the gap between its k-th and k+1-th logit
    (``seen``); with ``forced`` (``[T - 1, layers, k]``) its top-k is replaced by those experts, the
    weights from its own logits as megatron's replay takes them."""
    seen, handles = [], []
    for layer, block in enumerate(model.model.layers):
        def hook(module, args, output, layer=layer):
            logits, weights, ids = output
            top = logits.float().topk(topk + 1, dim=-1).values
            seen.append((ids.sort(-1).values, top[:, topk - 1] - top[:, topk]))
            if forced is None:
                return None
            n = min(len(forced), logits.shape[0])  # (the last position has none: the router's own)
            ids = torch.cat([forced[:n, layer].long(), ids[n:]])
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
            return logits, (probs / probs.sum(-1, keepdim=True)).to(logits.dtype), ids  # norm_topk_prob
        handles.append(block.mlp.gate.register_forward_hook(hook))
    return seen, handles


def _forward(model, seq, forced=None, topk=TOPK):
    """Log-probs of ``seq[1:]`` in one forward of ``seq``, each router's top-k ``[T, layers, k]``
    and its gap ``[T, layers]``."""
    seen, handles = _routers(model, forced, topk)
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    finally:
        for h in handles:
            h.remove()
    lps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
    return lps, torch.stack([s[0] for s in seen], 1), torch.stack([s[1] for s in seen], 1)


def test_an_episodes_routing_is_the_whole_sequences_and_forcing_it_reproduces_its_log_probs(moe):
    hooks = [len(layer.mlp.gate._forward_hooks) for layer in moe.model.layers]
    inner = EmbeddedEngine(moe, seed=1, routing=SHAPE, pad_token_id=tir.PAD)
    engine = EpisodeEngine(inner, ThreeTurns(), TurnFormat(TOK, tir.EOS), EpisodeLimits(max_turns=3, max_turn_tokens=4))
    try:
        groups = engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=80, stop_token_ids=[tir.EOS])
    finally:
        engine.close()  # (the engine's hooks go with it)
    assert [len(layer.mlp.gate._forward_hooks) for layer in moe.model.layers] == hooks
    checked = {"prompt": 0, "earlier turns": 0, "answers": 0, "final turn": 0}
    for prompt, group in zip(PROMPTS, groups):
        for s in group:
            assert s.meta["episode"]["turns"] == 3 and s.meta["episode"]["end"] in ("answered", "turn_cap"), s.meta
            seq = prompt + s.token_ids
            assert s.routed_experts.shape == (len(seq) - 1, LAYERS, TOPK) and s.routed_experts.dtype == torch.int8
            # the routing a plain forward of the whole sequence chooses, but for near ties
            free_lps, ref, gap = _forward(moe, seq)
            clear = gap[:-1] > 1e-4
            got = s.routed_experts.long().sort(-1).values
            assert torch.equal(got[clear], ref[:-1][clear])
            # which part of the sequence each checked position is: the answers (mask 0) and the model's
            # turns before the last answer count as much as the final turn
            mask = torch.tensor([1] * len(prompt) + s.loss_mask)[:-1]
            last_answer = len(prompt) + max(i for i, m in enumerate(s.loss_mask) if not m)
            part = torch.full((len(seq) - 1,), 3)
            part[:len(prompt)], part[len(prompt):last_answer + 1] = 0, 1
            part[(mask == 0)] = 2
            for k, name in enumerate(checked):
                checked[name] += int(clear[part == k].sum())
            # the model with its routers forced to the episode's routing scores the model's tokens as the
            # engine did (the actor's replay is that forcing: tests/megatron/test_routing_replay.py)
            own = torch.tensor(s.loss_mask, dtype=torch.bool)
            forced_lps, _, _ = _forward(moe, seq, forced=s.routed_experts)
            engine_lps = torch.tensor(s.log_probs)
            assert float((forced_lps[len(prompt) - 1:][own] - engine_lps[own]).abs().max()) < 1e-4
            shuffled = (s.routed_experts.long() + 1) % EXPERTS  # other experts: forcing them must show
            moved, _, _ = _forward(moe, seq, forced=shuffled)
            assert float((moved[len(prompt) - 1:][own] - engine_lps[own]).abs().max()) > 1e-3
    # (a final turn is at most 4 tokens, its last never run: the single-turn tests check the decode's)
    assert min(checked[k] for k in ("prompt", "earlier turns", "answers")) > 20, checked
    batch = RolloutBatch.from_groups(PROMPTS, groups, pad_id=tir.PAD)  # (the trainer's batch carries it)
    for row, s in enumerate(s for g in groups for s in g):
        n = len(PROMPTS[row // 2]) + len(s.token_ids) - 1
        assert torch.equal(batch.routed_experts[row, :n], s.routed_experts)
        assert int(batch.routed_experts[row, n:].max()) == -1


def test_the_fleets_episode_turns_ask_for_routing_and_the_sample_carries_the_final_turns():
    """Stand-in servers answer each request with two tokens (``length``) and the experts of each
    position of its input and output (a function of the position): a turn is cut at its cap of 2,
    the environment answers twice, the third turn ends the episode."""
    from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
    from tests.rollout.fake_sglang import FakeSGLang, routed_experts_ids

    shape = RoutingShape(4, (0, 2, 3), 2, 8)
    fakes = [FakeSGLang(routing=(4, 2, 8)), FakeSGLang(routing=(4, 2, 8))]
    fleet = SGLangFleet(FleetConfig(urls=[f.url for f in fakes], router="none", request_timeout=30, step_timeout=60,
                                    probe_interval=0.2, probe_timeout=1.0, routing=shape, routing_decoders=1))
    engine = EpisodeEngine(fleet, ThreeTurns(), TurnFormat(TOK, tir.EOS), EpisodeLimits(max_turns=3, max_turn_tokens=2))
    try:
        groups = engine.generate(PROMPTS, n=2, max_new_tokens=100, stop_token_ids=[tir.EOS])
    finally:
        engine.close()
        for f in fakes:
            f.close()
    bodies = [b for f in fakes for b in f.bodies("/generate")]
    assert len(bodies) == 4 * 3  # every turn of every episode, each asking for its routing
    assert all(b["return_routed_experts"] is True and b["routed_experts_start_len"] == 0 for b in bodies)
    for prompt, group in zip(PROMPTS, groups):
        for s in group:
            assert s.meta["episode"]["turns"] == 3 and s.loss_mask.count(0) > 0, s.meta
            positions = len(prompt) + len(s.token_ids) - 1  # the final turn's input: the whole episode
            want = torch.from_numpy(routed_experts_ids(positions, 4, 2, 8)[:, [0, 2, 3]]).long()
            assert torch.equal(s.routed_experts.long(), want)
