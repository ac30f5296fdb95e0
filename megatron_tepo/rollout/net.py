"""``free_port`` and ``ephemeral_range`` under the rollout package's name: they live in
:mod:`megatron_tepo.net` (engine-neutral, standard library only); this name keeps working for code
that imports them from here."""
from megatron_tepo.net import ephemeral_range, free_port

__all__ = ["free_port", "ephemeral_range"]
