"""The one place where other libraries' noise is silenced (``megatron_tepo/__init__.py``, issue #45
point 3): each line by its exact message and issuing logger or module, never by category, never for
this package's own modules. (That the main job prints none: tests/trainer/test_quiet_main_job.py.)"""
import logging
import warnings

import megatron_tepo

CUDA_HOME = "No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'"
GPT = ("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features. Please reference "
       "the migration guide `docs/user-guide/hybrid-model-migration.md` for details on how to use `HybridModel`")
MCORE_ASYNC = ("MCore's async save is deprecated and will be removed in the future releases. Please, use NVRx async "
               "solution by setting `async_strategy` to `nvrx`.")


def _logged(name, message, *args):
    got = []
    handler = logging.Handler()
    handler.emit = got.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        logger.warning(message, *args)
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in got]


def test_exactly_the_known_log_lines_are_dropped():
    megatron_tepo.filter_known_library_warnings()  # (idempotent: one filter a logger)
    assert len(logging.getLogger("torch.utils.cpp_extension").filters) == 1
    assert _logged("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda") == []
    assert _logged("megatron.core.dist_checkpointing.strategies.torch", MCORE_ASYNC) == []
    # another line of the same logger, the same line from another logger, a longer one: all shown
    assert _logged("torch.utils.cpp_extension", "Error building extension 'x'") == ["Error building extension 'x'"]
    assert _logged("megatron_tepo.actor.checkpointing", MCORE_ASYNC) == [MCORE_ASYNC]
    assert _logged("megatron.core.dist_checkpointing.strategies.torch", MCORE_ASYNC + " And more.") == [
        MCORE_ASYNC + " And more."]
    assert _logged("torch.utils.cpp_extension", CUDA_HOME + " (x)") == [CUDA_HOME + " (x)"]


def test_the_gpt_model_deprecation_is_answered_not_silenced():
    """megatron-core 0.19's ``GPTModel IS DEPRECATED`` is no longer dropped: the actor builds a
    ``HybridModel`` wherever megatron-core has one (``actor.model_builder: auto``), so the line
    shows only where a user asks for a ``GPTModel`` -- and then it should."""
    from megatron_tepo.megatron.resolve import resolve_model_builder
    from megatron_tepo.megatron.compat import hybrid_model_available

    assert _logged("megatron.core.models.gpt.gpt_model", GPT) == [GPT]
    assert resolve_model_builder("auto") == ("hybrid" if hybrid_model_available() else "gpt")


def _warned(message, category, module):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megatron_tepo.filter_known_library_warnings()  # (in front of "always")
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return [str(w.message) for w in caught]


def test_exactly_the_mimo_warning_is_ignored():
    mimo = ("MimoModelConfig is experimental and still under active development. The API may change without notice "
            "in future releases.")
    assert _warned(mimo, UserWarning, "megatron.core.models.mimo.config.base_configs") == []
    assert _warned(mimo, UserWarning, "megatron_tepo.models") == [mimo]  # never for this package's own
    assert _warned(mimo, FutureWarning, "megatron.core.models.mimo.config.base_configs") == [mimo]
    assert _warned("MimoModel is experimental", UserWarning, "megatron.core.models.mimo.model.base") == [
        "MimoModel is experimental"]
