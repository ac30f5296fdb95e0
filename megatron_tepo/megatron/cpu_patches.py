"""Run-time work-arounds that let megatron-core 0.16.1 - 0.19.x run without CUDA, without Transformer
Engine, or without flash-linear-attention.

megatron-core hard-codes CUDA in many places that no config flag reaches, one of its MoE
functions assumes Transformer Engine, and its Gated DeltaNet needs flash-linear-attention's GPU
kernels. This module is THE one place that papers over them. Each
work-around is a small named function (see :data:`PATCHES`) whose docstring names the
megatron-core file/function it serves, and each is applied on exactly the condition that makes it
necessary (:data:`CONDITIONS`), and only on the megatron-core versions whose code needs it
(:data:`VERSIONS`: a PEP 440 specifier and the reason, per patch):

  * ``no_cuda`` (``torch.cuda.is_available()`` is False) -- patches 1-6 and 8: the CUDA calls they
    replace can only raise in such a process. On a GPU machine none of them is applied.
  * ``no_te`` (Transformer Engine does not import) -- patch 7 (``moe_router_gemm``): the NameError
    it prevents comes from the absence of TE, on a GPU as on a CPU. It binds a name only where
    megatron did not, so it can never shadow TE's kernel.
  * ``no_gdn_kernels`` (flash-linear-attention does not import, or there is no CUDA for its Triton
    kernels, or ``MTEPO_GDN_KERNELS=torch`` asks for the stand-in) -- patch 9 (``gdn_kernels``):
    megatron's Gated DeltaNet on the pure-torch stand-in of :mod:`.gated_delta_rule`; otherwise
    ``fla``'s kernels are never replaced. Where ``fla`` would refuse their backward
    (:func:`fla_backward_refusal`: Hopper with Triton in [3.4.0, 3.7.1), no tilelang; the rule is
    :mod:`megatron_tepo.gdn_kernels`, which the launch reads too) the hybrid builder refuses the
    model at build time instead of the first backward.

:func:`apply_cpu_patches` evaluates each condition through :data:`CONDITION_PROBES` (tests
monkeypatch :func:`cuda_available` / :func:`te_available`). Every patch records what it
replaced, so :func:`revert_cpu_patches` restores the original objects; tests use
``apply_cpu_patches(exclude={name})`` to show that each patch is necessary.

Scope of the lies told:
  * ``torch.cuda.current_device`` / ``torch.cuda.synchronize`` are replaced globally, but only in
    a process without CUDA, where the originals can only raise.
  * ``device="cuda"`` tensor factories are redirected to the CPU only inside the listed megatron
    modules (their module-global ``torch`` is swapped for a thin proxy); torch itself is untouched.
  * ``Tensor.type()`` reports ``torch.cuda.FloatTensor`` (``BFloat16Tensor``, ...) for CPU float
    tensors only while one of the three megatron functions that assert on that string is running; ``Tensor.cuda()`` is the
    identity only while the tied-embedding set-up of a pipelined model runs.
  * ``moe_router_gemm`` only binds a name megatron forgot to define without Transformer Engine.
  * ``torch.cuda.current_stream()`` returns a no-op stream only inside
    ``distributed/param_and_grad_buffer.py`` (its module-global ``torch`` is a proxy).
  * ``gdn_kernels`` binds, in megatron's Gated DeltaNet modules only, the three flash-linear-attention
    functions they call to :mod:`.gated_delta_rule`'s, and says ``HAVE_FLA`` there (the module
    refuses to build otherwise).

Versions: the supported range is :data:`megatron_tepo.megatron.compat.SUPPORTED` (tested at both
ends, 0.16.1 and 0.19.x). :data:`TARGETS` names, per patch, the megatron functions it serves and the
CUDA construct each must still contain; ``tests/megatron/test_cpu_patches.py`` checks them against
the installed megatron-core (a patch whose target changed shape fails there, not silently at run
time), and shows on each end of the range that every patch in effect is necessary and that every
patch out of its version range is not. A patch whose target is missing raises AttributeError.

Deliberately left out (not probed, the actor does not use them on CPU): dist_checkpointing (its
saver needs only patches 1 and 3), CUDA graphs, FP8/FP16 grad scaling, NCCL allocators, the MoE
alltoall dispatcher (needs CUDA streams; see models/qwen3_moe/README.md).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from megatron_tepo.gdn_kernels import stand_in_chosen

__all__ = ["PATCHES", "CONDITIONS", "CONDITION_PROBES", "VERSIONS", "TARGETS", "apply_cpu_patches",
           "revert_cpu_patches", "applied_patches", "cuda_available", "te_available", "fla_available",
           "version_applies"]

# (owner object, attribute name, original value) for every replaced attribute, per patch.
_UNDO: Dict[str, List[Tuple[object, str, object]]] = {}
_MISSING = object()  # "the attribute did not exist": reverting deletes it


def _replace(patch: str, owner: object, attr: str, new: object) -> None:
    """Set ``owner.attr = new`` and remember the original for :func:`revert_cpu_patches`."""
    _UNDO.setdefault(patch, []).append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, new)


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


# --------------------------------------------------------------------------------------------
# 1. torch.cuda.current_device
# --------------------------------------------------------------------------------------------
def patch_current_device() -> None:
    """``torch.cuda.current_device()`` -> ``"cpu"``.

    megatron-core passes ``device=torch.cuda.current_device()`` to tensor factories in many
    places: ``models/common/embeddings/rotary_pos_embedding.py`` (``RotaryEmbedding.get_emb``
    moves ``inv_freq`` there on every forward), ``pipeline_parallel/p2p_communication.py``
    (receive buffers and shape tensors), ``tensor_parallel/mappings.py``,
    ``distributed/param_and_grad_buffer.py`` (DDP grad buffers), ``global_vars``.
    """
    _replace("current_device", torch.cuda, "current_device", lambda: "cpu")


# --------------------------------------------------------------------------------------------
# 2. The CUDA RNG tracker
# --------------------------------------------------------------------------------------------
def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state, device=-1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name, seed):
    """``CudaRNGStatesTracker.add`` with the same semantics on the CPU generator."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception("seed {} already exists".format(seed))
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception("cuda rng state {} already exists".format(name))
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


