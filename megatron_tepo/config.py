"""Typed run configuration: YAML files plus dotted command-line overrides, validated on load.

A run is described by one :class:`RunConfig` (nested dataclasses). It is read from a YAML file
that may inherit from others (``_base_: other.yaml`` or a list of them, paths relative to the
file), then patched by overrides such as ``algorithm.kl_coef=0.001`` (the value is parsed as YAML,
so ``true``, ``1e-3``, ``null`` and ``[1, 2]`` work). Every key is checked against the dataclasses:

- an unknown key is an error naming its dotted path, the file and line it came from (or the
  override), and the closest valid keys;
- a value of the wrong type is an error naming the path, the expected type and what was found;
- cross-field rules (loss names, loss-specific arguments, divisibility) are checked in
  :func:`validate`, again naming the field.

Deliberately left out: environment-variable interpolation and config "groups"; a config is one
file tree plus overrides, so what ran is exactly what ``dump_config`` writes next to the run.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import yaml

from megatron_tepo.layout import ParallelLayout

__all__ = [
    "ConfigError", "RunConfig", "AlgorithmConfig", "RolloutCorrectionConfig", "AdvantageConfig", "RolloutConfig",
    "OptimConfig", "TrainConfig", "ParallelLayout", "ActorConfig", "ModelConfig", "DataConfig", "RewardConfig",
    "FaultConfig", "load_config",
    "from_dict", "from_file_data", "build_section", "to_dict", "apply_overrides", "dump_config", "validate",
    "read_yaml_file",
    "RESUME_MAY_CHANGE", "changed_settings",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the field and where it came from."""


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------
@dataclass
class RolloutCorrectionConfig:
    """Importance weights and rejection for the mismatch between the policy that sampled the
    tokens (the rollout engine) and the actor's old policy; the keys are the arguments of
    ``compute_policy_loss`` (formulas: docs/ALGORITHMS.md, "Rollout correction")."""

    rollout_is: Literal["none", "token", "sequence", "geometric"] = "none"
    rollout_is_cap: float = 2.0
    rollout_rs: Literal["none", "token", "sequence", "geometric"] = "none"
    rollout_rs_bounds: List[float] = field(default_factory=lambda: [0.5, 2.0])  # [lo, hi] of exp(x)


@dataclass
class AlgorithmConfig:
    """The policy loss and its options (see ``megatron_tepo.algorithms.compute_policy_loss``)."""

    loss: str = "tepo"
    clip_low: Optional[float] = None  # None: the loss's own default (0.2 for most; 3e-4 gspo; 0.01 tepo)
    clip_high: Optional[float] = None  # None: the loss's own default (0.28 for most; 4e-4 gspo; 0.014 tepo)
    agg: Optional[Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]] = None
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_mask: Literal["none", "pos_adv_dec_entropy", "neg_adv_inc_entropy", "either", "all"] = (
        "pos_adv_dec_entropy")
    kl_target: Literal["old", "ref"] = "old"  # KL against the rollout policy or a frozen reference
    delta_entropy: Literal["measured", "predicted"] = "measured"
    entropy_coef: float = 0.0  # >0 maximises entropy, <0 minimises (Table 3 Panel B)
    entropy_adv_alpha: float = 0.0  # Cheng et al. 2025 entropy-based advantage (0 = off)
    entropy_adv_kappa: float = 2.0
    loss_args: Dict[str, Any] = field(default_factory=dict)  # loss-specific, checked by the loss
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # The old (proximal) policy's log-probs: recomputed by the actor, or the rollout engine's own
    # (skips the actor's old-policy pass; no old-policy entropy then: see validate()).
    old_log_prob: Literal["recompute", "rollout"] = "recompute"


@dataclass
class AdvantageConfig:
    std_normalize: bool = True  # False: Dr.GRPO (r - mean)
    eps: float = 1e-6
    gpg_correction: bool = False  # GPG's B/(B-M) factor


