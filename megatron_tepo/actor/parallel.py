"""Parallel layout of the Megatron actor: validate it, then start megatron's process groups.

:func:`validate_layout` runs BEFORE any process group exists (it only reads numbers) and raises
ValueError naming the offending values: heads / query groups / vocab not divisible by TP, layers
not divisible by PP, world size not divisible by TP*PP, experts not divisible by EP, MoE with
TP > 1 but no sequence parallelism, MoE with PP > 1 on CPU, sequence parallelism without
Transformer Engine (torch's LayerNorm/RMSNorm refuse it; ``actor.sequence_parallel``). The data-parallel
size is derived: ``dp = world_size / (tp * pp)``.

:func:`initialize_parallel` then pins one compute thread (CPU), applies the CPU patches when
there is no CUDA, joins the default process group (gloo on CPU, nccl on GPU) if needed, builds
megatron's ``parallel_state`` groups and seeds the model-parallel RNG tracker.

Left out: context parallelism, virtual pipeline stages, expert-tensor parallelism.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor / pipeline / expert parallel sizes; data parallelism fills the rest of the world.
    (Sequence parallelism is a setting of how the actor computes: ``ActorConfig.sequence_parallel``.)"""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)


def _world_size(world_size: Optional[int]) -> int:
    if world_size is not None:
        return world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate_layout(layout: ParallelLayout, family_cfg, world_size: Optional[int] = None,
                    te_available: Optional[bool] = None, sequence_parallel: bool = False) -> int:
    """Check ``layout`` (with ``sequence_parallel``) against the model and the world; return the
    data-parallel size.

    Pure arithmetic, no process group needed. Raises ValueError naming every violated rule.
    """
    world = _world_size(world_size)
    if te_available is None:
        from megatron_tepo.models.spec import te_available as _te

        te_available = _te()
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    errors = []
    if min(tp, pp, ep) < 1:
        errors.append(f"tp={tp}, pp={pp}, ep={ep} must all be >= 1")
    else:
        if family_cfg.num_attention_heads % tp:
            errors.append(f"num_attention_heads={family_cfg.num_attention_heads} is not divisible by tp={tp}")
        if family_cfg.num_query_groups % tp:
            errors.append(f"num_query_groups={family_cfg.num_query_groups} (KV heads) is not divisible by tp={tp}")
        if family_cfg.vocab_size % tp:
            errors.append(f"vocab_size={family_cfg.vocab_size} is not divisible by tp={tp} "
                          f"(the actor does not pad the vocabulary)")
        if family_cfg.ffn_hidden_size % tp:
            errors.append(f"ffn_hidden_size={family_cfg.ffn_hidden_size} is not divisible by tp={tp}")
        if family_cfg.num_layers % pp:
            errors.append(f"num_layers={family_cfg.num_layers} is not divisible by pp={pp}")
        if world % (tp * pp):
            errors.append(f"world_size={world} is not divisible by tp*pp={tp}*{pp}={tp * pp}")
        num_experts = family_cfg.extra.get("num_experts") if family_cfg.extra else None
        if ep > 1 and not num_experts:
            errors.append(f"ep={ep} > 1 needs an MoE model")
        elif num_experts and num_experts % ep:
            errors.append(f"num_experts={num_experts} is not divisible by ep={ep}")
        if num_experts and pp > 1 and not torch.cuda.is_available():
            errors.append(f"MoE with pp={pp} does not run on CPU (the only CPU token dispatcher, "
                          f"allgather, refuses the variable_seq_lengths that PP needs; see "
                          f"models/qwen3_moe/README.md)")
        if num_experts and tp > 1 and not sequence_parallel:
            errors.append(f"MoE with tp={tp} needs actor.sequence_parallel=true (megatron's MoELayer "
                          f"refuses tensor parallelism without it in training)")
        if ep > 1 and world % (tp * pp) == 0 and (world // (tp * pp)) % ep:
            errors.append(f"data-parallel size {world // (tp * pp)} is not divisible by ep={ep}")
    if sequence_parallel and not te_available:
        errors.append("actor.sequence_parallel=true needs Transformer Engine (not importable here: "
                      "megatron's torch norms refuse sequence parallelism)")
    if sequence_parallel and tp == 1:
        errors.append("actor.sequence_parallel=true needs tp > 1")
    if errors:
        raise ValueError("invalid parallel layout: " + "; ".join(errors))
    return world // (tp * pp)


def initialize_parallel(layout: ParallelLayout, family_cfg, seed: int = 1234,
                        backend: Optional[str] = None, sequence_parallel: bool = False) -> int:
    """Validate, then start the process groups; returns the data-parallel size. Idempotent only in
    the sense that an already-initialized default group is reused."""
    dp = validate_layout(layout, family_cfg, sequence_parallel=sequence_parallel)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        torch.set_num_threads(1)
    from megatron_tepo.megatron import apply_cpu_patches

    apply_cpu_patches()  # each work-around on its own condition (no CUDA / no TE), GPU included
    if not dist.is_initialized():
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend or ("nccl" if on_gpu else "gloo"))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return dp


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (for tests / clean exits)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def raise_if_any_rank_failed(error: Optional[BaseException], what: str,
                             exc_type: type = RuntimeError) -> None:
    """Collective: re-raise ``error`` on the rank that hit it and raise ``exc_type`` naming the
    failed rank(s) and their errors on every other rank, so that no rank is left waiting in a
    later collective. A no-op when every rank succeeded."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, None if error is None else f"{type(error).__name__}: {error}")
        bad = [(r, e) for r, e in enumerate(errs) if e is not None]
        if bad and error is None:
            raise exc_type(f"{what} failed on rank(s) " + "; ".join(f"{r}: {e}" for r, e in bad))
    if error is not None:
        raise error


def single_process_env() -> None:
    """Outside torchrun (no ``RANK`` set): the ``env://`` variables of a one-process world on a
    free loopback port, so ``init_process_group`` works in a plain ``python`` run."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