def patch_rng_tracker() -> None:
    """The model-parallel RNG tracker keeps CPU generator states instead of CUDA ones.

    ``tensor_parallel/random.py``: ``CudaRNGStatesTracker.add`` (called by
    ``model_parallel_cuda_manual_seed``) calls ``torch.cuda.get_rng_state``; ``fork`` (entered by
    every attention/embedding dropout) and ``CheckpointFunction`` (activation recompute) call the
    module helpers ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``.
    """
    from megatron.core.tensor_parallel import random as mrandom

    _replace("rng_tracker", mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
    _replace("rng_tracker", mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
    _replace("rng_tracker", mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add)


# --------------------------------------------------------------------------------------------
# 3. torch.cuda.synchronize
# --------------------------------------------------------------------------------------------
def patch_cuda_synchronize() -> None:
    """``torch.cuda.synchronize()`` -> no-op (there is no device stream to wait for).

    ``pipeline_parallel/p2p_communication.py``: ``P2PCommunicator._communicate_shapes`` calls it
    unconditionally after exchanging tensor shapes, which the pipeline schedule does for every
    micro-batch when ``variable_seq_lengths=True`` (the actor's token-budget micro-batches);
    ``_communicate`` calls it when ``batch_p2p_sync`` is set.
    """
    _replace("cuda_synchronize", torch.cuda, "synchronize", lambda device=None: None)


# --------------------------------------------------------------------------------------------
# 4. device="cuda" tensor factories inside a few megatron modules
# --------------------------------------------------------------------------------------------
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "as_tensor")

# Modules whose module-global ``torch`` is swapped for the proxy; each one is needed (a probe
# fails when it alone is left out). optimizer/distrib_optimizer.py (only current_device) and
# optimizer/grad_scaler.py (fp16 only) need no proxy.
CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = zeros(device="cuda")
    "megatron.core.optimizer.optimizer",  # found_inf / _scale_one / dummy_overflow buffers
    "megatron.core.optimizer.clip_grads",  # norm buffers in get_grad_norm_fp32 & clipping
    "megatron.core.utils",  # local_multi_tensor_l2_norm (no apex) returns a "cuda" tensor
)


