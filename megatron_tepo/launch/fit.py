"""Fit check: does a launch layout fit in GPU memory? Pure arithmetic, run before anything starts.

A *launch file* (``examples/models/<model>.yaml``) holds three things:

* ``architecture``: the Hugging Face ``config.json`` of the model (the published numbers, written
  out, or a path to a ``config.json``). When ``model.path`` holds a ``config.json`` that one wins:
  the real checkpoint is the truth. The numbers go through
  :func:`megatron_tepo.models.family_config_from_hf`, the project's single reading of HF configs.
* ``launch``: the placement on the cluster (:class:`LaunchLayout`: nodes for the actor and the
  rollout fleet, GPUs per node, GPU memory, SGLang TP and concurrency per server).
* everything else is a :class:`megatron_tepo.config.RunConfig` fragment (``_base_`` naming the
  method file, ``parallel``, ``optim``, ``train``, ``model``, ...). :func:`load_launch` validates
  it with :func:`megatron_tepo.config.load_config`; :func:`write_run_config` writes it as the file
  the trainer is started with, so the check and the run read the same numbers.

Conventions: ``GiB = 2**30`` bytes; ``h`` hidden size, ``F`` dense FFN size, ``Fm`` expert FFN
size, ``nh`` attention heads, ``ng`` KV groups, ``d`` head dim, ``V`` vocabulary, ``L`` layers,
``E`` experts, ``k`` experts per token, ``t`` TP, ``p`` PP, ``e`` EP, ``W`` actor GPUs,
``DP = W / (t*p)`` and, for expert weights, ``EDP = W / (p*e*t)`` (megatron's expert TP defaults
to ``t``). Sizes per GPU are for the *largest* pipeline stage (the first or the last).

**Parameters on one actor GPU** (the actor does not pad the vocabulary)::

    attention/layer = h*nh*d/t (q) + 2*h*ng*d/t (k, v) + nh*d*h/t (o) + h (input norm)
                      [+ (nh + 2*ng)*d/t  qkv bias, Qwen2] [+ 2*d  q/k norms, Qwen3]
    dense MLP/layer = 3*h*F/t + h (pre-MLP norm)
    MoE MLP/layer   = h*E (router, replicated) + h (norm) ; experts: (E/e) * 3*h*Fm / t
    first stage     = (L/p) layers + V*h/t (embedding)
    last stage      = (L/p) layers + h (final norm) + V*h/t (output layer; with tied embeddings
                      only when p > 1, where the last stage keeps its own copy)

How the actor computes -- precision, attention, recompute, packing, sequence parallelism, the
micro-batch token budget, fusions -- is the run config's ``actor`` section
(:class:`megatron_tepo.config.ActorConfig`), the same object the trainer hands to
``MegatronActor``: the check prices exactly what the actor is told to do.

**Bytes per parameter** (``actor.precision``; megatron DDP keeps an fp32 gradient buffer, the
actor reduces gradients in fp32)::

    bf16:  2 (bf16 weight) + 4 (fp32 grad buffer) + 12 (fp32 main weight + Adam m + v)
           = 18, or 6 + 12/DP with optim.use_distributed_optimizer (EDP for expert weights)
    fp32:  4 (weight, its own main weight) + 4 (grad buffer) + 8 (Adam m + v)
           = 16, or 8 + 8/DP with the distributed optimizer
    a frozen reference policy (algorithm.kl_target: ref) adds one more weight copy (2 or 4 bytes).

A test builds the actor at TP=2 and DP=2, bf16 and fp32, and checks these against the bytes it
really allocates (tests/launch/test_fit_vs_actor.py).

**Activations** of one micro-batch of ``s = max(actor.max_tokens_per_micro_batch,
rollout.max_prompt_len + rollout.max_new_tokens)`` tokens (``actor.pack_sequences``: sequences
laid end to end up to the budget, a longer one alone; padded rows: ``rows x longest <= budget``),
``e`` bytes per element (2 for bf16, 4 for fp32), no dropout (the models have none, so no masks),
bytes per token per layer, what autograd keeps for backward::

    attention = e*[h (norm input) + h (QKV input) + (nh + 2*ng)*d (q, k, v) + 2*nh*d (the
                   attention output as the kernel keeps it, and the output projection's input)
                   (+ (nh + ng)*d  q/k-norm inputs, Qwen3)] + 4*nh (fp32 softmax statistics)
                [+ (4 + e)*nh*s_seq  actor.attention: unfused -- fp32 and e-byte probabilities
                   of the materialised [s_seq, s_seq] scores, s_seq = the padded row length]
    dense MLP = e*[h (norm input) + h (fc1 input) + 2*F (SwiGLU input) + F (fc2 input)
                   (+ F, the SiLU output, without actor.fusions)]
    MoE MLP   = e*[h + h (norm input, router input) + k*h (dispatched tokens)
                   + k*2*Fm + k*Fm] + 4*E (fp32 router logits) + 4*k (routing probabilities)

With sequence parallelism every term is divided by ``t``; without it the four ``h`` terms (norm
and linear inputs) are kept whole on every TP rank and only the rest is divided by ``t`` (MoE:
the ``k*h`` dispatched tokens are not divided either, an estimate assuming balanced routing).
``actor.recompute``: ``full`` keeps only each layer's input (``e*h`` bytes per token, ``/t`` with
SP) and re-runs ``actor.recompute_num_layers`` layers at a time (their activations of one
micro-batch on top); ``selective`` recomputes the core attention, which drops what the kernel
keeps of its output and statistics (``e*nh*d + 4*nh``, and the unfused scores).

Pipeline 1F1B: the first stage holds ``p`` micro-batches in flight, the last one, so the first
stage keeps ``p * (L/p) = L`` layers' worth. The last stage adds the logits working set
``2 * e * V/t`` bytes per token: the logits in the parameters' dtype (the actor never makes an
fp32 copy: the vocab-parallel op computes in fp32 from them and keeps no ``[s, V]`` buffer), and
their gradient, which exists while the logits are still held in the op's backward.

**SGLang server GPU** (TP ``ts`` per server, bf16, experts split over ``ts`` like the rest)::

    weights  = 2 * (params with t = ts, p = 1, e = 1)
    KV cache = max_running_requests * (max_prompt_len + max_new_tokens)
               * 2 (K and V) * L * ceil(ng / ts) * d * 2 bytes   (KV heads replicate when ts > ng)

checked as ``weights + KV <= mem_fraction_static * gpu_mem_gib`` (SGLang's static pool; the rest
is its activations and CUDA graphs).

**CPU mode** (``launch.device: cpu``, the tiny job of ``slurm/local_cpu_tepo.sh``): no GPU
arithmetic at all (the report says so); the layout rules below are still checked and the run config
and ``FIT_*`` variables are still written. ``launch.gpus_per_node`` then means trainer processes
per node, and ``launch.rollout_nodes: 0`` puts the SGLang servers on the actor node(s) (colocated:
their srun steps overlap the trainer's; CPU only, the GPU arithmetic has no shared-GPU case).

Deliberately left out: virtual pipeline stages, context parallelism, CPU offloading, the
temporary buffers of the optimizer step and of the vocab op's chunks (at most 2 x 64 MiB), and
the rollout fleet's radix cache beyond the configured concurrency.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import yaml

from megatron_tepo.config import ConfigError, RunConfig, apply_overrides, load_config, read_yaml_file
from megatron_tepo.layout import ModelDims, validate_layout

__all__ = ["GiB", "FitError", "SGLangLayout", "LaunchLayout", "LaunchSpec", "ModelShape",
           "ActorMemory", "ServerMemory", "FitReport", "model_shape", "param_counts",
           "actor_memory", "server_memory", "check_fit", "load_launch", "write_run_config",
           "shell_vars"]

GiB = 2 ** 30
LAUNCH_KEYS = ("architecture", "launch")


class FitError(ValueError):
    """The layout does not fit (or is inconsistent); the message names the setting to change."""


# --------------------------------------------------------------------------------------------
# Launch layout
# --------------------------------------------------------------------------------------------
@dataclass
class SGLangLayout:
    tp: int = 1  # GPUs per SGLang server
    max_running_requests: int = 64  # concurrent sequences per server (SGLang --max-running-requests)
    mem_fraction_static: float = 0.85  # SGLang --mem-fraction-static: weights + KV pool share
    port: int = 30000  # first server port on a node (server i uses port + i); 0: free ports picked
    # by the batch shell (one-node jobs whose servers run on the batch host only)
    servers_per_node: int = 0  # 0: gpus_per_node / tp on GPU, 1 on CPU
    max_total_tokens: int = 0  # SGLang --max-total-tokens (KV pool in tokens); 0: SGLang's sizing
    threads: int = 1  # OMP threads per CPU server (launch.device: cpu)


@dataclass
class LaunchLayout:
    device: Literal["cuda", "cpu"] = "cuda"  # cpu: no GPU arithmetic, gpus_per_node = processes
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    actor_nodes: int = 1
    rollout_nodes: int = 1
    reserve_gib: float = 4.0  # CUDA context + NCCL buffers + fragmentation, per actor GPU
    sglang: SGLangLayout = field(default_factory=SGLangLayout)

    @property
    def actor_gpus(self) -> int:
        return self.actor_nodes * self.gpus_per_node

    @property
    def colocated(self) -> bool:
        """The SGLang servers run on the actor nodes (``launch.rollout_nodes: 0``, CPU only)."""
        return self.rollout_nodes == 0

    @property
    def servers_per_node(self) -> int:
        if self.sglang.servers_per_node:
            return self.sglang.servers_per_node
        return 1 if self.device == "cpu" else self.gpus_per_node // self.sglang.tp

    @property
    def servers(self) -> int:
        return (self.actor_nodes if self.colocated else self.rollout_nodes) * self.servers_per_node


#: launch keys that moved to the run config's ``actor`` section
MOVED_LAUNCH_KEYS = {"actor_precision": "actor.precision", "recompute": "actor.recompute"}


def _layout_from_dict(data: Dict[str, Any], cls=LaunchLayout, prefix: str = "launch"):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, found {type(data).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if cls is LaunchLayout and key in MOVED_LAUNCH_KEYS:
            raise ConfigError(f"{prefix}.{key}: moved to {MOVED_LAUNCH_KEYS[key]} (the run config's 'actor' "
                              f"section, which the trainer and this check both read)")
        if key not in names:
            raise ConfigError(f"{prefix}.{key}: unknown key (valid keys: {', '.join(names)})")
        default = getattr(cls(), key)
        if dataclasses.is_dataclass(default):
            kwargs[key] = _layout_from_dict(value, type(default), f"{prefix}.{key}")
            continue
        if isinstance(default, bool) or isinstance(default, str):
            ok = isinstance(value, type(default))
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:  # float
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        if not ok:
            raise ConfigError(f"{prefix}.{key}: expected {type(default).__name__}, found {value!r}")
        kwargs[key] = value
    out = cls(**kwargs)
    if cls is LaunchLayout:
        if out.device not in ("cuda", "cpu"):
            raise ConfigError(f"launch.device: expected cuda or cpu, found {out.device!r}")
        for name in ("gpus_per_node", "actor_nodes"):
            if getattr(out, name) < 1:
                raise ConfigError(f"launch.{name}: must be >= 1, got {getattr(out, name)}")
        if out.rollout_nodes < 0:
            raise ConfigError(f"launch.rollout_nodes: must be >= 0, got {out.rollout_nodes}")
        if out.rollout_nodes == 0 and out.device != "cpu":
            raise ConfigError("launch.rollout_nodes: 0 (SGLang servers on the actor nodes) needs "
                              "launch.device: cpu; on GPUs give the servers their own nodes (>= 1)")
        if out.gpu_mem_gib <= 0 or out.reserve_gib < 0:
            raise ConfigError("launch.gpu_mem_gib must be > 0 and launch.reserve_gib >= 0")
        s = out.sglang
        if s.tp < 1 or out.gpus_per_node % s.tp:
            raise ConfigError(f"launch.sglang.tp: {s.tp} must be >= 1 and divide launch.gpus_per_node "
                              f"({out.gpus_per_node}); a server does not span nodes")
        if s.max_running_requests < 1:
            raise ConfigError("launch.sglang.max_running_requests: must be >= 1")
        if s.servers_per_node < 0 or s.max_total_tokens < 0 or s.threads < 1 or not 0 <= s.port < 65536:
            raise ConfigError("launch.sglang: servers_per_node and max_total_tokens must be >= 0, "
                              "threads >= 1, port in [0, 65535]")
        if out.device == "cuda" and s.servers_per_node * s.tp > out.gpus_per_node:
            raise ConfigError(f"launch.sglang.servers_per_node: {s.servers_per_node} servers x tp {s.tp} "
                              f"need more than launch.gpus_per_node ({out.gpus_per_node}) GPUs")
        if not 0 < s.mem_fraction_static <= 1:
            raise ConfigError("launch.sglang.mem_fraction_static: must be in (0, 1]")
    return out


# --------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The numbers the memory arithmetic needs (from :class:`GPTFamilyConfig`)."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    family: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def dims(self) -> ModelDims:
        """The sizes the layout rules read (:func:`megatron_tepo.layout.validate_layout`)."""
        return ModelDims(num_attention_heads=self.heads, num_key_value_heads=self.kv_groups, vocab_size=self.vocab,
                         intermediate_size=self.ffn, num_hidden_layers=self.num_layers,
                         num_experts=self.num_experts)


def model_shape(hf_config: Union[Dict[str, Any], str, Path]) -> ModelShape:
    """Read an HF config (dict or ``config.json`` path) through ``family_config_from_hf``."""
    if not isinstance(hf_config, dict):
        hf_config = json.loads(Path(hf_config).read_text(encoding="utf-8"))
    from megatron_tepo.models import family_config_from_hf

    fam = family_config_from_hf(hf_config, spec="local")
    moe = fam.moe
    return ModelShape(
        num_layers=fam.num_layers, hidden=fam.hidden_size, ffn=fam.ffn_hidden_size,
        heads=fam.num_attention_heads, kv_groups=fam.num_query_groups, head_dim=fam.head_dim,
        vocab=fam.vocab_size, tied=fam.tie_word_embeddings, qkv_bias=fam.qkv_bias,
        qk_norm=fam.qk_layernorm, num_experts=fam.num_experts, topk=moe.router_topk if moe else 0,
        moe_ffn=moe.ffn_hidden_size if moe else 0, family=fam.family)


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
def _layer_params(m: ModelShape, t: int, e: int) -> Tuple[int, int]:
    """(non-expert, expert) parameters of one layer on one GPU; exact integer division."""
    h, d = m.hidden, m.head_dim
    attn = (h * m.heads * d + 2 * h * m.kv_groups * d + m.heads * d * h) // t + h
    if m.qkv_bias:
        attn += (m.heads + 2 * m.kv_groups) * d // t
    if m.qk_norm:
        attn += 2 * d
    if m.is_moe:
        return attn + h * m.num_experts + h, (m.num_experts // e) * 3 * h * m.moe_ffn // t
    return attn + 3 * h * m.ffn // t + h, 0


def param_counts(m: ModelShape, t: int = 1, p: int = 1, e: int = 1) -> Dict[str, Tuple[int, int]]:
    """(non-expert, expert) parameters on one GPU of the first and of the last pipeline stage;
    ``t=p=e=1`` gives the whole model (``"first"`` == ``"last"``)."""
    dense, expert = _layer_params(m, t, e)
    n = m.num_layers // p
    emb = m.vocab * m.hidden // t
    first = n * dense + emb
    last = n * dense + m.hidden + (emb if (not m.tied or p > 1) else 0)
    if p == 1:
        first = last = n * dense + emb + m.hidden + (0 if m.tied else emb)
    return {"first": (first, n * expert), "last": (last, n * expert)}


def total_params(m: ModelShape) -> int:
    dense, expert = param_counts(m)["first"]
    return dense + expert


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------
def layer_activation_bytes(m: ModelShape, t: int, sp: bool, elem: int = 2, fused: bool = True,
                           unfused_seq: int = 0, selective: bool = False) -> float:
    """Bytes per token of one layer kept for backward (see the module docstring): ``elem`` bytes
    per activation element, ``fused`` SwiGLU, ``unfused_seq`` the padded row length when the
    attention materialises its scores (0: flash-style), ``selective`` core-attention recompute."""
    h, d = m.hidden, m.head_dim
    whole = 4 * h  # two norm inputs + two linear inputs
    sharded = (m.heads + 2 * m.kv_groups) * d + (1 if selective else 2) * m.heads * d
    if m.qk_norm:
        sharded += (m.heads + m.kv_groups) * d
    extra_bytes_sharded = 0 if selective else 4 * m.heads
    if unfused_seq and not selective:
        extra_bytes_sharded += (4 + (elem if elem < 4 else 0)) * m.heads * unfused_seq
    extra_bytes_whole = 0
    if m.is_moe:
        whole += m.topk * h  # dispatched tokens (not split by TP)
        sharded += m.topk * 3 * m.moe_ffn
        extra_bytes_whole = 4 * m.num_experts + 4 * m.topk
    else:
        sharded += (3 if fused else 4) * m.ffn
    if sp:
        return (elem * (whole + sharded) + extra_bytes_sharded + extra_bytes_whole) / t
    return elem * whole + extra_bytes_whole + (elem * sharded + extra_bytes_sharded) / t


def logits_bytes(m: ModelShape, t: int, elem: int = 2) -> float:
    """Bytes per token of the logits working set on the last stage: the logits and their
    gradient in the parameters' dtype, ``2 * elem * V / t``."""
    return 2 * elem * m.vocab / t


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
    logits: float
    reserve: float
    dp: int
    edp: int
    tokens: int

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.reference + self.activations
                + self.logits + self.reserve)