@dataclass
class RolloutConfig:
    prompts_per_step: int = 64
    n_samples: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_len: int = 2048
    max_new_tokens: int = 8192
    dynamic_sampling: bool = True  # DAPO: drop groups whose rewards are all equal, resample
    max_sampling_rounds: int = 4  # bound on over-sampling rounds per step
    # Which engine generates (a name of rollout/registry.py). embedded: in-process HF model on
    # global rank 0 (one machine).
    # sglang: a fleet of SGLang servers, attached by URL (env TEPO_SGLANG_URLS, comma-separated,
    # wins over sglang_urls; the Slurm launchers set it); weights pushed after every update.
    engine: Literal["embedded", "sglang"] = "embedded"
    sglang_urls: List[str] = field(default_factory=list)
    request_timeout_s: float = 600.0  # one SGLang request
    # dispatch over 2+ servers: sglang-router where the SGLang venv has it (auto), or least-loaded
    router: Literal["auto", "sglang_router", "none"] = "auto"
    sync_mode: Literal["distributed", "tensor", "disk"] = "distributed"  # see rollout/sglang/weight_sync/
    sync_bucket_mb: int = 256  # weight-sync bucket: the sender's extra memory is about two
    sync_keep_buffers: bool = True  # hold them between syncs (no re-allocation per push)
    sync_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # the servers' dtype (bytes on the wire)
    sync_dir: Optional[str] = None  # disk mode: a directory the servers see (shared file system)
    # distributed mode: the address the servers reach the trainer at (IP or host name; env
    # TEPO_SYNC_ADDRESS wins). None: this host's interface on the route to the first server.
    sync_address: Optional[str] = None
    # One-step-off generation (1): the next step's groups are generated, with the weights this step
    # started from, while the actor trains this step; 0: generation and training alternate.
    max_staleness: Literal[0, 1] = 0
    drift_warn_mean: float = 0.05  # warn when engine vs actor log-probs differ more (mean |d|)
    drift_warn_max: float = 1.0  # ... or at most (max |d|)


@dataclass
class OptimConfig:
    """Adam (fp32 master weights), gradient clipping and the LR schedule of the actor.

    The schedule is megatron's ``OptimizerParamScheduler``: linear warmup from ``lr_warmup_init``
    to ``lr`` over ``lr_warmup_steps``, then ``lr_decay_style`` decay to ``min_lr`` at
    ``lr_decay_steps`` (None: the run's total number of optimizer steps).
    """

    lr: float = 5e-7
    min_lr: float = 0.0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_steps: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_steps: Optional[int] = None
    weight_decay: float = 0.0  # not applied to biases and 1-D params (megatron's rule)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    use_distributed_optimizer: bool = False


@dataclass
class TrainConfig:
    steps: int = 100  # rollout steps
    mini_batch_prompts: int = 16  # prompts per policy update
    epochs_per_step: int = 2  # passes over a step's responses (64 / 16 x 2 = 8 updates)
    seed: int = 1
    save_every: int = 10  # checkpoint every N rollout steps, and always the last one (0: the last only)
    keep_checkpoints: int = 3  # keep the newest N complete checkpoints (0: all)
    # write a checkpoint's tensors in the background while training goes on (at most one in flight;
    # published, its `complete` marker last, once written); false: every rank waits for the files
    async_save: bool = True
    resume: bool = True  # continue from the newest complete checkpoint under output_dir
    # A resumed run refuses settings that differ from its checkpoint's (the error lists them)
    # unless this is true; RESUME_MAY_CHANGE lists what may always change (steps, intervals).
    allow_config_change: bool = False
    export_hf: bool = True  # at the end of the run, the policy as an HF model in <output_dir>/hf
    eval_every: int = 0
    output_dir: str = "outputs/run"


