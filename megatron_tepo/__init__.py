"""megatron_tepo: TEPO and its baselines on a Megatron-core actor with SGLang rollouts.

Subpackages (dependencies point one way, top to bottom):
- ``algorithms``: losses, advantages, aggregation, KL estimators. Pure PyTorch.
- ``ops``: the vocab-parallel log-prob/entropy kernel (torch.distributed only).
- ``models``: per model family, HF config -> Megatron config and the HF <-> Megatron weight mapping.
- ``megatron``: megatron-core glue, including the CPU work-arounds (applied only without CUDA).
- ``actor``: the Megatron actor (old log-probs, train step) composing the above.
"""
__version__ = "0.1.0"

import warnings as _warnings

#: The warnings of the libraries underneath that a user can do nothing about: (message regex,
#: category, issuing-module regex, why). :func:`filter_known_library_warnings` silences exactly these,
#: each by its message and the module that issues it, so that every other warning -- a library's new
#: one, or this package's own -- still shows. It runs here, when ``megatron_tepo`` is imported, before
#: it imports megatron-core (which warns at import); here rather than in a module of its own so that
#: importing a subpackage (``algorithms``, ``rollout``) loads no sibling. Left out: what Python hides
#: by default (``DeprecationWarning`` outside ``__main__``), and progress bars.
KNOWN_LIBRARY_WARNINGS = (
    (r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning, r"megatron\.core\.",
     "megatron-core at import, four times, without TE and Apex: the CPU install has neither, on purpose"),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.core\.",
     "megatron-core at import, twice, without Apex: the local layer spec uses torch's norms"),
    (r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load` instead\.",
     FutureWarning, r"megatron\.core\.dist_checkpointing\.",
     "PyTorch about megatron-core's own call when a torch_dist checkpoint loads (megatron-core < 0.19)"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor\.", FutureWarning,
     r"torch\.distributed\.checkpoint\.",
     "PyTorch's checkpoint planner on the ShardedTensors megatron-core's dist_checkpointing is built on"),
)


def filter_known_library_warnings() -> None:
    """Ignore exactly :data:`KNOWN_LIBRARY_WARNINGS` (idempotent)."""
    for message, category, module, _why in KNOWN_LIBRARY_WARNINGS:
        _warnings.filterwarnings("ignore", message=message, category=category, module=module)


filter_known_library_warnings()