@dataclass
class ServerMemory:
    params: int
    weights: float
    kv_bytes_per_token: int
    kv_tokens: int
    kv_cache: float
    budget: float
    servers: int

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache


def _precision_bytes(precision: str) -> Tuple[int, int, int]:
    """(weight, grad, optimizer) bytes per parameter."""
    return (2, 4, 12) if precision == "bf16" else (4, 4, 8)


def actor_memory(m: ModelShape, cfg: RunConfig, launch: LaunchLayout) -> ActorMemory:
    """Per-GPU memory of the actor's largest pipeline stage (bytes; see the module docstring),
    priced from the run config's ``actor`` section."""
    t, p, e = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep
    act = cfg.actor
    sp = act.sequence_parallel
    world = launch.actor_gpus
    dp, edp = world // (t * p), world // (p * e * t)
    w_b, g_b, o_b = _precision_bytes(act.precision)
    elem = w_b  # activations are in the parameters' dtype
    dist = cfg.optim.use_distributed_optimizer
    ref = cfg.algorithm.kl_target == "ref"
    longest = cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
    s = max(act.max_tokens_per_micro_batch, longest)
    n = m.num_layers // p
    fused = act.fusions == "on" or (act.fusions == "auto" and launch.device == "cuda")
    unfused_seq = min(s, longest) if act.attention == "unfused" else 0
    per_layer = layer_activation_bytes(m, t, sp, elem, fused, unfused_seq, act.recompute == "selective")
    if act.recompute == "full":
        kept = elem * m.hidden / t if sp else elem * m.hidden
        working = per_layer * s * min(act.recompute_num_layers, n)  # one block re-run at a time
    else:
        kept, working = per_layer, 0.0
    counts = param_counts(m, t, p, e)
    best = None
    for stage, in_flight, has_logits in (("first", p, p == 1), ("last", 1, True)):
        dense, expert = counts[stage]
        opt = (o_b * dense / dp + o_b * expert / edp) if dist else o_b * (dense + expert)
        mem = ActorMemory(
            stage=stage if p > 1 else "only", dense_params=dense, expert_params=expert,
            weights=w_b * (dense + expert), grads=g_b * (dense + expert), optimizer=opt,
            reference=(w_b * (dense + expert) if ref else 0.0),
            activations=in_flight * n * kept * s + working,
            logits=logits_bytes(m, t, elem) * s if has_logits else 0.0,
            reserve=launch.reserve_gib * GiB, dp=dp, edp=edp, tokens=s)
        if best is None or mem.total > best.total:
            best = mem
    return best