class _CpuFactoryTorch:
    """A stand-in for the ``torch`` module that maps ``device="cuda"`` to the CPU in factories.

    Every other attribute is the real torch's, so ``isinstance(x, torch.Tensor)``,
    ``torch.distributed`` and friends behave unchanged.
    """

    def __init__(self, real):
        self.__dict__["_real"] = real
        for name in _FACTORIES:
            self.__dict__[name] = self._wrap(getattr(real, name))

    @staticmethod
    def _wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def factory(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return factory

    def __getattr__(self, name):
        return getattr(self.__dict__["_real"], name)


def patch_cuda_tensor_factories() -> None:
    """``torch.zeros(..., device="cuda")`` and friends -> CPU, inside the listed modules only.

    ``pipeline_parallel/schedules.py`` (``total_num_tokens`` in every forward_backward_*),
    ``optimizer/optimizer.py`` (``MixedPrecisionOptimizer.__init__`` buffers, used by the
    distributed optimizer even in fp32), ``optimizer/clip_grads.py`` (overflow/norm buffers of
    ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32``) and ``megatron/core/utils.py``
    (``local_multi_tensor_l2_norm``, the no-apex grad-norm fallback) build tensors with a literal
    ``device="cuda"``.
    """
    proxy = _CpuFactoryTorch(torch)
    for modname in CUDA_FACTORY_MODULES:
        module = importlib.import_module(modname)
        _replace("cuda_tensor_factories", module, "torch", proxy)


# --------------------------------------------------------------------------------------------
# 5. Tensor.type() == "torch.cuda.FloatTensor" checks
# --------------------------------------------------------------------------------------------
_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def cuda_type_strings():
    """While active, ``t.type()`` (no argument) on a CPU float tensor reports the CUDA type name."""
    real_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        result = real_type(self, dtype, non_blocking, **kwargs)
        if dtype is None and isinstance(result, str):
            return _CPU_TO_CUDA_TYPE.get(result, result)
        return result

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = real_type


def _with_cuda_type_strings(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_type_strings():
            return fn(*args, **kwargs)

    wrapper.__wrapped_by_cpu_patches__ = True
    return wrapper


def patch_tensor_type_checks() -> None:
    """Scoped ``Tensor.type()`` faking for the three megatron functions that assert on it.

    ``optimizer/clip_grads.py``: ``clip_grad_by_total_norm_fp32`` asserts
    ``param.grad.type() == 'torch.cuda.FloatTensor'`` (also imported by name into
    ``optimizer/optimizer.py``); ``optimizer/distrib_optimizer.py``:
    ``DistributedOptimizer._build_model_and_main_param_groups`` raises TypeError unless an fp32
    param's type string is ``torch.cuda.FloatTensor``; ``optimizer/optimizer.py``:
    ``Float16OptimizerWithFloat16Params.__init__`` (the plain optimizer of a bf16 actor) raises
    TypeError unless each param's type string is a ``torch.cuda.*Tensor``. Outside these calls
    ``type()`` is real.
    """
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    wrapped = _with_cuda_type_strings(clip_grads.clip_grad_by_total_norm_fp32)
    _replace("tensor_type_checks", clip_grads, "clip_grad_by_total_norm_fp32", wrapped)
    _replace("tensor_type_checks", moptimizer, "clip_grad_by_total_norm_fp32", wrapped)
    cls = distrib_optimizer.DistributedOptimizer
    original = cls.__dict__["_build_model_and_main_param_groups"]  # a classmethod object
    _replace("tensor_type_checks", cls, "_build_model_and_main_param_groups",
             classmethod(_with_cuda_type_strings(original.__func__)))
    f16 = moptimizer.Float16OptimizerWithFloat16Params
    _replace("tensor_type_checks", f16, "__init__", _with_cuda_type_strings(f16.__init__))


# --------------------------------------------------------------------------------------------
# 6. Tensor.cuda() in the tied-embedding set-up of a pipelined model
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def cuda_to_noop():
    """While active, ``t.cuda()`` returns ``t`` itself (CPU tensors stay where they are)."""
    real_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = real_cuda


def patch_tied_embedding_setup() -> None:
    """Scoped ``Tensor.cuda()`` -> identity inside ``LanguageModule.setup_embeddings_and_output_layer``.

    ``models/common/language_module/language_module.py``: with tied embeddings and PP > 1 the
    first and last stage all-reduce their copies of the word embeddings at construction, after
    ``weight.data = weight.data.cuda()``. Outside that method ``Tensor.cuda`` is the real one.
    """
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup(self, *args, **kwargs):
        with cuda_to_noop():
            return original(self, *args, **kwargs)

    _replace("tied_embedding_setup", LanguageModule, "setup_embeddings_and_output_layer", setup)


# --------------------------------------------------------------------------------------------
# 7. MoE router GEMM without Transformer Engine
# --------------------------------------------------------------------------------------------
def patch_moe_router_gemm() -> None:
    """Define ``te_general_gemm = None`` in ``transformer/moe/moe_utils.py``.

    ``RouterGatingLinearFunction.forward/backward`` test ``te_general_gemm is not None``, but the
    name is only bound when Transformer Engine imports, so every MoE router forward raises
    NameError without TE (a megatron-core 0.16.1 bug, not CPU-specific). ``None`` selects the
    existing plain ``torch.matmul`` path.
    """
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in vars(moe_utils):
        _UNDO.setdefault("moe_router_gemm", []).append((moe_utils, "te_general_gemm", _MISSING))
        moe_utils.te_general_gemm = None
    else:
        _UNDO.setdefault("moe_router_gemm", [])


# --------------------------------------------------------------------------------------------
# 8. torch.cuda.current_stream in DDP's grad sync (megatron-core >= 0.19)
# --------------------------------------------------------------------------------------------
class _NoStream:
    """The current "stream" of a CUDA-less process: work is already done when it is issued, so
    waiting on an event or another stream is a no-op."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None


class _StreamTorch:
    """A stand-in for the ``torch`` module whose ``torch.cuda.current_stream()`` is a :class:`_NoStream`;
    everything else (``torch.cuda.current_device`` included) is the real torch's."""

    def __init__(self, real):
        self.__dict__["_real"] = real
        self.__dict__["cuda"] = _StreamCuda(real.cuda)

    def __getattr__(self, name):
        return getattr(self.__dict__["_real"], name)


class _StreamCuda:
    def __init__(self, real_cuda):
        self.__dict__["_real"] = real_cuda

    @staticmethod
    def current_stream(device=None) -> _NoStream:
        return _NoStream()

    def __getattr__(self, name):
        return getattr(self.__dict__["_real"], name)


def patch_grad_sync_stream() -> None:
    """``torch.cuda.current_stream()`` -> a no-op stream, inside ``distributed/param_and_grad_buffer.py`` only.

    From megatron-core 0.19, ``_ParamAndGradBucketGroup.start_grad_sync`` (every DDP grad
    reduction, so every train step) starts with ``torch.cuda.current_stream()`` to wait on the
    events of local CUDA-graph replays; without CUDA that call raises. The module-global ``torch``
    of that module is swapped for a proxy; torch itself is untouched.
    """
    from megatron.core.distributed import param_and_grad_buffer

    _replace("grad_sync_stream", param_and_grad_buffer, "torch", _StreamTorch(torch))


# --------------------------------------------------------------------------------------------
# 9. Gated DeltaNet kernels without flash-linear-attention (megatron-core >= 0.19)
# --------------------------------------------------------------------------------------------
def patch_gdn_kernels() -> None:
    """flash-linear-attention's functions -> :mod:`.gated_delta_rule`'s, inside
    ``ssm/gated_delta_net/`` only.

    ``gdn.py``: ``GatedDeltaNet.forward`` calls ``causal_conv1d`` and ``_setup_variant_attrs``
    takes ``chunk_gated_delta_rule`` (both ``None`` without ``fla``); ``common.py``:
    ``_GDNBase.__init__`` raises ImportError unless ``HAVE_FLA``, and
    ``_prepare_input_for_gated_delta_rule`` calls ``l2norm``. flash-linear-attention's kernels are
    Triton: GPU only.
    """
    from megatron.core.ssm.gated_delta_net import common, gdn

    from megatron_tepo.megatron import gated_delta_rule as torch_gdn

    _replace("gdn_kernels", common, "HAVE_FLA", True)
    _replace("gdn_kernels", common, "l2norm", torch_gdn.l2norm)
    _replace("gdn_kernels", gdn, "causal_conv1d", torch_gdn.causal_conv1d)
    _replace("gdn_kernels", gdn, "chunk_gated_delta_rule", torch_gdn.chunk_gated_delta_rule)


# --------------------------------------------------------------------------------------------
def cuda_available() -> bool:
    """The ``no_cuda`` probe's input (a function so tests can monkeypatch it)."""
    return torch.cuda.is_available()


def te_available() -> bool:
    """The ``no_te`` probe's input: Transformer Engine imports (see :mod:`megatron_tepo.megatron.spec`)."""
    from megatron_tepo.megatron.spec import te_available as probe

    return probe()


def fla_available() -> bool:
    """flash-linear-attention (``fla``) is installed (its kernels also need CUDA)."""
    import importlib.util

    return importlib.util.find_spec("fla") is not None


def fla_backward_refusal(capability=None, triton_version=None, tilelang=None) -> Optional[str]:
    """Why flash-linear-attention's Gated DeltaNet backward would refuse to run here, or None.

    fla 0.6 raises in its first backward (``chunk_bwd_dqkwg``, gated) on Hopper (compute capability
    9.x) with 3.4.0 <= Triton < 3.7.1 (which computes it wrong there: fla issue #640) unless its
    tilelang backend is installed; the GPU check met it on an H200 with Triton 3.6.0 (2026-11-28).
    The rule is :func:`megatron_tepo.gdn_kernels.backward_refusal`, the one the launch's check of
    the trainer's python reads too. The arguments (the device's capability, Triton's version,
    whether tilelang imports) default to this machine's; None where CUDA or ``fla`` is missing (the
    stand-in runs then) or ``MTEPO_GDN_KERNELS=torch`` asks for the stand-in."""
    import importlib.util

    from megatron_tepo import gdn_kernels

    if gdn_kernels.stand_in_chosen():
        return None
    if capability is None:
        if not (cuda_available() and fla_available()):
            return None
        capability = torch.cuda.get_device_capability()
    if triton_version is None:
        import triton

        triton_version = triton.__version__
    if tilelang is None:
        tilelang = importlib.util.find_spec("tilelang") is not None
    return gdn_kernels.backward_refusal(capability, triton_version, tilelang)


#: condition name -> "is the work-around needed here?"
CONDITION_PROBES: Dict[str, Callable[[], bool]] = {
    "no_cuda": lambda: not cuda_available(),
    "no_te": lambda: not te_available(),
    "no_gdn_kernels": lambda: stand_in_chosen() or not (cuda_available() and fla_available()),
}

PATCHES: Dict[str, Callable[[], None]] = {
    "current_device": patch_current_device,
    "rng_tracker": patch_rng_tracker,
    "cuda_synchronize": patch_cuda_synchronize,
    "cuda_tensor_factories": patch_cuda_tensor_factories,
    "tensor_type_checks": patch_tensor_type_checks,
    "tied_embedding_setup": patch_tied_embedding_setup,
    "moe_router_gemm": patch_moe_router_gemm,
    "grad_sync_stream": patch_grad_sync_stream,
    "gdn_kernels": patch_gdn_kernels,
}

#: patch -> the condition (a key of :data:`CONDITION_PROBES`) under which it is applied
CONDITIONS: Dict[str, str] = {
    "current_device": "no_cuda",
    "rng_tracker": "no_cuda",
    "cuda_synchronize": "no_cuda",
    "cuda_tensor_factories": "no_cuda",
    "tensor_type_checks": "no_cuda",
    "tied_embedding_setup": "no_cuda",
    "moe_router_gemm": "no_te",
    "grad_sync_stream": "no_cuda",
    "gdn_kernels": "no_gdn_kernels",
}

#: patch -> (the megatron-core versions it applies to, why). Both ends of the supported range
#: (0.16.1, 0.19.x) are tested; 0.17.0 / 0.18.0 were read, not run.
VERSIONS: Dict[str, Tuple[str, str]] = {
    "current_device": (">=0.16.1", "device=torch.cuda.current_device() in rotary embeddings, p2p, "
                       "DDP buffers: unchanged 0.16.1 - 0.19.2"),
    "rng_tracker": (">=0.16.1", "CudaRNGStatesTracker.add calls torch.cuda.get_rng_state: "
                    "unchanged 0.16.1 - 0.19.2"),
    "cuda_synchronize": (">=0.16.1", "P2PCommunicator._communicate_shapes calls "
                         "torch.cuda.synchronize: unchanged 0.16.1 - 0.19.2"),
    "cuda_tensor_factories": (">=0.16.1", "device='cuda' literals in schedules / optimizer / "
                              "clip_grads / utils: unchanged 0.16.1 - 0.19.2"),
    "tensor_type_checks": (">=0.16.1", "'torch.cuda.FloatTensor' checks in clip_grads / "
                           "distrib_optimizer / Float16Optimizer: unchanged 0.16.1 - 0.19.2"),
    "tied_embedding_setup": (">=0.16.1", "weight.data.cuda() in setup_embeddings_and_output_layer: "
                             "unchanged 0.16.1 - 0.19.2"),
    "moe_router_gemm": (">=0.16.1,<0.17", "0.17.0 binds te_general_gemm = None itself when "
                        "Transformer Engine is missing"),
    "grad_sync_stream": (">=0.19", "0.19.0 added torch.cuda.current_stream() at the top of "
                         "start_grad_sync (CUDA-graph wgrad events)"),
    "gdn_kernels": (">=0.19", "the Gated DeltaNet package (ssm/gated_delta_net/gdn.py, common.py) of 0.19; "
                    "0.18 kept it in one module, 0.16.1 / 0.17 have no HybridModel to build it in"),
}

#: patch -> the megatron functions it serves and the construct each must still contain (checked
#: against the installed megatron-core by tests/megatron/test_cpu_patches.py): (module,
#: qualified name, substring of its source)
TARGETS: Dict[str, List[Tuple[str, str, str]]] = {
    "current_device": [
        ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb",
         "torch.cuda.current_device()")],
    "rng_tracker": [
        ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add", "torch.cuda.get_rng_state("),
        ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork", "_set_cuda_rng_state("),
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "torch.cuda.random.get_rng_state("),
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", "torch.cuda.default_generators"),
    ],
    "cuda_synchronize": [
        ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate_shapes",
         "torch.cuda.synchronize()")],
    "cuda_tensor_factories": [
        ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining", 'device="cuda"'),
        ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__", "device='cuda'"),
        ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "device='cuda'"),
        ("megatron.core.utils", "local_multi_tensor_l2_norm", 'device="cuda"'),
    ],
    "tensor_type_checks": [
        ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", "'torch.cuda.FloatTensor'"),
        ("megatron.core.optimizer.distrib_optimizer",
         "DistributedOptimizer._build_model_and_main_param_groups", "'torch.cuda.FloatTensor'"),
        ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
         "'torch.cuda.BFloat16Tensor'"),
    ],
    "tied_embedding_setup": [
        ("megatron.core.models.common.language_module.language_module",
         "LanguageModule.setup_embeddings_and_output_layer", ".cuda()")],
    "moe_router_gemm": [
        ("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction.forward",
         "te_general_gemm is not None")],
    "grad_sync_stream": [
        ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.start_grad_sync",
         "torch.cuda.current_stream()")],
    "gdn_kernels": [
        ("megatron.core.ssm.gated_delta_net.gdn", "GatedDeltaNet.forward", "causal_conv1d("),
        ("megatron.core.ssm.gated_delta_net.gdn", "GatedDeltaNet._setup_variant_attrs",
         "self.gated_delta_rule = chunk_gated_delta_rule"),
        ("megatron.core.ssm.gated_delta_net.common", "_GDNBase.__init__", "if not HAVE_FLA:"),
        ("megatron.core.ssm.gated_delta_net.common", "_GDNBase._prepare_input_for_gated_delta_rule", "l2norm("),
    ],
}


