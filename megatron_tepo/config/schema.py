"""The run configuration's schema: one dataclass per section of the YAML (:class:`RunConfig` holds
them), each field with its one default and a comment or docstring saying what it does; and
:class:`ConfigError`, the one error every configuration problem raises (its message names the
field and where it came from).

Left out: reading, converting and checking (``yaml_io``, ``loading``, ``validation``), and the
rules of the parallel layout (:mod:`megatron_tepo.layout`, whose :class:`ParallelLayout` is the
``parallel`` section).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Sequence, Union

from megatron_tepo.layout import ParallelLayout

__all__ = ["ConfigError", "RunConfig", "AlgorithmConfig", "RolloutCorrectionConfig", "AdvantageConfig",
           "RolloutConfig", "OptimConfig", "TrainConfig", "ParallelLayout", "ActorConfig", "ModelConfig",
           "DataConfig", "RewardConfig", "FaultConfig", "EnvironmentConfig", "LoraConfig", "LORA_TARGETS",
           "WATCHDOG_BACKSTOP_S", "PG_TIMEOUT_MARGIN_S",
           "UNWATCHED_PG_TIMEOUT_S"]


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
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"  # algorithms.KL_ESTIMATORS
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
    # one request's time limit; None: derived from max_new_tokens at decode_floor_tokens_per_s (+120 s
    # for the prompt, at least 600 s); a generation call's limit is its waves on the servers' slots x
    # that (time_limits.py). A set limit shorter than the longest answer needs is refused
    request_timeout_s: Optional[float] = None
    # the slowest decode a request may have (tokens/s of one sequence on a busy server): the time
    # limits above derive from it
    decode_floor_tokens_per_s: float = 20.0
    # dispatch over 2+ servers: sglang-router where the SGLang venv has it (auto), or least-loaded;
    # with actor.routing_replay: r3 always least-loaded (the router drops the routing field)
    router: Literal["auto", "sglang_router", "none"] = "auto"
    # see rollout/sglang/weight_sync/; ipc: colocated mode, each actor rank's bucket handed to the
    # server TP rank on its GPU (CUDA IPC; shared memory on CPU)
    sync_mode: Literal["distributed", "tensor", "disk", "ipc"] = "distributed"
    sync_bucket_mb: int = 256  # weight-sync bucket: the sender's extra memory is about two
    sync_keep_buffers: bool = True  # hold them between syncs (no re-allocation per push)
    sync_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # the servers' dtype (bytes on the wire)
    sync_dir: Optional[str] = None  # disk mode: a directory the servers see (shared file system)
    # distributed mode: the address the servers reach the trainer at (IP or host name; env
    # TEPO_SYNC_ADDRESS wins). None: this host's interface on the route to the first server.
    sync_address: Optional[str] = None
    # The age bound, in weight versions (one per step), of the tokens a step trains on. Without
    # partial rollout: 0, generation and training alternate; 1, one-step-off generation (the next
    # step's groups are generated, with the weights this step started from, while the actor trains
    # this step). With partial rollout any N >= 0: a sample older than N is regenerated.
    max_staleness: int = 0
    # Partial rollout (trainer/partial.py): the engine generates all the time, across steps; a
    # weight update interrupts the requests in flight, and they continue as prompt + partial
    # response under the new weights; each token keeps its log-prob and its weights' version.
    partial_rollout: bool = False
    # partial rollout: groups drawn and not yet trained on (generating or waiting); None: max(1, max_staleness)
    # x prompts_per_step, the most with none regenerated by the bound (trainer/partial.py)
    max_inflight_groups: Optional[int] = None
    # Colocated mode: the engine and the actor share the GPUs and take turns with the memory; each
    # step the engine releases its memory after generating, the actor comes back from host memory,
    # trains and offloads (actor.offload), and the engine takes its memory back around the weight
    # sync. (One-step-off generation needs both at once: refused.)
    colocated: bool = False
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


#: actor.offload's levels: the parts of the actor (megatron.model.OFFLOAD_PARTS) each one moves
OFFLOAD_LEVELS = {"none": (), "optimizer": ("optimizer",), "optimizer_grads": ("optimizer", "grads"),
                  "all": ("optimizer", "grads", "params")}


#: the linears ``actor.lora.target_modules`` can name (megatron's names): attention q/k/v (the fused
#: ``linear_qkv``) and o (``linear_proj``), the MLP's gate + up (the fused ``linear_fc1``) and down
#: (``linear_fc2``; on an MoE model every expert's too), a Gated DeltaNet's input projection (the
#: fused q/k/v/z/b/a ``in_proj``) and output projection (``out_proj``)
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")
#: the HF modules (PEFT's and SGLang's names) of each target of a dense model's layers; SGLang's LoRA
#: serves none of an MoE expert's or a Gated DeltaNet's (``actor.lora.sync: adapters`` refuses them:
#: megatron/lora.py:lora_model_problem)
LORA_HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                   "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",), "in_proj": (), "out_proj": ()}
#: how ``actor.lora`` reaches the rollout engines (:attr:`LoraConfig.sync`)
LORA_SYNCS = ("merged", "adapters")


@dataclass
class LoraConfig:
    """LoRA adapters on the actor's linears (megatron/lora.py): each target linear's output gains
    ``(alpha / rank) * B A x``, A ``[rank, in]`` drawn at random, B ``[out, rank]`` zero (step 0
    equals the base model); the base weights are frozen and only A and B train. ``dropout``: on
    the adapter's input only. ``target_modules``: some of :data:`LORA_TARGETS`.
    ``init_from``: a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) a
    fresh run starts from instead of B = 0 (its r and lora_alpha must be ``rank`` and ``alpha``;
    megatron/lora_peft.py); a resumed run takes its checkpoint's adapters. ``sync``: how the rollout
    engines get the policy -- ``merged`` (``W + scale * B A``, through every weight sync mode and
    the embedded engine) or ``adapters`` (the adapters alone, to SGLang's LoRA endpoints; the
    servers apply them to their frozen base: docs/ACTOR.md, "LoRA")."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    init_from: Optional[str] = None
    sync: Literal["merged", "adapters"] = "merged"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


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
    * ``sequence_parallel``: megatron's sequence parallelism (needs TP > 1; an MoE layer at TP > 1 needs
      it; without Transformer Engine the local spec's torch norms run it: megatron/spec.py).
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
    * ``offload``: colocated mode (``rollout.colocated``) only: what the actor moves to host memory
      while the engine generates (:data:`OFFLOAD_LEVELS`): ``optimizer`` (Adam's states and the
      fp32 main parameters), ``optimizer_grads`` (and the gradient buffers), ``all`` (and the
      parameters, after the weight sync); ``auto`` -- ``all`` in colocated mode (the launcher
      passes the least that fits, from the fit check), ``none`` otherwise.
    * ``routing_replay``: MoE routing replay (a dense model refuses anything but ``off``).
      ``r3`` -- the old-log-prob pass and every training pass route each token to the experts
      the rollout engine routed it to (``RolloutBatch.routed_experts``, returned by the engine);
      ``r2`` -- the old-log-prob pass records the actor's own routing and the training passes
      replay it; ``off`` -- the routers route freely and nothing of replay is built. The
      router's probabilities over the replayed experts still come from its current logits (it
      keeps its gradient). Each pass logs ``routing_mismatch_mean`` / ``routing_mismatch_max``
      (tokens whose unforced routing differs, per layer) and ``routing_coverage`` (must be 1).
    * ``lm_head``: how log-probs and entropy come from the last stage's hidden states, at the
      positions that score a response token only (megatron/lm_head.py). ``fused`` -- in
      vocabulary blocks, never holding the ``[tokens, V/tp]`` logits or their gradient
      (ops/lm_head.py); ``materialized`` -- those positions' logits, then the vocab op (for
      bisecting).
    * ``model_builder``: which megatron-core model the actor builds (megatron/model.py says it once
      in the log). ``hybrid`` -- ``HybridModel`` (megatron-core >= 0.18; its stack holds each HF
      decoder layer as a token-mixer layer and an MLP layer, megatron/hybrid.py; needed by
      Gated DeltaNet models such as Qwen3.5); ``gpt`` -- ``GPTModel`` (deprecated from
      megatron-core 0.19 on); ``auto`` -- hybrid wherever megatron-core has it, gpt on the oldest
      stack. Both compute the same thing bit for bit for the GPT-shaped families; a checkpoint is
      resumed by the builder that wrote it.
    * ``lora``: train LoRA adapters on a frozen base (:class:`LoraConfig`; docs/ACTOR.md, "LoRA");
      unset (null): every parameter trains, nothing of LoRA is built.
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
    offload: Literal["auto", "none", "optimizer", "optimizer_grads", "all"] = "auto"
    routing_replay: Literal["off", "r2", "r3"] = "off"
    lm_head: Literal["fused", "materialized"] = "fused"
    model_builder: Literal["auto", "hybrid", "gpt"] = "auto"
    lora: Optional[LoraConfig] = None  # None: a full-parameter run

    def offload_parts(self, colocated: bool) -> tuple:
        """The parts of the actor that ``offload`` moves (``auto`` decided by ``colocated``)."""
        level = ("all" if colocated else "none") if self.offload == "auto" else self.offload
        return OFFLOAD_LEVELS[level]