def server_memory(m: ModelShape, cfg: RunConfig, launch: LaunchLayout) -> ServerMemory:
    """Per-GPU memory of one SGLang server GPU (bytes; see the module docstring)."""
    ts = launch.sglang.tp
    dense, expert = param_counts(m, ts, 1, 1)["first"]
    kv_per_token = 2 * m.num_layers * math.ceil(m.kv_groups / ts) * m.head_dim * 2
    kv_tokens = launch.sglang.max_running_requests * (cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens)
    return ServerMemory(params=dense + expert, weights=2 * (dense + expert), kv_bytes_per_token=kv_per_token,
                        kv_tokens=kv_tokens, kv_cache=float(kv_per_token * kv_tokens),
                        budget=launch.sglang.mem_fraction_static * launch.gpu_mem_gib * GiB,
                        servers=launch.servers)


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


@dataclass
class FitReport:
    shape: ModelShape
    actor: Optional[ActorMemory]  # None on CPU (launch.device: cpu): no GPU arithmetic
    server: Optional[ServerMemory]
    launch: LaunchLayout
    cfg: RunConfig

    @property
    def actor_fits(self) -> bool:
        return self.actor is None or self.actor.total <= self.launch.gpu_mem_gib * GiB

    @property
    def server_fits(self) -> bool:
        return self.server is None or self.server.total <= self.server.budget

    def actor_error(self) -> str:
        a, cfg = self.actor, self.cfg
        hints = []
        if not cfg.optim.use_distributed_optimizer and a.dp > 1:
            hints.append("set optim.use_distributed_optimizer: true")
        hints.append("raise parallel.tp or parallel.pp" + (" or parallel.ep" if self.shape.is_moe else ""))
        if cfg.actor.recompute != "full":
            hints.append("set actor.recompute: full")
        if cfg.actor.precision == "fp32":
            hints.append("set actor.precision: bf16")
        if a.activations + a.logits > 0.25 * a.total:
            hints.append("lower actor.max_tokens_per_micro_batch")
        if not cfg.actor.sequence_parallel and cfg.parallel.tp > 1:
            hints.append("set actor.sequence_parallel: true")
        if cfg.optim.use_distributed_optimizer:
            hints.append("raise launch.actor_nodes (more data-parallel optimizer shards)")
        return (f"actor does not fit: {a.total / GiB:.1f} GiB > {self.launch.gpu_mem_gib:g} GiB per GPU "
                f"({self.breakdown_actor()}); " + ", or ".join(hints))

    def server_error(self) -> str:
        s = self.server
        return (f"rollout servers do not fit: {s.total / GiB:.1f} GiB > {s.budget / GiB:.1f} GiB per GPU "
                f"(launch.sglang.mem_fraction_static {self.launch.sglang.mem_fraction_static:g} x "
                f"{self.launch.gpu_mem_gib:g} GiB; weights {_gib(s.weights)} + KV cache {_gib(s.kv_cache)}); "
                f"raise launch.sglang.tp, or lower launch.sglang.max_running_requests, "
                f"or lower rollout.max_new_tokens / rollout.max_prompt_len")

    def breakdown_actor(self) -> str:
        a = self.actor
        parts = [f"weights {_gib(a.weights)}", f"grads {_gib(a.grads)}", f"optimizer {_gib(a.optimizer)}"]
        if a.reference:
            parts.append(f"reference {_gib(a.reference)}")
        parts += [f"activations {_gib(a.activations)}", f"logits {_gib(a.logits)}", f"reserve {_gib(a.reserve)}"]
        return ", ".join(parts)

    def render(self) -> str:
        if self.actor is None:
            return self.render_cpu()
        m, a, s, L, cfg = self.shape, self.actor, self.server, self.launch, self.cfg
        par = cfg.parallel
        lines = [
            self.model_line(),
            f"actor: {L.actor_nodes} node(s) x {L.gpus_per_node} GPUs = {L.actor_gpus}; tp={par.tp} pp={par.pp} "
            f"ep={par.ep} dp={a.dp}" + (f" edp={a.edp}" if m.is_moe else "")
            + f" sp={cfg.actor.sequence_parallel} distributed_optimizer={cfg.optim.use_distributed_optimizer} "
            f"precision={cfg.actor.precision} attention={cfg.actor.attention} recompute={cfg.actor.recompute} "
            f"packed={cfg.actor.pack_sequences} micro-batch tokens={a.tokens}",
            f"  per GPU ({a.stage} stage): params {a.dense_params + a.expert_params:,}; {self.breakdown_actor()}",
            f"  total {_gib(a.total)} of {L.gpu_mem_gib:g} GiB: {'fits' if self.actor_fits else 'DOES NOT FIT'}",
            f"rollout: {L.rollout_nodes} node(s), {s.servers} SGLang server(s) x tp={L.sglang.tp}, "
            f"{L.sglang.max_running_requests} running requests each ({s.servers * L.sglang.max_running_requests} "
            f"concurrent; a step has {cfg.rollout.prompts_per_step * cfg.rollout.n_samples} sequences)",
            f"  per GPU: weights {_gib(s.weights)} + KV cache {_gib(s.kv_cache)} "
            f"({s.kv_tokens:,} tokens x {s.kv_bytes_per_token:,} B) = {_gib(s.total)} of {_gib(s.budget)} "
            f"(mem_fraction_static {L.sglang.mem_fraction_static:g}): {'fits' if self.server_fits else 'DOES NOT FIT'}",
        ]
        return "\n".join(lines)

    def model_line(self) -> str:
        m = self.shape
        return (f"model: {m.family}, {total_params(m):,} parameters "
                f"(L={m.num_layers}, h={m.hidden}, F={m.ffn}, nh={m.heads}, ng={m.kv_groups}, d={m.head_dim}, "
                f"V={m.vocab}, tied={m.tied}" + (f", E={m.num_experts}, k={m.topk}, Fm={m.moe_ffn}" if m.is_moe else "")
                + ")")

    def render_cpu(self) -> str:
        L, cfg = self.launch, self.cfg
        par = cfg.parallel
        where = "on the actor node(s) (colocated)" if L.colocated else f"on {L.rollout_nodes} node(s)"
        return "\n".join([
            self.model_line(),
            f"actor (cpu): {L.actor_nodes} node(s) x {L.gpus_per_node} processes = {L.actor_gpus}; "
            f"tp={par.tp} pp={par.pp} ep={par.ep} dp={par.dp(L.actor_gpus)}",
            f"rollout (cpu): {L.servers} SGLang server(s) {where}, tp={L.sglang.tp}, "
            f"{L.sglang.threads} thread(s) each",
            "memory: not checked (launch.device: cpu; the GPU arithmetic does not apply)",
        ])