#: the watchdog's faulthandler backstop fires this long after a phase's time-out (trainer/watchdog.py)
WATCHDOG_BACKSTOP_S = 60.0
#: how much longer than the longest watched phase a process group waits in one collective
PG_TIMEOUT_MARGIN_S = 300.0
#: a process group's wait when some phase is not watched (its watchdog 0): Slurm's time limit ends first
UNWATCHED_PG_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class FaultConfig:
    """What a long run survives and how long it waits (docs/FAULT_TOLERANCE.md): SGLang server
    health and recovery, the hang watchdog, and the stop of a run that no longer updates."""
    # a server is probed with a one-token generation; no answer within this: it is dead
    probe_timeout_s: float = 60.0
    # launch mode (servers started by the fleet): restarts per server, the k-th after
    # restart_backoff_s * 2**(k-1) seconds; 0: a dead server stays dead
    server_restarts: int = 3
    restart_backoff_s: float = 10.0
    # attach mode (servers started by the Slurm job, which restarts them): how long a weight sync
    # waits for a dead server to answer again before it goes on without it
    server_return_timeout_s: float = 600.0
    # the watchdog: no progress for this long in a phase -> every rank's stacks to its log, exit
    # non-zero (the Slurm job then requeues). 0 turns a phase's watchdog off. Sized for a 14B step
    # (64 prompts x 8 samples x 8k tokens; docs/FAULT_TOLERANCE.md)
    watchdog_generate_s: float = 7200.0  # one step's rollout, retries and server restarts included
    watchdog_collective_s: float = 1800.0  # one policy update, old log-probs, a checkpoint
    watchdog_sync_s: float = 1800.0  # one weight sync (server re-syncs included)
    # stop (non-zero, no requeue) after this many steps in a row without a policy update: every
    # group's rewards were equal, or every update was skipped as non-finite. 0: never
    max_steps_without_update: int = 20
    # test only: the run that starts at step 1 hangs at this step (0: off), on global rank 0, inside
    # the collective phase before its policy updates (a resumed run never hangs)
    inject_hang_at_step: int = 0

    def process_group_timeout_s(self) -> float:
        """How long every process group of a run (torch's default group, megatron's groups, the
        driver's gloo group, the weight sync's group) waits in one collective: longer than the
        longest phase the watchdog guards (plus its backstop and :data:`PG_TIMEOUT_MARGIN_S`), so
        that the watchdog -- which names the phase and the setting and lets the job requeue --
        always fires first. A rank can wait in one collective for a whole phase: the followers in
        the driver's broadcast through a rollout, TP ranks behind a sync, every rank through a
        checkpoint save. When a phase's watchdog is off (0) its waits have no bound:
        :data:`UNWATCHED_PG_TIMEOUT_S`."""
        limits = [self.watchdog_generate_s, self.watchdog_collective_s, self.watchdog_sync_s]
        if any(float(limit) <= 0 for limit in limits):
            return UNWATCHED_PG_TIMEOUT_S
        return max(float(limit) for limit in limits) + WATCHDOG_BACKSTOP_S + PG_TIMEOUT_MARGIN_S


