"""The embedded engine: exact sampling distribution, log-probs, stop / length, determinism, weights."""
import math
import threading
import time

import pytest
import torch

from megatron_tepo.rollout.embedded import COMPILE_SESSIONS, EmbeddedEngine, sampling_log_probs
from megatron_tepo.rollout.engine import FINISH_LENGTH, FINISH_STOP, RolloutEngine
from tests.rollout.helpers import VOCAB, hf_response_log_probs, tiny_qwen3

PROMPTS = [[5, 17, 33], [9], [100, 101, 102, 103, 104, 7]]


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(seed=0)


def test_is_a_rollout_engine(model):
    assert isinstance(EmbeddedEngine(model), RolloutEngine)


def test_groups_shape_and_finish_length(model):
    eng = EmbeddedEngine(model, seed=1)
    groups = eng.generate(PROMPTS, n=3, temperature=1.0, max_new_tokens=5)
    assert len(groups) == len(PROMPTS) and all(len(g) == 3 for g in groups)
    for g in groups:
        for s in g:
            assert len(s.token_ids) == len(s.log_probs) == 5 and s.finish_reason == FINISH_LENGTH
            assert all(0 <= t < VOCAB for t in s.token_ids) and all(lp <= 0 for lp in s.log_probs)


def test_deterministic_given_seed(model):
    a = EmbeddedEngine(model, seed=3).generate(PROMPTS, n=2, max_new_tokens=6)
    b = EmbeddedEngine(model, seed=3).generate(PROMPTS, n=2, max_new_tokens=6)
    c = EmbeddedEngine(model, seed=4).generate(PROMPTS, n=2, max_new_tokens=6)
    tok = lambda gs: [s.token_ids for g in gs for s in g]
    assert tok(a) == tok(b)
    assert [s.log_probs for g in a for s in g] == [s.log_probs for g in b for s in g]
    assert tok(a) != tok(c)


def test_a_compile_in_another_thread_leaves_the_log_probs_as_they_are(model):
    """torch holds ``torch.compiler.is_compiling()`` True for every thread through a compile session
    (one global flag), and transformers decodes grouped-query attention another way then (the tiny
    Qwen3 has 4 heads over 2 KV heads): the trainer's actor compiling while the engine generated one
    step ahead gave log-probs that differed in the last bits, by timing. The engine's forwards wait
    for another thread's session to end (here: one held until the generation waits for it, or has
    finished): no forward sees the flag, and tokens, log-probs and scores are those of a generation
    with no compile anywhere. On the old engine the generation ran inside the session."""
    eng = EmbeddedEngine(model, seed=5)
    want = eng.generate(PROMPTS, n=2, max_new_tokens=6)
    want_scores = eng.score([PROMPTS[0] + [3, 4]], [len(PROMPTS[0])])
    eng.generator.manual_seed(5)
    seen = []  # is_compiling() as each forward of the engine's model saw it
    hook = eng.model.register_forward_pre_hook(lambda *_: seen.append(torch.compiler.is_compiling()))
    entered, leave, flag, got = threading.Event(), threading.Event(), [], []

    def compiling():  # what dynamo holds around every frame it compiles
        with torch.compiler._compile_session_context():
            flag.append(torch.compiler.is_compiling())
            entered.set()
            leave.wait()

    def engine():
        got.append(eng.generate(PROMPTS, n=2, max_new_tokens=6))
        got.append(eng.score([PROMPTS[0] + [3, 4]], [len(PROMPTS[0])]))

    holder = threading.Thread(target=compiling)
    holder.start()
    entered.wait()
    gen = threading.Thread(target=engine)
    gen.start()
    while gen.is_alive() and not COMPILE_SESSIONS.waiting:
        time.sleep(0.005)
    leave.set()
    gen.join()
    holder.join()
    hook.remove()
    assert flag == [True]  # (the session did hold the flag: what the engine must not see)
    assert len(seen) > 1 and not any(seen)
    assert [s.token_ids for g in got[0] for s in g] == [s.token_ids for g in want for s in g]
    assert [s.log_probs for g in got[0] for s in g] == [s.log_probs for g in want for s in g]
    assert got[1] == want_scores


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_log_probs_equal_full_forward(model, temperature):
    """Batched, left-padded, KV-cached log-probs == a full forward of each sequence, logits / T."""
    eng = EmbeddedEngine(model, seed=5, max_batch_size=4)  # 3 prompts x 2 -> two batches
    groups = eng.generate(PROMPTS, n=2, temperature=temperature, max_new_tokens=8)
    for p, g in zip(PROMPTS, groups):
        for s in g:
            ref = hf_response_log_probs(model, p + s.token_ids, len(p), temperature)
            assert torch.allclose(torch.tensor(s.log_probs), ref, atol=1e-4), (s.log_probs, ref)
            assert eng.score([p + s.token_ids], [len(p)], temperature)[0] == pytest.approx(ref.tolist(), abs=1e-5)


