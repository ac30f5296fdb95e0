"""Performance-critical ops: vocab-parallel log-probs and entropy (torch.distributed only)."""
from megatron_tepo.ops.vocab_parallel import default_chunk_size, vocab_parallel_log_probs_and_entropy

__all__ = ["default_chunk_size", "vocab_parallel_log_probs_and_entropy"]
