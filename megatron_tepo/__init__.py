"""megatron_tepo: TEPO and its baselines on a Megatron-core actor with SGLang rollouts.

Subpackages and modules, from the top floor down (imports point down; docs/ARCHITECTURE.md draws
the rooms and tests/test_layers.py holds the seams):
- ``commands``, ``cli``: the ``mtepo-*`` commands (train, convert, evaluate, plot, fit check).
- ``trainer``: the RL loop (``train()``: a step's phases), its policy protocol, the one group producer
  (``groups``) and its scoring (``scoring``), the schedules' rollout sources.
- ``launch``: the launch file, the fit check, the Slurm and nemo-run job steps.
- ``actor``: the Megatron actor: the RL verbs (log-probs, train step), export, checkpoints.
- ``checkpoint``: HF and Megatron checkpoint files, the converters, the checkpoint store.
- ``megatron``: megatron-core's one home: the actor settings resolved (``resolve``), a family config in
  megatron's words (``family_kwargs``), the model stack (GPTModel, HybridModel), parallel state,
  sharding, the train model, routing replay, LoRA adapters (``lora``), CPU stand-ins (applied only
  without CUDA).
- ``rollout``: the rollout engines (embedded, the SGLang fleet) and multi-turn episodes; nothing of
  Megatron.
- ``environments``: what a multi-turn episode talks to (the interface, episodes with state; the Python
  tool and its sandbox, a Python session, code with tests, a guessing game; a user's class by import
  path); standard library only.
- ``models``: per model family, HF config -> the family config and the HF <-> Megatron weight mapping
  (shared by job: ``family``, ``fused``, ``names``, ``converters``); nothing of megatron-core's names.
- ``config``: the typed run config and its checks.
- ``algorithms``: losses, advantages, aggregation, KL estimators, the drift check. Pure PyTorch.
- ``rewards``, ``data``: the math reward (math-verify, in a process pool), a ``reward.function`` by
  import path (``rewards.custom``), and the prompt files (every field of a row kept).
- ``ops``: the vocab-parallel log-prob/entropy kernels, the fused LM head, RoPE of packed sequences.
- contracts and rules: ``batch`` (the batch every phase reads), ``buckets`` (the weight stream
  between actor and engines), ``token_layout`` (a micro-batch's tokens and side inputs), ``routing``
  (the MoE routing contract), ``layout`` (the parallel layout's rules, the CP chunk rule),
  ``layer_kinds`` (the token mixers' table: HF layer type, pattern symbol, CPU stand-in, memory prices),
  ``gdn_kernels`` (what the Gated DeltaNet's kernels need, read by the builder and the launch),
  ``time_limits`` (the rollout's time limits), ``dtypes``, ``net``, ``metrics``, ``launch_costs``,
  ``cuda_alloc``, ``cache_dir``, ``children`` (subprocesses that die with their parent).
"""
__version__ = "0.1.0"

import warnings as _warnings

#: The warnings of the libraries underneath that a user can do nothing about: (message regex,
#: category, issuing-module regex, why); their log lines are :data:`KNOWN_LIBRARY_LOG_LINES` below.
#: This is the one place where other libraries' noise is silenced, each line by its exact message,
#: never by category and never for this package's own modules.
#: :func:`filter_known_library_warnings` silences exactly these,
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
    (r"MimoModelConfig is experimental and still under active development\. The API may change without "
     r"notice in future releases\.", UserWarning, r"megatron\.core\.models\.mimo\.",
     "megatron-core 0.19 at import (its package imports the multi-modal config; the actor never uses it)"),
)

#: The log records of the libraries underneath that a user can do nothing about: (logger name,
#: exact message regex, why). :func:`filter_known_library_warnings` drops exactly these records, each
#: from the one logger that issues it (a ``logging.Filter`` on that logger: the loggers need not exist
#: yet, so nothing is imported here); every other record of those loggers still shows. megatron-core
#: 0.19's ``GPTModel IS DEPRECATED`` line is not among them: it is answered, not silenced -- the actor
#: builds megatron's ``HybridModel`` wherever megatron-core has it (``actor.model_builder``,
#: megatron_tepo/megatron/hybrid.py), so the line shows only where a user asks for a GPTModel.
KNOWN_LIBRARY_LOG_LINES = (
    ("torch.utils.cpp_extension", r"No CUDA runtime is found, using CUDA_HOME='[^']*'\Z",
     "PyTorch, where its build has CUDA (the registry's default on Python 3.12) and the machine none: "
     "megatron-core's tensor_parallel.random imports torch.utils.cpp_extension, which looks for a CUDA "
     "toolkit at import to build extensions; nothing here builds one"),
    ("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated and will be "
     r"removed in the future releases\. Please, use NVRx async solution by setting `async_strategy` to "
     r"`nvrx`\.\Z",
     "megatron-core 0.19 at the first asynchronous save through its own writer: the actor takes NVRx's "
     "where nvidia-resiliency-ext is installed and says once which writer it took, and why "
     "(megatron_tepo/megatron/async_save.py:choose_async_writer)"),
)


class _DropLines:
    """A ``logging`` filter that drops the records whose message matches one of ``patterns``."""

    def __init__(self, patterns):
        import re

        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 -- a malformed record is the logging module's to report
            return True
        return not any(p.match(message) for p in self.patterns)


def filter_known_library_warnings() -> None:
    """Ignore exactly :data:`KNOWN_LIBRARY_WARNINGS` and drop exactly :data:`KNOWN_LIBRARY_LOG_LINES`
    (idempotent)."""
    import logging

    for message, category, module, _why in KNOWN_LIBRARY_WARNINGS:
        _warnings.filterwarnings("ignore", message=message, category=category, module=module)
    by_logger = {}
    for name, message, _why in KNOWN_LIBRARY_LOG_LINES:
        by_logger.setdefault(name, []).append(message)
    for name, messages in by_logger.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropLines)]:
            logger.removeFilter(old)
        logger.addFilter(_DropLines(messages))


filter_known_library_warnings()