@dataclass
class ActorConfig:
    """How the Megatron actor computes: the one home of these settings. The trainer, the main job,
    the Slurm / nemo-run launchers and the fit check all read this section, and
    ``MegatronActor`` takes the same names as keyword arguments.

    * ``precision``: ``bf16`` -- bf16 parameters and compute, fp32 main parameters and Adam
      states in the optimizer, gradients reduced in fp32 (megatron's mixed precision);
      ``fp32`` -- everything fp32 (the tiny CPU job and the exactness tests). Log-probs, entropy
      and the loss are fp32 either way.
    * ``attention``: ``te`` -- Transformer Engine's layer spec; ``sdpa`` -- megatron's local
      spec with ``torch.nn.functional.scaled_dot_product_attention`` as the core attention
      (flash / memory-efficient kernels on GPU, no ``[s, s]`` scores); ``unfused`` --
      megatron's local ``DotProductAttention`` (materialises the scores); ``auto`` -- te when
      Transformer Engine imports, sdpa otherwise.
    * ``recompute``: megatron's activation recompute; ``full`` re-runs blocks of
      ``recompute_num_layers`` layers (``recompute_method: uniform``), ``selective`` the core
      attention only.
    * ``pack_sequences``: micro-batches are sequences laid end to end (THD, no padding), up to
      ``max_tokens_per_micro_batch`` tokens; positions restart and attention never crosses two
      sequences. ``false``: rows padded to the micro-batch's longest (``rows x longest <= budget``).
    * ``sequence_parallel``: megatron's sequence parallelism (needs TP > 1 and Transformer Engine).
    * ``fusions``: megatron's ``torch.compile``-d fusions that work without Transformer Engine:
      SwiGLU (compiled once for every packed length and both passes), and bias + dropout + add
      for a family that has a bias or dropout there (the supported families have neither);
      ``auto`` -- on with CUDA, off on CPU. Transformer Engine's fused RoPE is not part of it:
      it is on whenever ``attention`` is ``te``.
    * ``overlap_grad_reduce``: megatron DDP starts each gradient bucket's all-reduce
      (reduce-scatter with the distributed optimizer) during the backward of the last
      micro-batch instead of after it. Works on NCCL and on gloo (CPU); the gradients are the
      same sums either way.
    * ``overlap_param_gather``: with ``optim.use_distributed_optimizer``, the parameter
      all-gather after an optimizer step runs bucket by bucket under the next forward (megatron's
      forward pre-hooks) instead of inside the step; the actor finishes it before anything else
      reads the weights (weight export/sync, checkpoints). Ignored without the distributed
      optimizer. Works on gloo.
    * ``gradient_accumulation_fusion``: weight-gradient GEMMs accumulate straight into the fp32
      ``main_grad`` buffers. ``auto`` -- on where it can run: Transformer Engine (its linears fuse
      it themselves) AND apex's ``fused_weight_gradient_mlp_cuda`` (megatron's own output layer
      is a local ``ColumnParallelLinear``, which refuses the flag without that extension); off
      otherwise (always on CPU). ``on`` without them is refused.
    * ``moe_grouped_gemm``: MoE experts as one grouped GEMM (Transformer Engine's
      ``TEGroupedMLP``) instead of one GEMM per expert. ``auto`` -- on with Transformer Engine,
      off without it (megatron's local grouped MLP needs the ``grouped_gemm`` package).
    * ``packed_attention``: how the sdpa core attention runs packed sequences. ``varlen`` --
      one ``torch.nn.attention.varlen.varlen_attn`` call per layer (flash kernel: CUDA, bf16 or
      fp16); ``flex`` -- one FlexAttention call with a document mask (compiled on CUDA);
      ``loop`` -- one SDPA call per sequence; ``auto`` -- varlen on CUDA with bf16, flex on CUDA
      with fp32, loop on CPU (there the per-sequence fused SDPA kernel keeps no scores, while
      eager FlexAttention materialises ``[heads, t, t]`` scores and compiling it costs more than
      the loop saves on a CPU job).
    """

    precision: Literal["bf16", "fp32"] = "bf16"
    attention: Literal["auto", "te", "sdpa", "unfused"] = "auto"
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_num_layers: int = 1
    pack_sequences: bool = True
    sequence_parallel: bool = False
    max_tokens_per_micro_batch: int = 16384
    fusions: Literal["auto", "on", "off"] = "auto"
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    gradient_accumulation_fusion: Literal["auto", "on", "off"] = "auto"
    moe_grouped_gemm: Literal["auto", "on", "off"] = "auto"
    packed_attention: Literal["auto", "varlen", "flex", "loop"] = "auto"


@dataclass
class ModelConfig:
    path: str = ""  # Hugging Face checkpoint directory (config.json, weights, tokenizer)


@dataclass
class DataConfig:
    """Prompt files (JSONL or Parquet; plain ``{prompt, answer}`` or the DAPO-Math form)."""

    train_files: List[str] = field(default_factory=list)
    eval_files: List[str] = field(default_factory=list)
    apply_chat_template: bool = True
    on_bad_row: Literal["error", "skip"] = "error"  # skip: count and report malformed rows