@dataclass
class ModelConfig:
    path: str = ""  # Hugging Face checkpoint directory (config.json, weights, tokenizer)


@dataclass
class DataConfig:
    """Prompt files (JSONL or Parquet; plain ``{prompt, answer}`` or the DAPO-Math form)."""

    def template_kwargs(self, default_tools: Sequence[Dict[str, Any]] = ()) -> Dict[str, Any]:
        """The chat template's arguments: ``tools=`` (``tools``, else ``default_tools``: the
        environment's own, ``config/validation.py:template_kwargs``; none when both are empty) and
        ``chat_template_kwargs``."""
        tools = list(self.tools) or list(default_tools)
        return {**({"tools": tools} if tools else {}), **dict(self.chat_template_kwargs)}

    train_files: List[str] = field(default_factory=list)
    eval_files: List[str] = field(default_factory=list)
    apply_chat_template: bool = True
    on_bad_row: Literal["error", "skip"] = "error"  # skip: count and report malformed rows
    # the tools the chat template shows the model (JSON schemas, its tools= argument) and the template's other
    # arguments (e.g. enable_thinking: false); the prompts, the episodes' turn boundaries and the comparator
    # all render with them
    tools: List[Dict[str, Any]] = field(default_factory=list)
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    """How responses are scored. math_verify: the last \\boxed{} of each response against the
    answer with math-verify, in a process pool; exact_match: the decoded response, stripped, equals
    the answer (toy tasks such as tools/make_tiny_model.py's)."""

    kind: Literal["math_verify", "exact_match"] = "math_verify"
    # a user's reward by import path, 'my_pkg.my_module:score' or 'path/to/file.py:score'
    # (megatron_tepo/rewards/custom.py: its signature; docs/TASKS.md); when set it replaces kind
    function: str = ""
    workers: int = 2
    timeout_s: float = 5.0  # per answer; a time-out is reward 0 and is counted


