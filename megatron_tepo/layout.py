"""The parallel layout of the actor and its rules: the one home of both.

:class:`ParallelLayout` is the run config's ``parallel`` section (tensor, pipeline, expert and
context parallel sizes; data parallelism fills the rest of the world). :func:`validate_layout`
holds every divisibility rule, written once: the run config checks what it can when it is read
(the rules that need neither the model nor the world), the actor before it starts a process
group, the HF -> Megatron converter before it reads a tensor, the fit check on the login node. Each
caller says what it knows (the world size, whether Transformer Engine imports, whether the ranks
run on CPU) and how the world size is set, so the one message names the user's own knobs.

Pure arithmetic: nothing here imports torch or megatron. Starting the process groups is the
megatron backend's (:func:`megatron_tepo.megatron.parallel.initialize_parallel`).

Context parallelism (``cp``) splits every packed sequence over ``cp`` ranks of one model replica
(docs/ARCHITECTURE.md, "context parallelism"): it needs packed micro-batches, and the experts of an
MoE model are spread over the data- and context-parallel ranks together (megatron's expert grid).
**The CP chunk rule** is written here once (megatron's and Transformer Engine's load-balanced THD
layout): a sequence is padded to a multiple of ``2 * cp`` tokens and cut into ``2 * cp`` equal
chunks, rank ``r`` holding chunks ``r`` and ``2 * cp - 1 - r`` (:func:`cp_padded`,
:func:`cp_chunk`, :func:`cp_position`), and a rank's share of a micro-batch is rounded for the
sequence-parallel split (:func:`cp_share`). The token layout (``token_layout.py``), RoPE's
positions (``ops/rope.py``) and the fit check (``launch/memory.py``) read it from here. The
functions take plain integers or integer tensors alike.

Left out: virtual pipeline stages, expert-tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

__all__ = ["ParallelLayout", "ModelShape", "LayoutError", "validate_layout", "cp_padded", "cp_chunk",
           "cp_position", "cp_rank_tokens", "cp_segment", "cp_share"]


# --------------------------------------------------------------------------------------------
# The context-parallel chunk rule (module docstring): integers or integer tensors alike
# --------------------------------------------------------------------------------------------
def cp_padded(length, cp: int):
    """A sequence of ``length`` tokens padded to a multiple of ``2 * cp`` (at least ``2 * cp``)."""
    parts = 2 * cp
    return (length + parts - 1) // parts * parts


def cp_chunk(length, cp: int):
    """Tokens in each of the ``2 * cp`` chunks of a sequence of ``length`` tokens."""
    return cp_padded(length, cp) // (2 * cp)


def cp_position(within, chunk, cp: int, rank: int):
    """The position in its sequence of rank ``rank``'s token number ``within`` of that sequence
    (``0 .. 2 * chunk - 1``: its chunk ``rank``, then its chunk ``2 * cp - 1 - rank``)."""
    late = (within >= chunk) * 1
    return within + chunk * (rank + late * (2 * cp - 2 - 2 * rank))


def cp_rank_tokens(total_padded, cp: int):
    """Tokens each rank holds of sequences whose padded lengths (:func:`cp_padded`) sum to
    ``total_padded``: two chunks of each."""
    return total_padded // cp


def cp_segment(per_rank: int, cp: int) -> int:
    """The length of a pad segment (a sequence of its own) that adds ``per_rank`` tokens (even) to
    every rank's share: ``per_rank / 2`` tokens in each of its ``2 * cp`` chunks."""
    return per_rank // 2 * 2 * cp