@dataclass
class RewardConfig:
    """How responses are scored. math_verify: the last \\boxed{} of each response against the
    answer with math-verify, in a process pool; exact_match: the decoded response, stripped, equals
    the answer (toy tasks such as tools/make_tiny_model.py's)."""

    kind: Literal["math_verify", "exact_match"] = "math_verify"
    workers: int = 2
    timeout_s: float = 5.0  # per answer; a time-out is reward 0 and is counted


@dataclass
class RunConfig:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    actor: ActorConfig = field(default_factory=ActorConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    notes: str = ""  # free text: where a setting comes from


# --------------------------------------------------------------------------------------------
# YAML with line numbers
# --------------------------------------------------------------------------------------------
BASE_KEY = "_base_"


def _construct(node: yaml.Node, where: Dict[str, str], path: str, source: str) -> Any:
    """Turn a composed YAML node into Python data, recording ``file:line`` of every key."""
    if isinstance(node, yaml.MappingNode):
        out: Dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = yaml.safe_load(yaml.serialize(key_node)) if not isinstance(key_node, yaml.ScalarNode) \
                else key_node.value
            if not isinstance(key, str):
                raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: key {key!r} is not a string")
            sub = f"{path}.{key}" if path else key
            if key in out:
                raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: duplicate key '{sub}'")
            where[sub] = f"{source}:{key_node.start_mark.line + 1}"
            out[key] = _construct(value_node, where, sub, source)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, where, f"{path}[{i}]", source) for i, v in enumerate(node.value)]
    return yaml.safe_load(yaml.serialize(node))


def yaml_error(path: Union[str, Path], exc: "yaml.YAMLError") -> ConfigError:
    """``<file>:<line>:<column>: invalid YAML: <problem>`` (1-based) for a YAML parse error."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    context, ctx_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and ctx_mark is not None and ctx_mark is not mark:
        context += f" (from line {ctx_mark.line + 1}, column {ctx_mark.column + 1})"
    problem = ", ".join(filter(None, [context, getattr(exc, "problem", None)])) or str(exc)
    return ConfigError(f"{where}: invalid YAML: {' '.join(problem.split())}")


def read_yaml_file(path: Union[str, Path], where: Optional[Dict[str, str]] = None) -> Any:
    """A plain YAML file's data (launch files, benchmark lists); errors name file, line, column.
    ``where``, when given, gets the ``file:line`` of every key (dotted path), as the run config's
    own reader records them, and a duplicate key is then an error; ``_base_`` is left as data."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if where is None:
            return yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise yaml_error(path, exc) from None
    return None if node is None else _construct(node, where, "", str(path))


def _read_yaml(path: Path, where: Dict[str, str], _seen: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"{path}: circular {BASE_KEY} chain: " + " -> ".join(map(str, _seen + (path,))))
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise yaml_error(path, exc) from None
    if node is None:
        return {}
    own_where: Dict[str, str] = {}
    data = _construct(node, own_where, "", str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, found {type(data).__name__}")
    own_where.pop(BASE_KEY, None)
    merged = _read_bases(data.pop(BASE_KEY, []), path, where, _seen)
    where.update(own_where)
    return _deep_merge(merged, data)


def _read_bases(bases: Any, path: Path, where: Dict[str, str], _seen: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    """The ``_base_`` files of ``path`` (relative to its folder), merged left to right."""
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: {BASE_KEY} must be a file name or a list of file names")
    merged: Dict[str, Any] = {}
    for base in bases:
        merged = _deep_merge(merged, _read_yaml(path.parent / base, where, _seen + (path,)))
    return merged


def _deep_merge(base: Dict[str, Any], top: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "loss_args":
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------------
# Typed conversion
# --------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str, where: Dict[str, str]) -> Any:
    loc = f" ({where[path]})" if path in where else ""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}{loc}: expected a mapping for section '{path}', "
                              f"found {type(value).__name__} {value!r}")
        return _build(tp, value, path, where)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path, where)
            except ConfigError:
                pass
        raise ConfigError(f"{path}{loc}: expected {_type_name(tp)}, found {type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}{loc}: expected {_type_name(tp)}, found {value!r}")
        return value
    if origin in (list, List):
        if not isinstance(value, list):
            raise ConfigError(f"{path}{loc}: expected a list, found {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]", where) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}{loc}: expected a mapping, found {type(value).__name__} {value!r}")
        _, val_tp = typing.get_args(tp) or (str, Any)
        return {str(k): _coerce(v, val_tp, f"{path}.{k}", where) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}{loc}: expected bool (true/false), found {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}{loc}: expected int, found {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept numeric strings for floats.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"{path}{loc}: expected float, found {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}{loc}: expected str, found {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported schema type {tp!r}")  # pragma: no cover - schema bug