@dataclass
class EnvironmentConfig:
    """Multi-turn episodes (docs/ROLLOUT.md, "Multi-turn episodes"): the environment the model talks to
    between its turns. ``none``: every rollout is one turn (the model's response, all of it trained).
    ``python``: the model's turns may end on a Python tool call (``format``: a fenced ```python block,
    or Qwen3's ``<tool_call>``), run in ``sandbox``; the model reads back its output as the chat
    template's tool turn (not trained) and goes on, until a turn calls nothing (its final answer) or a
    limit is reached."""

    # a shipped environment by name, or a user's class by import path ('my_pkg.my_module:MyEnv',
    # 'path/to/file.py:MyEnv'; megatron_tepo/environments/base.py: what it implements), built with args
    name: Union[Literal["none", "python", "python_session", "code_tests", "guess_number"], str] = "none"
    args: Dict[str, Any] = field(default_factory=dict)
    format: Literal["fenced", "qwen3"] = "fenced"
    # tool calls a turn may make (the rest are not run, and the model is told); None: no cap
    max_calls_per_turn: Optional[int] = None
    # a call the sandbox itself failed (never the model's doing): drop_group (the episode's group is not
    # trained on; tool_sandbox_failures counts it) or fail (the step fails, naming it)
    on_sandbox_failure: Literal["drop_group", "fail"] = "drop_group"
    max_turns: int = 4  # model turns per episode; past it the episode ends (finish: length)
    # a turn's tokens at most (the environment then answers it as it stands); None: the episode's budget
    # (rollout.max_new_tokens counts every token of the episode: the model's and the environment's)
    max_turn_tokens: Optional[int] = None
    tool_workers: int = 8  # tool calls that run at once (the bounded pool; the engine never waits for them)
    # the sandbox's settings (megatron_tepo/environments/settings.py:SandboxConfig: kind bubblewrap | remote |
    # none, wall_seconds, cpu_seconds, memory_mb, processes, output_bytes, shown_bytes, ...)
    sandbox: Dict[str, Any] = field(default_factory=dict)


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
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    notes: str = ""  # free text: where a setting comes from