def cp_share(have: int, cp: int, want: int = 0, multiple: int = 1) -> int:
    """A rank's share after the pad segment the actor adds: at least ``want`` tokens and ``have``
    (what the sequences need), a multiple of ``multiple`` (the sequence-parallel split of each rank's
    tokens), and an even number above ``have`` (the pad segment adds two chunks' worth a rank)."""
    share = max(have, want)
    while share % multiple or (share - have) % 2:
        share += 1
    return share


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor / pipeline / expert / context parallel sizes; data parallelism fills the rest of the
    world. (Sequence parallelism is a setting of how the actor computes: ``actor.sequence_parallel``.)"""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1  # context parallelism: each packed sequence split over cp ranks

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one replica of the model: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        """The data-parallel size in a world of ``world_size`` ranks (checked by :func:`validate_layout`)."""
        return world_size // self.model_parallel

    def as_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp}


@dataclass(frozen=True)
class ModelShape:
    """The model's sizes, under their Hugging Face names: the one shape type. The layout rules read it
    here, the fit check's memory arithmetic reads it (docs/LAUNCH.md's letters: ``h`` hidden_size,
    ``F`` intermediate_size, ``nh`` num_attention_heads, ``ng`` num_key_value_heads, ``d`` head_dim,
    ``V`` vocab_size, ``E`` num_experts, ``k`` num_experts_per_tok, ``Fm`` moe_intermediate_size; the
    Gated DeltaNet layers' key and value heads, which TP x CP must divide), and
    the family config makes it from any HF config the families know (``GPTFamilyConfig.dims()``).
    ``hidden_size``, ``head_dim`` and ``tie_word_embeddings`` only matter to the memory arithmetic."""

    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_experts: int = 0  # 0: dense
    hidden_size: int = 0
    head_dim: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    family: str = ""
    linear_num_key_heads: int = 0  # Gated DeltaNet layers (Qwen3.5); 0: none
    linear_num_value_heads: int = 0
    # the fit check's prices of a hybrid (Qwen3.5): how many of the layers are Gated DeltaNet layers
    # (spread evenly over the stack: every fourth is attention), their head sizes and convolution
    # width, the attention's output gate (q_proj twice as wide), the MoE's shared expert
    linear_layers: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attention_output_gate: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


class LayoutError(ValueError):
    """A refused layout: the one-line message, and ``problems``: ``(field, why)`` for each broken
    rule that needs neither the model nor the world, the ones the run config checks and names in
    its own style (``parallel.cp: why``)."""

    def __init__(self, message: str, problems: List[Tuple[str, str]]):
        super().__init__(message)
        self.problems = problems


def validate_layout(layout: ParallelLayout, model: Optional[ModelShape], world_size: Optional[int], *,
                    sequence_parallel: bool = False, pack_sequences: bool = True,
                    cpu: bool = False, field: str = "parallel.", world: str = "the world size") -> Optional[int]:
    """Check ``layout`` against ``model`` in a world of ``world_size`` ranks; return the
    data-parallel size. Raises ValueError (one line) naming every rule broken.

    ``model`` None: the rules that need the model's sizes are skipped, and ``world_size`` None
    those that need the world (then None is returned): what the run config checks when it is read,
    before anything knows the model or the world. ``sequence_parallel`` / ``pack_sequences``: the
    actor's settings of those names. ``cpu``: the actor runs on
    CPU (MoE with PP is refused there); ``field``: how the sizes are named to the user
    (``parallel.`` for the config, ``--`` for a command line); ``world``: what sets the world size,
    for the message.
    """
    tp, pp, ep, cp = layout.tp, layout.pp, layout.ep, layout.cp
    f = field
    errors = []
    bad = [f"{f}{name}={value}" for name, value in layout.as_dict().items()
           if not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError("invalid parallel layout: " + ", ".join(bad) + " must be integers >= 1")
    problems = []  # (field, why) beside each message: see LayoutError
    if cp > 1 and not pack_sequences:
        why = "context parallelism splits packed sequences: needs actor.pack_sequences=true"
        errors.append(f"{f}cp={cp}: {why}")
        problems.append((f"{f}cp", f"{why}, got {cp}"))
    for name in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
        value = getattr(model, name) if model is not None else 0
        if value % tp:
            note = " (the actor does not pad the vocabulary)" if name == "vocab_size" else ""
            errors.append(f"{f}tp={tp} does not divide {name}={value}{note}")
    for name in ("linear_num_key_heads", "linear_num_value_heads"):  # split over TP x CP ranks
        value = getattr(model, name) if model is not None else 0
        if value % (tp * cp):
            errors.append(f"{f}tp x {f}cp = {tp * cp} does not divide {name}={value} (Gated DeltaNet heads)")
    if model is not None and model.num_hidden_layers % pp:
        errors.append(f"{f}pp={pp} does not divide num_hidden_layers={model.num_hidden_layers}")
    if world_size is not None and world_size % layout.model_parallel:
        errors.append(f"{f}tp x {f}pp" + (f" x {f}cp" if cp > 1 else "")
                      + f" = {layout.model_parallel} does not divide {world} ({world_size})")
    elif world_size is not None and ep > 1 and (layout.dp(world_size) * cp) % ep:
        what = "the data-parallel size" if cp == 1 else f"data-parallel x {f}cp"
        errors.append(f"{f}ep={ep} does not divide {what} {layout.dp(world_size) * cp}")
    moe = model is not None and model.num_experts > 0
    if model is not None and ep > 1 and not moe:
        errors.append(f"{f}ep={ep} > 1 needs an MoE model")
    elif moe and model.num_experts % ep:
        errors.append(f"{f}ep={ep} does not divide num_experts={model.num_experts}")
    if moe and pp > 1 and cpu:
        errors.append(f"MoE with {f}pp={pp} does not run on CPU (the only CPU token dispatcher, allgather, "
                      f"refuses the variable_seq_lengths that PP needs; see models/qwen3_moe/README.md)")
    if moe and tp > 1 and not sequence_parallel:
        errors.append(f"MoE with {f}tp={tp} needs actor.sequence_parallel=true (megatron's MoELayer refuses "
                      f"tensor parallelism without it in training)")
    if sequence_parallel and tp == 1:
        errors.append(f"actor.sequence_parallel=true needs {f}tp > 1")
        problems.append(("actor.sequence_parallel", f"needs {f}tp > 1"))
    if errors:
        raise LayoutError("invalid parallel layout: " + "; ".join(errors), problems)
    return layout.dp(world_size) if world_size is not None else None
