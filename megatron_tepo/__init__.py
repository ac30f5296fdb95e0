"""megatron_tepo: TEPO and its baselines on a Megatron-core actor with SGLang rollouts.

Subpackages (dependencies point one way, top to bottom):
- ``algorithms``: losses, advantages, aggregation, KL estimators. Pure PyTorch.
- ``ops``: the vocab-parallel log-prob/entropy kernel (torch.distributed only).
- ``models``: per model family, HF config -> Megatron config and the HF <-> Megatron weight mapping.
- ``megatron``: megatron-core glue, including the CPU work-arounds (applied only without CUDA).
- ``actor``: the Megatron actor (old log-probs, train step) composing the above.
"""
__version__ = "0.1.0"