#: Settings a resumed run may change without ``train.allow_config_change``: how long it runs, how
#: often it saves / evaluates, where it finds its servers and workers (a requeued job's servers
#: have new addresses), and where the run folder itself is (the checkpoint resumed from is found in
#: ``train.output_dir``, so a different one there means the folder was moved, or is named by
#: another path).
RESUME_MAY_CHANGE = (
    "train.steps", "train.save_every", "train.keep_checkpoints", "train.async_save", "train.eval_every",
    "train.export_hf",
    "train.resume", "train.allow_config_change", "train.output_dir", "rollout.sglang_urls",
    "rollout.request_timeout_s", "rollout.router", "rollout.sync_address", "reward.workers", "fault", "notes",
)


def changed_settings(old: Dict[str, Any], new: Dict[str, Any], prefix: str = "") -> Dict[str, Tuple[Any, Any]]:
    """Dotted key -> (old, new) for every leaf that differs between two ``to_dict`` trees."""
    out: Dict[str, Tuple[Any, Any]] = {}
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}.{key}" if prefix else key
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict) and key != "loss_args":
            out.update(changed_settings(a, b, path))
        elif a != b:
            out[path] = (a, b)
    return out


#: Keys that moved to another section: the error says where they live now.
MOVED_KEYS = {
    "parallel.sequence_parallel": "actor.sequence_parallel",
    "train.max_tokens_per_micro_batch": "actor.max_tokens_per_micro_batch",
    "model.dtype": "actor.precision (bf16 or fp32)",
    # a launch file's ``launch`` section (megatron_tepo/launch/schema.py reads it with build_section)
    "launch.actor_precision": "actor.precision",
    "launch.recompute": "actor.recompute",
}