def version_applies(name: str, version=None) -> bool:
    """Whether patch ``name`` applies to megatron-core ``version`` (default: the installed one)."""
    from packaging.specifiers import SpecifierSet

    from megatron_tepo.megatron.compat import mcore_version

    return (version or mcore_version()) in SpecifierSet(VERSIONS[name][0], prereleases=True)


def applied_patches() -> List[str]:
    """Names of the patches currently in effect."""
    return [name for name in PATCHES if name in _UNDO]


def apply_cpu_patches(exclude: Iterable[str] = (), force: bool = False) -> List[str]:
    """Apply every work-around whose condition holds here and whose :data:`VERSIONS` include the
    installed megatron-core (minus ``exclude``); idempotent; returns those now applied. ``force``
    ignores the conditions, never the versions (tests)."""
    exclude = set(exclude)
    unknown = exclude - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown cpu patch(es) {sorted(unknown)}; known: {sorted(PATCHES)}")
    from megatron_tepo.megatron.compat import check_supported

    check_supported()  # a megatron-core outside the tested range: one clear error, here
    needed = {cond: force or probe() for cond, probe in CONDITION_PROBES.items()}
    for name, patch in PATCHES.items():
        if (name not in exclude and name not in _UNDO and needed[CONDITIONS[name]]
                and version_applies(name)):
            patch()
    return applied_patches()


def revert_cpu_patches() -> None:
    """Undo every applied patch (restores the original objects, latest first)."""
    for name in reversed(list(_UNDO)):
        for owner, attr, original in reversed(_UNDO.pop(name)):
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
