"""#52 item 3: model tokens are trained and environment tokens are not. On two-turn episodes (a model
turn, the environment's answer, a model turn) made into a batch from their samples' loss masks, the
actor's TEPO loss (sequence ratio over the model's tokens, selective KL) and GRPO/DAPO loss (token
ratio, clip-higher, dual clip), and every gradient, equal the formulas written out here by hand on
the Hugging Face model's log-probs: the environment's tokens are read as context and count nowhere
(not in a ratio, not in a mean, not in the KL mask). One process, fp32."""
import math

import pytest
import torch

from megatron_tepo.algorithms import PolicyLoss
from megatron_tepo.batch import RolloutBatch
from megatron_tepo.config import AlgorithmConfig
from megatron_tepo.rollout.engine import Sample
from tests.megatron.helpers import checkpoint_names, hf_log_probs, hf_state, make_hf_model, max_rel_err, tiny_hf_config


def _episodes(vocab: int):
    """Three samples of two prompts: two episodes of two turns (model, environment, model) and one of
    one turn; the environment's tokens have log-prob 0 and mask 0."""
    g = torch.Generator().manual_seed(3)

    def toks(n):
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    def episode(a, b, c):
        return Sample(toks(a + b + c), [-1.0] * a + [0.0] * b + [-1.0] * c, "stop", loss_mask=[1] * a + [0] * b + [1] * c)

    prompts = [toks(4), toks(6)]
    groups = [[episode(5, 4, 3), episode(2, 6, 4)], [Sample(toks(7), [-1.0] * 7, "stop")]]
    return prompts, groups


def _by_hand(name, lp, ent, old_lp, old_ent, adv, mask, kl_coef):
    """The loss, written out (fp64): token-mean over the model's tokens only."""
    lp, ent, old_lp, old_ent, adv = (t.double() for t in (lp, ent, old_lp, old_ent, adv))
    m = mask.double()
    n = m.sum()
    if name == "tepo":  # w_i = exp(mean over the model's tokens of l - lo), clip 0.01 / 0.014
        log_w = ((lp - old_lp) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        w = torch.exp(log_w.clamp(-20, 20)).expand_as(lp)
        per = -torch.minimum(w * adv, torch.clamp(w, 1 - 0.01, 1 + 0.014) * adv)
    else:  # grpo: r = exp(l - lo), max(-A r, -A clip(r, 0.8, 1.28)); A < 0: min(that, -3 A)
        r = torch.exp((lp - old_lp).clamp(-20, 20))
        per = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - 0.2, 1 + 0.28))
        per = torch.where(adv < 0, torch.minimum(per, -3.0 * adv), per)
    loss = (per * m).sum() / n
    if kl_coef:  # TEPO's selective KL: k3 against the old policy where A > 0 and the entropy fell
        d = (old_lp - lp).clamp(-20, 20)
        k3 = torch.exp(d) - d - 1
        sel = ((adv > 0) & ((ent - old_ent).detach() < 0) & (m > 0)).double()
        loss = loss + kl_coef * (k3 * sel).sum() / n
    return loss


@pytest.fixture
def in_this_process():
    """The actor is built in pytest's own process (no worker): its gloo group, megatron's parallel
    state and the rendezvous variables (``single_process_env``: RANK, WORLD_SIZE, MASTER_PORT, ...)
    are undone after, so a later test in the process, or a process it starts, finds none
    (test_side_inputs checks that settings are refused before any group; the converters start their
    own, in-process or not)."""
    import os

    env = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(env)
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name,kl_coef", [("tepo", 0.05), ("grpo", 0.0)])
def test_the_loss_and_gradients_of_two_turn_episodes_equal_the_formula_by_hand(name, kl_coef, in_this_process):
    from megatron_tepo.actor import MegatronActor
    from megatron_tepo.megatron.parallel import single_process_env

    single_process_env()
    cfg = tiny_hf_config("qwen3")
    model = make_hf_model(cfg, seed=0).float()
    actor = MegatronActor(cfg, hf_state(model), precision="fp32", attention="sdpa")
    prompts, groups = _episodes(cfg.vocab_size)
    adv = torch.tensor([1.0, -0.5, 0.75])
    batch = RolloutBatch.from_groups(prompts, groups, pad_id=0, advantages=adv)
    mask = batch.response_mask
    assert mask[0].tolist()[:12] == [1] * 5 + [0] * 4 + [1] * 3  # the environment's tokens: not trained
    with torch.no_grad():
        ref_lp, ref_ent = hf_log_probs(model, batch)
    g = torch.Generator().manual_seed(5)
    batch.old_log_probs = (ref_lp + 0.05 * torch.randn(ref_lp.shape, generator=g)) * mask
    batch.old_entropy = (ref_ent + 0.2 * torch.randn(ref_ent.shape, generator=g)) * mask
    # the environment's slots hold garbage the loss must never read (the engine's log-prob there is 0)
    env = (mask == 0) & (torch.arange(mask.shape[1]) < torch.tensor([12, 12, 0])[:, None])
    batch.old_log_probs[env], batch.old_entropy[env], batch.advantages[env] = 50.0, 50.0, -7.0

    metrics = actor.forward_backward(batch, PolicyLoss.from_config(AlgorithmConfig(loss=name, kl_coef=kl_coef)))
    grads = dict(actor.export_hf_state("grad"))

    model.zero_grad(set_to_none=True)
    lp, ent = hf_log_probs(model, batch)
    loss = _by_hand(name, lp, ent, batch.old_log_probs, batch.old_entropy, batch.advantages, mask, kl_coef)
    loss.backward()
    ref_grads = checkpoint_names({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    loss = loss.detach()
    assert math.isfinite(metrics["loss"]) and abs(float(loss)) > 1e-4
    assert abs(metrics["loss"] - float(loss)) <= 1e-6 * abs(float(loss)) + 1e-9, (metrics["loss"], float(loss))
    errs = {n: max_rel_err(grads[n], ref_grads[n]) for n in ref_grads}
    assert max(errs.values()) < 1e-4, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    if kl_coef:
        assert metrics["kl_mask_frac"] > 0  # (the selective KL acts on some model token)