def test_sampling_distribution_is_softmax_over_temperature(model):
    """Empirical first-token frequencies match softmax(logits / T) (chi-square on the top tokens)."""
    T, N = 0.8, 4000
    prompt = [5, 17, 33]
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1] / T, -1)
    eng = EmbeddedEngine(model, seed=11, max_batch_size=N)
    toks = torch.tensor([s.token_ids[0] for s in eng.generate([prompt], n=N, temperature=T, max_new_tokens=1)[0]])
    counts = torch.bincount(toks, minlength=VOCAB).double()
    top = torch.argsort(probs, descending=True)[:8]
    exp = probs.double()[top] * N
    chi2 = float(((counts[top] - exp) ** 2 / exp).sum())
    assert chi2 < 30, chi2  # 8 cells: p(chi2_8 > 30) ~ 2e-4
    assert probs[top[0]] > 0.02  # the distribution is far from uniform (the test means something)


def test_top_p_nucleus_and_renormalised_log_probs():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    lp = sampling_log_probs(logits, 1.0, 0.8)
    p = torch.softmax(logits, -1)[0]  # [0.61, 0.22, 0.14, 0.03, 0.004]
    keep = torch.tensor([True, True, False, False, False])  # mass before the 3rd is 0.83 >= 0.8
    assert torch.isinf(lp[0, ~keep]).all()
    assert torch.allclose(lp[0, keep].exp(), p[keep] / p[keep].sum())
    assert torch.equal(sampling_log_probs(logits, 0.5, 1.0), torch.log_softmax(logits / 0.5, -1))


def test_top_p_samples_stay_in_nucleus(model):
    prompt, T, top_p = [5, 17, 33], 1.0, 0.5
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1:]
    ref = sampling_log_probs(logits, T, top_p)[0]
    nucleus = set(torch.nonzero(torch.isfinite(ref)).flatten().tolist())
    assert 1 < len(nucleus) < VOCAB
    g = EmbeddedEngine(model, seed=2).generate([prompt], n=200, temperature=T, top_p=top_p, max_new_tokens=1)[0]
    assert {s.token_ids[0] for s in g} <= nucleus
    for s in g:
        assert s.log_probs[0] == pytest.approx(float(ref[s.token_ids[0]]), abs=1e-5)


def test_stop_tokens(model):
    eng = EmbeddedEngine(model, seed=7)
    stop = list(range(0, VOCAB, 3))  # a third of the vocabulary stops
    groups = eng.generate(PROMPTS, n=4, max_new_tokens=12, stop_token_ids=stop)
    reasons = set()
    for g in groups:
        for s in g:
            reasons.add(s.finish_reason)
            if s.finish_reason == FINISH_STOP:
                assert s.token_ids[-1] in stop and not any(t in stop for t in s.token_ids[:-1])
            else:
                assert len(s.token_ids) == 12 and not any(t in stop for t in s.token_ids)
    assert FINISH_STOP in reasons
    lengths = {len(s.token_ids) for g in groups for s in g}
    assert len(lengths) > 1  # rows stopped at different steps