def check_layout(m: ModelShape, cfg: RunConfig, launch: LaunchLayout) -> None:
    """The actor's layout rules (:func:`megatron_tepo.layout.validate_layout`, the only copy) on the
    launch's actor world, and the fleet's own rule."""
    errors = []
    try:
        validate_layout(cfg.parallel, m.dims(), launch.actor_gpus, sequence_parallel=cfg.actor.sequence_parallel,
                        cpu=launch.device == "cpu",
                        world="the actor's ranks (launch.actor_nodes x launch.gpus_per_node)")
    except ValueError as exc:
        errors.append(str(exc).removeprefix("invalid parallel layout: "))
    if m.heads % launch.sglang.tp:
        errors.append(f"launch.sglang.tp={launch.sglang.tp} does not divide num_attention_heads={m.heads}")
    if errors:
        raise FitError("invalid layout: " + "; ".join(errors))


def check_fit(m: ModelShape, cfg: RunConfig, launch: LaunchLayout, raise_error: bool = True) -> FitReport:
    """Compute the report; raise :class:`FitError` naming the settings to change if it does not fit."""
    check_layout(m, cfg, launch)
    if launch.device == "cpu":
        return FitReport(m, None, None, launch, cfg)
    report = FitReport(m, actor_memory(m, cfg, launch), server_memory(m, cfg, launch), launch, cfg)
    if raise_error:
        errors = ([report.actor_error()] if not report.actor_fits else []) + \
                 ([report.server_error()] if not report.server_fits else [])
        if errors:
            raise FitError("\n".join(errors))
    return report