def _build(cls: type, data: Dict[str, Any], prefix: str, where: Dict[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            path = f"{prefix}.{key}" if prefix else key
            loc = f" ({where[path]})" if path in where else ""
            if path in MOVED_KEYS:
                raise ConfigError(f"{path}{loc}: moved to {MOVED_KEYS[path]} (the 'actor' section holds "
                                  f"every setting of how the actor computes)")
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            section = f"section '{prefix}'" if prefix else "the top level"
            raise ConfigError(f"{path}{loc}: unknown key in {section}{hint} "
                              f"(valid keys: {', '.join(names)})")
    kwargs = {}
    for name in names:
        if name in data:
            path = f"{prefix}.{name}" if prefix else name
            kwargs[name] = _coerce(data[name], hints[name], path, where)
    return cls(**kwargs)


def from_dict(data: Dict[str, Any], where: Optional[Dict[str, str]] = None) -> RunConfig:
    """Build and validate a :class:`RunConfig` from plain data."""
    cfg = _build(RunConfig, data, "", where or {})
    validate(cfg)
    return cfg


def from_file_data(path: Union[str, Path], data: Dict[str, Any], where: Dict[str, str]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from the data of the file ``path``, already read
    (:func:`read_yaml_file` with ``where``) and patched by the caller -- the RunConfig part of a
    launch file --: its ``_base_`` files merged under it as :func:`load_config` does; errors name
    the file and line (or the override) of the key."""
    path = Path(path).resolve()
    data, own_where = dict(data), dict(where)
    merged = _read_bases(data.pop(BASE_KEY, []), path, where)
    where.update(own_where)
    return from_dict(_deep_merge(merged, data), where)


def build_section(cls: type, data: Any, prefix: str, where: Optional[Dict[str, str]] = None) -> Any:
    """One section (a dataclass) from plain data by the run config's own typed rules -- unknown
    keys with the closest valid ones, moved keys (:data:`MOVED_KEYS`), types, ``Literal`` choices --;
    errors name the dotted path under ``prefix`` and, where ``where`` knows it, the file and line.
    For sections that are not the run config's (a launch file's ``launch``)."""
    return _coerce(data, cls, prefix, where or {})


def to_dict(cfg: Any) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


# --------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------
def apply_overrides(data: Dict[str, Any], overrides: List[str], where: Dict[str, str]) -> Dict[str, Any]:
    """Apply ``a.b.c=value`` strings to nested data (value parsed as YAML)."""
    data = _deep_merge({}, data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. algorithm.kl_coef=0.001")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: malformed key {key!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from None
        parts = key.split(".")
        node = data
        for depth, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[:depth + 1])}' is not a section")
            node = nxt
        node[parts[-1]] = value
        for depth in range(1, len(parts) + 1):  # so an error on any part of the key names it
            where.setdefault(".".join(parts[:depth]), f"override {item!r}")
        where[key] = f"override {item!r}"
    return data


def load_config(path: Optional[Union[str, Path, List[Union[str, Path]]]] = None,
                overrides: Optional[List[str]] = None) -> RunConfig:
    """Read ``path`` (with its ``_base_`` chain; a list of files is merged left to right, later
    files winning), apply ``overrides``, build and validate."""
    where: Dict[str, str] = {}
    paths = [] if not path else [path] if isinstance(path, (str, Path)) else list(path)
    data: Dict[str, Any] = {}
    for p in paths:
        data = _deep_merge(data, _read_yaml(Path(p), where))
    data = apply_overrides(data, list(overrides or []), where)
    return from_dict(data, where)


def dump_config(cfg: RunConfig, path: Union[str, Path]) -> None:
    """Write the resolved config (what actually ran) atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# Cross-field validation
# --------------------------------------------------------------------------------------------
def _positive(cfg: Any, prefix: str, names: List[str], allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"{prefix}.{name}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def validate(cfg: RunConfig) -> None:
    """Rules spanning fields; every error names the field."""
    from megatron_tepo.algorithms import losses  # algorithms are pure torch: no heavy imports
    from megatron_tepo.algorithms.correction import RolloutCorrection
    from megatron_tepo.algorithms.kl import kl_mask_needs_entropy_change

    alg = cfg.algorithm
    if alg.loss not in losses.POLICY_LOSSES:
        raise ConfigError(f"algorithm.loss: unknown loss {alg.loss!r}; "
                          f"valid: {', '.join(sorted(losses.POLICY_LOSSES))}")
    valid_args = losses.get_loss_defaults(alg.loss)
    for key in alg.loss_args:
        if key not in valid_args:
            raise ConfigError(f"algorithm.loss_args.{key}: not an argument of loss {alg.loss!r}; "
                              f"valid: {', '.join(sorted(valid_args)) or '(none)'}")
    for name in ("clip_low", "clip_high"):
        value = getattr(alg, name)
        if value is not None and value < 0:
            raise ConfigError(f"algorithm.{name}: must be >= 0, got {value!r}")
    if alg.entropy_adv_alpha < 0:
        raise ConfigError(f"algorithm.entropy_adv_alpha: must be >= 0, got {alg.entropy_adv_alpha!r}")
    if alg.entropy_adv_kappa <= 0:
        raise ConfigError(f"algorithm.entropy_adv_kappa: must be > 0, got {alg.entropy_adv_kappa!r}")
    if alg.kl_coef < 0:
        raise ConfigError(f"algorithm.kl_coef: must be >= 0, got {alg.kl_coef!r}")
    try:
        losses.PolicyLoss.from_config(alg)  # what the trainer builds, its RolloutCorrection included
    except ValueError as exc:
        # RolloutCorrection's messages start with its field's name: give them the section's path
        correction_keys = {f.name for f in dataclasses.fields(RolloutCorrection)}
        where = "algorithm.rollout_correction." if str(exc).split(" ", 1)[0] in correction_keys else "algorithm: "
        raise ConfigError(f"{where}{exc}") from None
    if alg.old_log_prob == "rollout":
        if alg.loss == "steer":
            raise ConfigError("algorithm.old_log_prob: 'rollout' gives no old-policy entropy, which loss 'steer' "
                              "needs; use old_log_prob: recompute")
        if alg.kl_coef and alg.delta_entropy == "measured" and kl_mask_needs_entropy_change(alg.kl_mask):
            raise ConfigError(f"algorithm.old_log_prob: 'rollout' gives no old-policy entropy, which kl_mask "
                              f"{alg.kl_mask!r} with delta_entropy 'measured' needs; set algorithm.delta_entropy: "
                              f"predicted (dH from the training pass's own entropy) or old_log_prob: recompute")
    _positive(cfg.advantage, "advantage", ["eps"], allow_zero=True)
    r = cfg.rollout
    _positive(r, "rollout", ["prompts_per_step", "n_samples", "max_prompt_len", "max_new_tokens",
                             "max_sampling_rounds", "temperature", "top_p"])
    if r.top_p > 1:
        raise ConfigError(f"rollout.top_p: must be in (0, 1], got {r.top_p!r}")
    o = cfg.optim
    _positive(o, "optim", ["lr"])
    _positive(o, "optim", ["min_lr", "lr_warmup_steps", "lr_warmup_init", "weight_decay", "clip_grad"],
              allow_zero=True)
    if o.lr_decay_steps is not None and o.lr_decay_steps <= o.lr_warmup_steps:
        raise ConfigError(f"optim.lr_decay_steps: must exceed optim.lr_warmup_steps "
                          f"({o.lr_warmup_steps}), got {o.lr_decay_steps}")
    t = cfg.train
    _positive(t, "train", ["steps", "mini_batch_prompts", "epochs_per_step"])
    _positive(t, "train", ["save_every", "eval_every", "keep_checkpoints"], allow_zero=True)
    if r.prompts_per_step % t.mini_batch_prompts:
        raise ConfigError(f"train.mini_batch_prompts: {t.mini_batch_prompts} must divide "
                          f"rollout.prompts_per_step ({r.prompts_per_step})")
    _positive(cfg.parallel, "parallel", ["tp", "pp", "ep", "cp"])
    if cfg.parallel.cp != 1:
        raise ConfigError(f"parallel.cp: context parallelism is not implemented yet; keep it 1, got {cfg.parallel.cp}")
    a = cfg.actor
    _positive(a, "actor", ["max_tokens_per_micro_batch", "recompute_num_layers"])
    if a.pack_sequences and a.attention == "unfused":
        raise ConfigError("actor.pack_sequences: packing needs actor.attention sdpa, te or auto (megatron's "
                          "unfused attention cannot keep packed sequences apart); set actor.pack_sequences: false "
                          "to use it")
    if a.sequence_parallel and cfg.parallel.tp == 1:
        raise ConfigError("actor.sequence_parallel: needs parallel.tp > 1")
    _positive(cfg.reward, "reward", ["workers", "timeout_s"])
    _positive(cfg.fault, "fault", ["probe_timeout_s"])
    _positive(cfg.fault, "fault", ["server_restarts", "restart_backoff_s", "server_return_timeout_s",
                                   "watchdog_generate_s", "watchdog_collective_s", "watchdog_sync_s",
                                   "max_steps_without_update", "inject_hang_at_step"], allow_zero=True)
    _positive(r, "rollout", ["request_timeout_s", "sync_bucket_mb", "drift_warn_mean", "drift_warn_max"])
    if r.sync_mode == "disk" and r.engine == "sglang" and not r.sync_dir:
        raise ConfigError("rollout.sync_dir: sync_mode 'disk' needs a directory the SGLang servers can read")
