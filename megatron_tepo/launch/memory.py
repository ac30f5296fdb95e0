"""Memory per GPU, in bytes: parameters on one rank (:func:`param_counts`), activations kept for
backward (:func:`layer_activation_bytes`), the LM head's working set (:func:`lm_head_bytes`), and the totals of the actor's
largest pipeline stage (:func:`actor_memory`, priced from the run config's ``actor`` section, what
the trainer hands to the actor) and of one SGLang server GPU (:func:`server_memory`); for a
colocated layout (the servers on the actor's GPUs, taking turns) the peak of each phase of a step
at each offload level and the servers' derived ``mem_fraction_static`` (:func:`colocated_memory`);
on the host, the worst case of the tool sandboxes on the driver's node (:func:`sandbox_memory`).
With ``actor.lora`` the base is frozen (weights only) and the adapters, priced by
:mod:`megatron_tepo.launch.lora`, carry the gradients and the optimizer's state.
Pure arithmetic; the formulas, their conventions and what they leave out are in docs/LAUNCH.md ("The
fit-check arithmetic", "LoRA"); tests/launch/test_fit_vs_actor.py checks the weight, gradient and optimizer
bytes against a built actor. Left out: deciding whether it fits (:mod:`megatron_tepo.launch.fit`)
and saying so (:mod:`megatron_tepo.launch.report`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from megatron_tepo.config import OFFLOAD_LEVELS, RunConfig
from megatron_tepo.cuda_alloc import expandable_in
from megatron_tepo.launch.lora import lora_activation_bytes, lora_param_split, lora_shape_problem
from megatron_tepo.launch.schema import LaunchLayout
from megatron_tepo.launch.shape import ModelShape
from megatron_tepo.layer_kinds import ATTENTION, other_mixers
from megatron_tepo.layout import cp_padded, cp_rank_tokens, cp_share
from megatron_tepo.routing import routing_dtype

__all__ = ["GiB", "param_counts", "total_params", "layer_activation_bytes", "logits_bytes", "lm_head_bytes",
           "fused_block_columns", "fused_head_bytes", "context_tokens", "cp_attention_bytes", "ActorMemory",
           "ServerMemory", "actor_memory", "server_memory", "OFFLOAD_ORDER", "PhasePeaks", "ColocatedMemory",
           "colocated_memory", "HostMemory", "STAGING_ROUNDING", "SandboxMemory", "sandbox_memory",
           "SANDBOX_MEMORY_SHARE"]

GiB = 2 ** 30


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
def _mlp_params(m: ModelShape, t: int, e: int) -> Tuple[int, int]:
    """(non-expert, expert) parameters of one layer's MLP on one GPU, its input norm included: the
    router and a shared expert (and its gate) beside the routed experts of an MoE layer."""
    h = m.hidden_size
    if m.is_moe:
        shared = 3 * h * m.shared_expert_intermediate_size // t + (h if m.shared_expert_gate else 0)
        return h * m.num_experts + h + shared, (m.num_experts // e) * 3 * h * m.moe_intermediate_size // t
    return 3 * h * m.intermediate_size // t + h, 0


def param_counts(m: ModelShape, t: int = 1, p: int = 1, e: int = 1) -> Dict[str, Tuple[int, int]]:
    """(non-expert, expert) parameters on one GPU of the first and of the last pipeline stage;
    ``t=p=e=1`` gives the whole model (``"first"`` == ``"last"``). A hybrid's mixers are priced by
    kind (:mod:`megatron_tepo.layer_kinds`), each kind's layers spread evenly over the stages
    (Qwen3.5's every fourth layer is attention, so a stage of a multiple of 4 layers holds exactly its
    share), attention taking the rest."""
    mlp, expert = _mlp_params(m, t, e)
    n = m.num_hidden_layers // p
    others = [(k, layers * n // m.num_hidden_layers) for k, layers in other_mixers(m)]
    layers = (n - sum(c for _, c in others)) * ATTENTION.params(m, t) \
        + sum(c * k.params(m, t) for k, c in others if c) + n * mlp
    emb = m.vocab_size * m.hidden_size // t
    first = layers + emb
    last = layers + m.hidden_size + (emb if (not m.tie_word_embeddings or p > 1) else 0)
    if p == 1:
        first = last = layers + emb + m.hidden_size + (0 if m.tie_word_embeddings else emb)
    return {"first": (first, n * expert), "last": (last, n * expert)}


def total_params(m: ModelShape) -> int:
    dense, expert = param_counts(m)["first"]
    return dense + expert


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------
def layer_activation_bytes(m: ModelShape, t: int, sp: bool, elem: int = 2, fused: bool = True,
                           unfused_seq: int = 0, selective: bool = False) -> float:
    """Bytes per token of one layer kept for backward (docs/LAUNCH.md): ``elem`` bytes per
    activation element, ``fused`` SwiGLU, ``unfused_seq`` the padded row length when the
    attention materialises its scores (0: flash-style), ``selective`` core-attention recompute. A
    hybrid's mixers are averaged: each kind's share of the layers at its own price
    (:mod:`megatron_tepo.layer_kinds`)."""
    h = m.hidden_size
    whole = 4 * h  # two norm inputs + two linear inputs
    sharded, extra_bytes_sharded = ATTENTION.activations(m, elem, unfused_seq, selective)
    others = other_mixers(m)
    if others:  # other mixers in place of that many attention mixers
        shares = [layers / m.num_hidden_layers for _, layers in others]
        rows = [k.activations(m, elem, unfused_seq, selective) for k, _ in others]
        rest = 1 - sum(shares)
        sharded = rest * sharded + sum(share * row[0] for share, row in zip(shares, rows))
        extra_bytes_sharded = rest * extra_bytes_sharded + sum(share * row[1] for share, row in zip(shares, rows))
    extra_bytes_whole = 0
    if m.is_moe:
        whole += m.num_experts_per_tok * h  # dispatched tokens (not split by TP)
        sharded += m.num_experts_per_tok * 3 * m.moe_intermediate_size + 3 * m.shared_expert_intermediate_size
        extra_bytes_whole = 4 * m.num_experts + 4 * m.num_experts_per_tok
    else:
        sharded += (3 if fused else 4) * m.intermediate_size
    if sp:
        return (elem * (whole + sharded) + extra_bytes_sharded + extra_bytes_whole) / t
    return elem * whole + extra_bytes_whole + (elem * sharded + extra_bytes_sharded) / t


def logits_bytes(m: ModelShape, t: int, elem: int = 2) -> float:
    """Bytes per token of the materialized LM head's working set on the last stage
    (``actor.lm_head: materialized``): the logits and their gradient in the parameters' dtype,
    ``2 * elem * V / t``."""
    return 2 * elem * m.vocab_size / t


#: the fused head's vocabulary blocks (ops/lm_head.py, ``default_block_size``; a test keeps the two equal)
_BLOCK_FRACTION, _MAX_BLOCK_BYTES, _MIN_BLOCK = 1 / 32, 256 * 2 ** 20, 128
#: ... and the rows of a bf16 block's gradient upcast at a time where no in-place mixed-precision GEMM
#: accumulates the hidden states' gradient (ops/lm_head.py, ``STAGING_ROWS``)
_STAGING_ROWS = 1 / 8


def fused_block_columns(tokens: int, vocab_local: int, elem: int) -> int:
    """Columns of one vocabulary block of the fused LM head for ``tokens`` scored tokens."""
    if vocab_local <= _MIN_BLOCK:
        return max(1, vocab_local)
    row = max(1, tokens) * elem
    cap = min(row * vocab_local * _BLOCK_FRACTION, _MAX_BLOCK_BYTES)
    return min(vocab_local, max(_MIN_BLOCK, int(cap // row) // _MIN_BLOCK * _MIN_BLOCK))


def fused_head_bytes(tokens: int, hidden: int, vocab_local: int, elem: int = 2) -> float:
    """Bytes the fused LM head (``ops/lm_head.py``) holds at its peak, its backward, for ``tokens``
    scored tokens of ``hidden`` elements and a weight shard of ``vocab_local`` rows, in ``elem``-byte
    parameters (docs/LAUNCH.md):

    * two ``[tokens, B]`` blocks of ``elem`` bytes (a block's logits and their gradient, ``B``:
      :func:`fused_block_columns`);
    * the scored hidden states and their gradient, ``2 * elem * hidden`` a token;
    * the weight shard's gradient, ``elem * vocab_local * hidden`` (returned by the head and held
      until megatron's DDP adds it into ``main_grad``);
    * below fp32 (``elem < 4``), the gradient's fp32 accumulator, ``4 * hidden`` a token, and the
      staging of a torch whose CUDA ``addmm`` cannot add a bf16 product into it in place (before
      2.10): the block's weights in fp32, ``4 * B * hidden`` (1/8 of the block gradient's rows, in
      fp32, take the front of the logits block's buffer, spent by then: nothing more from 2
      tokens on), priced always: the fit check does not know the GPU nodes' torch.

    Left out: its per-token vectors (statistics, coefficients, labels: tens of bytes a token)."""
    block = fused_block_columns(tokens, vocab_local, elem)
    held = 2 * elem * block * tokens + 2 * elem * hidden * tokens + elem * vocab_local * hidden
    if elem < 4:
        rows_beyond_block = max(0, 4 * math.ceil(tokens * _STAGING_ROWS) - elem * tokens) * block
        held += 4 * hidden * tokens + 4 * block * hidden + rows_beyond_block
    return float(held)


def lm_head_bytes(m: ModelShape, t: int, tokens: int, elem: int = 2, fused: bool = True) -> float:
    """Bytes of the LM head's working set on the last stage for a micro-batch of ``tokens``
    tokens (all of them taken as scored: the head runs at the response positions only, which
    the fit check does not know). Materialized: :func:`logits_bytes` per token and the weight
    shard's gradient (``elem * V/t * h``, as the fused head's). Fused (``actor.lm_head: fused``):
    :func:`fused_head_bytes`."""
    if not fused:
        return logits_bytes(m, t, elem) * tokens + elem * (m.vocab_size // t) * m.hidden_size
    return fused_head_bytes(tokens, m.hidden_size, m.vocab_size // t, elem)


# --------------------------------------------------------------------------------------------
# Context parallelism
# --------------------------------------------------------------------------------------------
def context_tokens(tokens: int, cp: int, multiple: int = 1) -> int:
    """Tokens one of ``cp`` context-parallel ranks holds of a packed micro-batch of ``tokens``
    tokens: the sequence padded to a multiple of ``2 * cp`` and cut in ``2 * cp`` chunks, two a rank
    (``MicroBatch.context_tokens``), then, as the actor pads each rank's share, to an even multiple of
    ``multiple`` (the sequence-parallel split: TP with ``actor.sequence_parallel``). Priced as one
    sequence: a micro-batch of several pads each, at most ``2 * cp - 1`` tokens a sequence (under 2 a
    rank), which is left out. ``cp == 1``: ``tokens``, unchanged."""
    if cp == 1:
        return tokens
    return cp_share(cp_rank_tokens(cp_padded(tokens, cp), cp), cp, multiple=multiple)


def cp_attention_bytes(m: ModelShape, t: int, rank_tokens: int, cp: int, seq: int, elem: int = 2,
                       te: bool = False) -> float:
    """Bytes one layer's context-parallel attention holds beside what a rank holds at CP 1, for a
    micro-batch of which the rank holds ``rank_tokens`` tokens and whose longest sequence has ``seq``.

    * Without Transformer Engine (the project's own attention, ``megatron/attention.py``): the keys and
      values all-gathered over the CP group (the whole micro-batch, ``cp * rank_tokens`` tokens, ``2 *
      ng/t * d * elem`` bytes a token), and each sequence's causal mask of its local queries against its
      keys, a boolean ``[t_q, t_k]`` and the additive bias SDPA makes of it in the activations' dtype,
      ``(1 + elem)`` bytes an entry: at most ``rank_tokens * seq`` entries.
    * With TE (``actor.attention: te``): its ring holds the keys and values of about two ranks' blocks
      (the one it computes on and the one it receives), no mask.

    0 at ``cp == 1``."""
    if cp == 1:
        return 0.0
    kv = 2.0 * (m.num_key_value_heads // t) * m.head_dim * elem * (2 if te else cp) * rank_tokens
    return kv + (0.0 if te else (1 + elem) * rank_tokens * seq)


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------
@dataclass
class ActorMemory:
    stage: str
    dense_params: int
    expert_params: int
    weights: float
    grads: float
    optimizer: float
    reference: float
    activations: float
    logits: float  # the LM head's working set (the logits and their gradient when materialized)
    reserve: float
    dp: int
    edp: int
    tokens: int
    # MoE routing replay (actor.routing_replay): the replayed expert ids (int64) of the micro-batches in
    # flight, held until each one's backward (its recompute replays them)
    routing: float = 0.0
    # and on the host, per rank, once per step: the step's routing (int8 up to 128 experts), every row
    routing_host: float = 0.0
    # context parallelism (parallel.cp): each rank holds rank_tokens of a micro-batch's tokens; its
    # activations, LM head and routing are priced at those; cp_attention: what its attention holds of the
    # other ranks (gathered keys and values and the causal mask, or TE's ring; kept for backward without
    # recompute, else one re-run block's)
    cp: int = 1
    rank_tokens: int = 0
    cp_attention: float = 0.0
    # the asynchronous checkpoint save (train.async_save): the CUDA context of NVRx's writer process on
    # this GPU where it opens the save's tensors by CUDA IPC (the trainer's allocator without expandable
    # segments), and on the host, per GPU, the save's staged copies (host shared memory or pinned copies)
    writer_context: float = 0.0
    staging_host: float = 0.0
    # LoRA (actor.lora): the adapters' parameters on this GPU, counted in dense_params (the base's are
    # the rest: frozen, weights only; gradients and the optimizer's state are the adapters' alone)
    lora_params: int = 0

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.reference + self.activations
                + self.logits + self.reserve + self.routing + self.cp_attention + self.writer_context)


@dataclass
class ServerMemory:
    params: int
    weights: float
    kv_bytes_per_token: int
    kv_tokens: int
    kv_cache: float
    budget: float
    servers: int
    # a hybrid's Gated DeltaNet layers: each running request's recurrent state (the convolution's last
    # inputs and the scan's key x value matrices, every such layer) instead of a KV cache
    state_bytes_per_request: int = 0
    state_requests: int = 0

    @property
    def state(self) -> float:
        return float(self.state_bytes_per_request * self.state_requests)

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.state


def _precision_bytes(precision: str) -> Tuple[int, int, int]:
    """(weight, grad, optimizer) bytes per parameter."""
    return (2, 4, 12) if precision == "bf16" else (4, 4, 8)


#: the trainer's allocator setting when ``PYTORCH_CUDA_ALLOC_CONF`` is unset (slurm/lib.sh's
#: ``tepo_trainer_env``; tests/launch hold the two equal)
TRAINER_ALLOC_CONF = "expandable_segments:True"
#: the CUDA context NVRx's checkpoint writer process makes on its trainer's GPU when it takes a save's
#: tensors by CUDA IPC (megatron/async_save.py:choose_async_writer: only with ordinary segments; with
#: expandable segments they are staged in host shared memory and the writer makes no context)
NVRX_WORKER_CONTEXT = 0.5 * GiB


def actor_memory(m: ModelShape, cfg: RunConfig, launch: LaunchLayout,
                 alloc_conf: str = TRAINER_ALLOC_CONF) -> ActorMemory:
    """Per-GPU memory of the actor's largest pipeline stage (bytes; docs/LAUNCH.md),
    priced from the run config's ``actor`` section; ``alloc_conf``: the trainer's
    ``PYTORCH_CUDA_ALLOC_CONF`` (the asynchronous save's writer takes a CUDA context on the GPU
    without expandable segments)."""
    t, p, e, cp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.cp
    act = cfg.actor
    sp = act.sequence_parallel
    world = launch.actor_gpus
    # the distributed optimizer shards the dense parameters' state over data x context parallel
    # (megatron's DP group with CP); the experts' over their own data-parallel group (CP is part of it)
    dp, edp = world // (t * p * cp), world // (p * e * t)
    w_b, g_b, o_b = _precision_bytes(act.precision)
    elem = w_b  # activations are in the parameters' dtype
    dist = cfg.optim.use_distributed_optimizer
    ref = cfg.algorithm.kl_target == "ref"
    longest = cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
    s = max(act.max_tokens_per_micro_batch, longest)
    r = context_tokens(s, cp, t if sp else 1)  # this rank's share (s at cp 1)
    n = m.num_hidden_layers // p
    fused = act.fusions == "on" or (act.fusions == "auto" and launch.device == "cuda")
    unfused_seq = min(s, longest) if act.attention == "unfused" else 0
    per_layer = layer_activation_bytes(m, t, sp, elem, fused, unfused_seq, act.recompute == "selective")
    if act.lora is not None:  # (the adapters' h = x A^T, and the dropped inputs with dropout)
        problem = lora_shape_problem(m, act.lora, t, act.moe_grouped_gemm)
        if problem:
            raise ValueError(problem)
        per_layer += lora_activation_bytes(m, act.lora, t, sp, elem)
    # one attention layer's (a hybrid's Gated DeltaNet layers take megatron's own CP path, an all-to-all
    # of their heads: priced as the layer's activations at the rank's tokens)
    gather = cp_attention_bytes(m, t, r, cp, min(s, longest), elem, te=act.attention == "te") \
        * (1 - sum(layers for _, layers in other_mixers(m)) / m.num_hidden_layers)
    if act.recompute == "full":
        kept = elem * m.hidden_size / t if sp else elem * m.hidden_size
        working = per_layer * r * min(act.recompute_num_layers, n)  # one block re-run at a time
        gather_kept, gather_working = 0.0, gather * min(act.recompute_num_layers, n)  # the re-run block's
    elif act.recompute == "none" and act.attention != "te":
        kept, working = per_layer, 0.0
        gather_kept, gather_working = gather, 0.0  # autograd keeps every layer's (SDPA's backward needs them)
    else:  # selective: the core attention re-runs one layer at a time; TE's ring buffers pass
        kept, working = per_layer, 0.0
        gather_kept, gather_working = 0.0, gather
    counts = param_counts(m, t, p, e)
    replay = m.is_moe and act.routing_replay != "off"
    step_rows = cfg.rollout.prompts_per_step * cfg.rollout.n_samples
    routing_host = (step_rows * longest * m.num_hidden_layers * m.num_experts_per_tok
                    * routing_dtype(m.num_experts).itemsize) if replay else 0.0  # (the routing contract's dtype)
    best = None
    for stage, in_flight, has_logits in (("first", p, p == 1), ("last", 1, True)):
        dense, expert = counts[stage]
        # LoRA: the base frozen (weights only), the adapters trained (the dense ones split by TP, the
        # experts' by EP, their optimizer state over the experts' data-parallel group)
        lora_dense, lora_expert = lora_param_split(m, act.lora, t, p, e) if act.lora is not None else (0, 0)
        adapters = lora_dense + lora_expert
        trained, trained_expert = (lora_dense, lora_expert) if act.lora is not None else (dense, expert)
        dense, expert = dense + lora_dense, expert + lora_expert
        opt = (o_b * trained / (dp * cp) + o_b * trained_expert / edp) if dist else o_b * (trained + trained_expert)
        mem = ActorMemory(
            stage=stage if p > 1 else "only", dense_params=dense, expert_params=expert,
            weights=w_b * (dense + expert), grads=g_b * (trained + trained_expert), optimizer=opt,
            reference=(w_b * (dense + expert - adapters) if ref else 0.0),
            activations=in_flight * n * kept * r + working,
            logits=lm_head_bytes(m, t, r, elem, fused=act.lm_head == "fused") if has_logits else 0.0,
            reserve=launch.reserve_gib * GiB, dp=dp, edp=edp, tokens=s,
            routing=(8.0 * in_flight * r * n * m.num_experts_per_tok) if replay else 0.0, routing_host=routing_host,
            cp=cp, rank_tokens=r, cp_attention=in_flight * n * gather_kept + gather_working,
            writer_context=NVRX_WORKER_CONTEXT if cfg.train.async_save and not expandable_in(alloc_conf) else 0.0,
            staging_host=STAGING_ROUNDING * (w_b * (dense + expert) + opt) if cfg.train.async_save else 0.0,
            lora_params=adapters)
        if best is None or mem.total > best.total:
            best = mem
    return best


def server_memory(m: ModelShape, cfg: RunConfig, launch: LaunchLayout) -> ServerMemory:
    """Per-GPU memory of one SGLang server GPU (bytes; docs/LAUNCH.md)."""
    server = launch.rollout.server
    ts = server.tp
    dense, expert = param_counts(m, ts, 1, 1)["first"]
    attention_layers = ATTENTION.layers(m)  # (a hybrid's others keep no KV cache)
    kv_per_token = 2 * attention_layers * math.ceil(m.num_key_value_heads / ts) * m.head_dim * 2
    kv_tokens = server.max_running_requests * (cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens)
    return ServerMemory(params=dense + expert, weights=2 * (dense + expert), kv_bytes_per_token=kv_per_token,
                        kv_tokens=kv_tokens, kv_cache=float(kv_per_token * kv_tokens),
                        budget=server.mem_fraction_static * launch.gpu_mem_gib * GiB,
                        servers=launch.servers, state_bytes_per_request=linear_state_bytes(m, ts),
                        state_requests=server.max_running_requests if linear_state_bytes(m, ts) else 0)


def linear_state_bytes(m: ModelShape, ts: int) -> int:
    """One request's recurrent state on one GPU of a TP-``ts`` server, over a hybrid's layers that keep
    one (each kind's ``state_bytes`` per layer: :mod:`megatron_tepo.layer_kinds`; a Gated DeltaNet's
    convolution inputs and scan matrices); 0 without such layers."""
    return sum(layers * k.state_bytes(m, ts) for k, layers in other_mixers(m))


# --------------------------------------------------------------------------------------------
# Colocated layouts: the servers on the actor's GPUs, taking turns with it (docs/LAUNCH.md)
# --------------------------------------------------------------------------------------------
#: actor.offload's levels from the least to the most moved (the fit check picks the first that fits)
OFFLOAD_ORDER = ("none", "optimizer", "optimizer_grads", "all")
assert set(OFFLOAD_ORDER) == set(OFFLOAD_LEVELS)
FRACTION_STEP = 0.01  # the derived mem_fraction_static is rounded up to this
#: megatron's asynchronous checkpoint save (``train.async_save``) stages each tensor of a rank's
#: checkpoint (its weights and optimizer shard) in pinned host memory (``preload_tensors``:
#: ``tensor.to("cpu", non_blocking=True)``), through torch's caching host allocator, which rounds each
#: block up to a power of two and keeps it for the run: priced at this bound
STAGING_ROUNDING = 2.0


@dataclass(frozen=True)
class HostMemory:
    """The host memory per node the pinned copies are checked against (bytes; 0: not checked), and
    where the figure comes from (said in the report)."""
    bytes: float = 0.0
    source: str = "launch.host_mem_gib: 0, not checked"


@dataclass
class PhasePeaks:
    """One offload level's peak per GPU in each phase of a colocated step, and what it moves."""
    level: str
    kept: float  # what the actor holds while the engine generates (its reserve not included)
    at_sync: float  # what the actor holds during the weight sync (its reserve not included)
    rollout: float  # actor kept + reserve + the server's static pool + its graphs and activations
    training: float  # the whole actor + what the server keeps after its release
    sync: float  # the actor's weights (and what it has not offloaded yet) + server weights + buckets
    moved: float  # bytes per GPU to host memory and back, each way, per step
    staging: float  # pinned bytes per GPU of the asynchronous checkpoint save's staging (a bound)
    host_per_node: float  # pinned host memory per node: (moved + staging) x GPUs (made once, held for the run)
    fits_gpu: bool
    fits_host: bool

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def peak(self) -> float:
        return max(self.rollout, self.training, self.sync)


@dataclass
class ColocatedMemory:
    """A colocated layout per GPU (bytes): the server's derived ``mem_fraction_static`` and static
    pool, the phases at every level (:data:`OFFLOAD_ORDER`), the level in use and the least that fits."""
    server: ServerMemory  # weights and the KV cache of max_running_requests sequences
    fraction: float  # the derived mem_fraction_static (static pool = weights + KV + the released part)
    pool: float  # fraction x GPU memory: what SGLang takes while serving, beside its graphs
    server_reserve: float  # graphs, activations (outside the pool)
    server_released: float  # what a released server keeps (inside the pool while it serves)
    buckets: float  # the weight sync's buffers on one GPU
    actor_reserve: float  # launch.reserve_gib: the trainer's CUDA context, NCCL, fragmentation
    seq_bytes: float  # the KV cache (and a hybrid's recurrent state) of one sequence of max_prompt_len + max_new_tokens tokens, per GPU
    levels: Dict[str, PhasePeaks]
    level: str  # in use: actor.offload, or the least that fits (auto; "all" when none does)
    least: Optional[str]  # the least level that fits (None: none does)
    gpu: float
    host: HostMemory  # what the pinned copies are checked against

    @property
    def phases(self) -> PhasePeaks:
        return self.levels[self.level]

    def capacity(self, level: str) -> int:
        """Sequences per server whose KV cache fits at ``level`` (the rollout phase at the GPU's size)."""
        room = (self.gpu - self.levels[level].kept - self.actor_reserve - self.server_reserve - self.server.weights
                - self.server_released)
        return max(0, int(room // self.seq_bytes)) if self.seq_bytes else 0


def colocated_memory(m: ModelShape, cfg: RunConfig, launch: LaunchLayout,
                     host: Optional[HostMemory] = None) -> ColocatedMemory:
    """The phases of a colocated step per GPU (docs/LAUNCH.md, "Colocated layouts"), at every
    offload level: each GPU holds an actor rank and one TP rank of a server.

    * rollout: what the actor keeps (level ``none``: all of it, its training working set too, which
      its allocator keeps cached since nothing empties it; else weights, gradients and optimizer
      less what is offloaded) + its reserve + the server's static pool (``mem_fraction_static`` x
      GPU: weights + KV cache + what it keeps when released) + the server's graphs and activations;
    * training: the whole actor (:func:`actor_memory`) + what the released server keeps;
    * sync: the actor's weights and what it has not offloaded (gradients at ``optimizer``; at
      ``none`` all it keeps in the rollout phase) + its reserve + the server's weights + what it
      keeps + the buckets (two on the actor's side, one being received);
    * host: what is offloaded (one block per part, pinned to the byte: ``megatron/offload.py``) and
      the asynchronous save's staging (:data:`STAGING_ROUNDING` x the rank's weights and optimizer
      shard, with ``train.async_save``), per GPU x GPUs per node, against ``host`` (None: not checked).
    """
    a = actor_memory(m, cfg, launch)
    s = server_memory(m, cfg, launch)
    gpu = launch.gpu_mem_gib * GiB
    released, reserve = launch.server_released_gib * GiB, launch.server_reserve_gib * GiB
    fraction = math.ceil((s.weights + s.kv_cache + s.state + released) / gpu / FRACTION_STEP - 1e-9) * FRACTION_STEP
    fraction = round(fraction, 6)
    pool = fraction * gpu
    buckets = 3 * cfg.rollout.sync_bucket_mb * 2 ** 20
    state = {"params": a.weights, "grads": a.grads, "optimizer": a.optimizer}
    whole = a.weights + a.grads + a.optimizer + a.reference
    host = host if host is not None else HostMemory()
    staging = STAGING_ROUNDING * (a.weights + a.optimizer) if cfg.train.async_save else 0.0
    levels = {}
    for level in OFFLOAD_ORDER:
        parts = OFFLOAD_LEVELS[level]
        moved = sum(state[p] for p in parts)
        kept = a.total - a.reserve if not parts else whole - moved
        # params leave after the sync; at none nothing empties the allocator's cache before it either
        before_sync = kept if not parts else whole - sum(state[p] for p in parts if p != "params")
        rollout = kept + a.reserve + pool + reserve
        training = a.total + released
        sync = before_sync + a.reserve + buckets + s.weights + released
        host_node = (moved + staging) * launch.gpus_per_node
        levels[level] = PhasePeaks(level, kept, before_sync, rollout, training, sync, moved, staging, host_node,
                                   fits_gpu=max(rollout, training, sync) <= gpu,
                                   fits_host=not host.bytes or host_node <= host.bytes)
    least = next((lv for lv in OFFLOAD_ORDER if levels[lv].fits), None)
    asked = cfg.actor.offload
    level = asked if asked != "auto" else (least or "all")
    seq = s.kv_bytes_per_token * (cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens) + s.state_bytes_per_request
    return ColocatedMemory(server=s, fraction=fraction, pool=pool, server_reserve=reserve, server_released=released,
                           buckets=buckets, actor_reserve=a.reserve, seq_bytes=seq, levels=levels, level=level,
                           least=least, gpu=gpu, host=host)


# --------------------------------------------------------------------------------------------
# The tool sandboxes (host memory of the driver's node)
# --------------------------------------------------------------------------------------------

#: the share of the driver node's memory that the tool sandboxes may take at most, all at once (the
#: rest is the training ranks', beside them in the job's cgroup, whom the OOM killer may pick)
SANDBOX_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class SandboxMemory:
    """The most a run's bubblewrap sandboxes can hold at once on the driver's node (bytes): each of
    ``concurrent`` sandboxes (``min(environment.tool_workers, environment.sandbox.max_concurrent)``)
    ``processes x memory_mb`` of address space (``RLIMIT_NPROC`` x ``RLIMIT_AS``) and its two tmpfs
    (``/tmp`` and ``/dev/shm``, ``tmp_mb`` each, in memory)."""
    concurrent: int
    per_sandbox: float

    @property
    def total(self) -> float:
        return self.concurrent * self.per_sandbox


def sandbox_memory(cfg: RunConfig) -> Optional[SandboxMemory]:
    """The worst case of ``cfg``'s tool sandboxes (:class:`SandboxMemory`); ``None`` without an
    environment, or where no bound lives on the node (``kind: remote``: the service's memory;
    ``kind: none``: no process count, said when it is made), or for an environment that runs no code."""
    from megatron_tepo.config.validation import sandbox_settings
    from megatron_tepo.environments.choice import uses_sandbox

    if not uses_sandbox(cfg.environment.name):
        return None

    sb = sandbox_settings(cfg)
    if sb.kind != "bubblewrap":
        return None
    mib = 2 ** 20
    return SandboxMemory(min(cfg.environment.tool_workers, sb.max_concurrent),
                         float(sb.processes * sb.memory_mb * mib + 2 * sb.tmp_mb * mib))