# --------------------------------------------------------------------------------------------
# Launch files
# --------------------------------------------------------------------------------------------
@dataclass
class LaunchSpec:
    path: Path
    launch: LaunchLayout
    cfg: RunConfig
    run_data: Dict[str, Any]  # the RunConfig fragment, ``_base_`` made absolute
    architecture: Dict[str, Any]
    architecture_source: str

    def shape(self) -> ModelShape:
        return model_shape(self.architecture)


def _split_overrides(overrides: Sequence[str]) -> Tuple[List[str], List[str]]:
    launch, run = [], []
    for item in overrides:
        (launch if item.split("=", 1)[0].strip().split(".")[0] in LAUNCH_KEYS else run).append(item)
    return launch, run


def load_launch(path: Union[str, Path], overrides: Sequence[str] = (),
                hf_config: Optional[Union[str, Path]] = None) -> LaunchSpec:
    """Read a launch file; ``overrides`` are dotted ``KEY=VALUE`` (``launch.actor_nodes=4``,
    ``parallel.tp=8``, ``model.path=/models/x``); ``hf_config`` a ``config.json`` that wins."""
    path = Path(path).resolve()
    data = read_yaml_file(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    launch_ov, run_ov = _split_overrides(overrides)
    data = apply_overrides(data, launch_ov, {})
    arch = data.pop("architecture", None)
    launch = _layout_from_dict(data.pop("launch", {}) or {})
    bases = data.pop("_base_", [])
    bases = [bases] if isinstance(bases, str) else list(bases)
    run_data = apply_overrides(data, run_ov, {})
    if bases:
        run_data = {"_base_": [str((path.parent / b).resolve()) for b in bases], **run_data}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_file = Path(tmp) / "run.yaml"
        tmp_file.write_text(yaml.safe_dump(run_data, sort_keys=False), encoding="utf-8")
        cfg = load_config(tmp_file)
    source = ""
    if hf_config is not None:
        arch, source = str(hf_config), str(hf_config)
    elif cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        arch = source = str(Path(cfg.model.path) / "config.json")
    elif isinstance(arch, str):
        arch = source = str((path.parent / arch).resolve())
    elif isinstance(arch, dict):
        source = f"{path} (architecture)"
    else:
        raise ConfigError(f"{path}: no architecture: give an 'architecture' mapping (HF config.json "
                          f"numbers) or path, a model.path holding config.json, or --hf-config")
    if isinstance(arch, str):
        try:
            arch = json.loads(Path(arch).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read HF config {source}: {exc}") from None
    return LaunchSpec(path, launch, cfg, run_data, arch, source)


def write_run_config(spec: LaunchSpec, out: Union[str, Path]) -> Path:
    """Write the RunConfig file the trainer is started with (same numbers as the check)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(f"# written by tools/fit_check.py from {spec.path}\n"
                   + yaml.safe_dump(spec.run_data, sort_keys=False), encoding="utf-8")
    tmp.replace(out)
    load_config(out)  # what the trainer will read must validate
    return out


def shell_vars(spec: LaunchSpec) -> Dict[str, str]:
    """What slurm/lib.sh needs, as ``FIT_*`` shell variables."""
    L = spec.launch
    return {
        "FIT_DEVICE": L.device,
        "FIT_ACTOR_NODES": str(L.actor_nodes), "FIT_ROLLOUT_NODES": str(L.rollout_nodes),
        "FIT_GPUS_PER_NODE": str(L.gpus_per_node), "FIT_SGLANG_TP": str(L.sglang.tp),
        "FIT_SERVERS_PER_NODE": str(L.servers_per_node),
        "FIT_SGLANG_MAX_TOTAL_TOKENS": str(L.sglang.max_total_tokens),
        "FIT_SGLANG_THREADS": str(L.sglang.threads),
        "FIT_SGLANG_MAX_RUNNING": str(L.sglang.max_running_requests),
        "FIT_SGLANG_MEM_FRACTION": f"{L.sglang.mem_fraction_static:g}",
        "FIT_SGLANG_PORT": str(L.sglang.port),
        "FIT_MODEL_PATH": spec.cfg.model.path, "FIT_OUTPUT_DIR": spec.cfg.train.output_dir,
        "FIT_CONTEXT_LEN": str(spec.cfg.rollout.max_prompt_len + spec.cfg.rollout.max_new_tokens),
    }


def render_shell(spec: LaunchSpec) -> str:
    return "\n".join(f"{k}={shlex.quote(v)}" for k, v in shell_vars(spec).items())
