"""The embedded engine in colocated mode (issue #34): ``release_memory`` frees its weights' memory,
it refuses to generate until its memory is back and a weight update has ended, and then it
generates exactly what it did before (same weights, same seed). Loaded from a model folder, as the
trainer loads it (a memory-mapped checkpoint must not pin the weights)."""
import pytest
import torch

from megatron_tepo.rollout.embedded import EmbeddedEngine
from megatron_tepo.rollout.engine import MEMORY_TAGS

PROMPTS = [[5, 7, 3], [9, 4]]


def _tokens(groups):
    return [s.token_ids for g in groups for s in g]


def test_release_frees_the_weights_and_generation_waits_for_the_update(tiny):
    engine = EmbeddedEngine(str(tiny / "model"), dtype=torch.float32, seed=3)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.generator.manual_seed(3)
    before = engine.generate(PROMPTS, n=2, max_new_tokens=4)

    engine.release_memory(MEMORY_TAGS)
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    engine.release_memory(MEMORY_TAGS)  # again: nothing changes
    with pytest.raises(RuntimeError, match="its cuda_graph, kv_cache, weights released"):
        engine.generate(PROMPTS, n=1, max_new_tokens=2)

    engine.resume_memory(("weights",))
    assert all(p.untyped_storage().nbytes() > 0 for p in engine.model.parameters())
    engine.resume_memory(("kv_cache", "cuda_graph"))
    with pytest.raises(RuntimeError, match="weights taken back but not updated yet"):
        engine.generate(PROMPTS, n=1, max_new_tokens=2)

    engine.update_weights(weights.items())
    engine.generator.manual_seed(3)
    assert _tokens(engine.generate(PROMPTS, n=2, max_new_tokens=4)) == _tokens(before)
    with pytest.raises(ValueError, match=r"unknown memory tag\(s\) \['activations'\]"):
        engine.release_memory(("activations",))