def test_update_weights_from_hf_stream(model):
    other = tiny_qwen3(seed=9)
    eng = EmbeddedEngine(tiny_qwen3(seed=0), seed=3)
    before = eng.generate(PROMPTS, n=2, max_new_tokens=6)
    eng.update_weights((n, t.clone()) for n, t in other.state_dict().items())
    after = eng.generate(PROMPTS, n=2, max_new_tokens=6)
    ref = EmbeddedEngine(other, seed=3)
    ref.generator.manual_seed(3)
    eng.generator.manual_seed(3)
    again = eng.generate(PROMPTS, n=2, max_new_tokens=6)
    want = ref.generate(PROMPTS, n=2, max_new_tokens=6)
    assert [s.token_ids for g in again for s in g] == [s.token_ids for g in want for s in g]
    assert [s.token_ids for g in before for s in g] != [s.token_ids for g in after for s in g]
    with pytest.raises(KeyError, match="unknown parameter"):
        eng.update_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        eng.update_weights([("lm_head.weight", torch.zeros(3, 3))])
    # a stream missing parameters (e.g. one pipeline stage only) is an error naming them
    partial = [(n, t.clone()) for n, t in other.state_dict().items() if ".layers.1." not in n]
    with pytest.raises(ValueError, match=r"parameters were not in the stream.*layers\.1\."):
        eng.update_weights(partial)
    # a tied model: the embedding alone covers lm_head (they share storage)
    tied = EmbeddedEngine(tiny_qwen3(seed=0, tie_word_embeddings=True), seed=3)
    tied.update_weights((n, t.clone()) for n, t in tiny_qwen3(seed=9, tie_word_embeddings=True).state_dict().items()
                        if n != "lm_head.weight")
    assert torch.equal(tied.model.lm_head.weight, tied.model.model.embed_tokens.weight)


def test_bad_arguments(model):
    eng = EmbeddedEngine(model)
    with pytest.raises(ValueError):
        eng.generate([[1]], temperature=0.0)
    with pytest.raises(ValueError):
        eng.generate([[]])
    with pytest.raises(ValueError):
        eng.generate([[VOCAB + 5]])


def _cache_deprecations(run):
    """The transformers cache deprecations ``run()`` raises: its ``FutureWarning`` (``past_key_values
    is deprecated ... Use cache instead``) and its logger's ``past_key_values/cache_params are
    deprecated`` (a ``warning_once``: its cache is cleared first, so an earlier test's use still
    counts here)."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_logger = logging.getLogger("transformers")
    hf_logging.warning_once.cache_clear()
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        hf_logger.removeHandler(handler)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in records]
    return [m for m in said if "past_key_values" in m or "cache_params" in m or "deprecated" in m]


def test_generation_uses_the_cache_argument_of_the_installed_transformers(model):
    """transformers 5.24 takes the KV cache as ``cache`` (``past_key_values`` deprecated, removed in
    5.40); 4.x and 5.19 as ``past_key_values``. The engine asks the forward's signature and says
    nothing deprecated."""
    import inspect

    from megatron_tepo.rollout.embedded import cache_argument

    takes = inspect.signature(type(model).forward).parameters
    assert cache_argument(model) == ("cache" if "cache" in takes else "past_key_values")
    eng = EmbeddedEngine(model, seed=1)
    assert _cache_deprecations(lambda: eng.generate(PROMPTS, n=2, max_new_tokens=4)) == []


class _PastKeyValuesModel(torch.nn.Module):
    """A model of the older API (transformers 4.x, 5.19): the cache in and out as ``past_key_values``,
    around a model of the installed transformers."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.cache_name = "cache" if "cache" in __import__("inspect").signature(type(inner).forward).parameters \
            else "past_key_values"
        self.calls = []

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None):
        from types import SimpleNamespace

        self.calls.append(past_key_values is not None)
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=use_cache, **{self.cache_name: past_key_values})
        return SimpleNamespace(logits=out.logits, past_key_values=getattr(out, self.cache_name))


def test_generation_with_the_older_past_key_values_api_is_the_same(model):
    from megatron_tepo.rollout.embedded import cache_argument

    old = _PastKeyValuesModel(model)
    assert cache_argument(old) == "past_key_values"
    a = EmbeddedEngine(old, seed=7).generate(PROMPTS, n=2, max_new_tokens=6)
    b = EmbeddedEngine(model, seed=7).generate(PROMPTS, n=2, max_new_tokens=6)
    assert old.calls[0] is False and all(old.calls[1:])  # the prefill, then the cache handed back each step
    assert [(s.token_ids, s.log_probs) for g in a for s in g] == [(s.token_ids, s.log_probs) for g in b for s in g]
