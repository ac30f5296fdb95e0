"""The rules that span fields of a :class:`~megatron_tepo.config.schema.RunConfig`; every error is a
:class:`~megatron_tepo.config.schema.ConfigError` naming the field. Each rule is written once: the
layout's through :func:`megatron_tepo.layout.validate_layout` (the model- and world-independent
part), the loss's through the loss registry, the actor's packing rule through
:func:`packing_problem`, which the actor's plan asks too.

Left out: rules that need the model or the world size (the actor's plan and the fit check run
``validate_layout`` with them), and the types of single fields (``loading`` coerces them).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List

from megatron_tepo.config.schema import LORA_SYNCS, LORA_TARGETS, ActorConfig, ConfigError, RunConfig
from megatron_tepo.layout import LayoutError, validate_layout

__all__ = ["validate", "packing_problem", "lora_problem", "ROUTING_ENGINES"]

#: the rollout engines that return each token's routed experts (``Sample.routed_experts``), which
#: ``actor.routing_replay: r3`` replays (the SGLang fleet asks its servers for them:
#: rollout/sglang/routing.py, directly, never through sglang-router, which drops the request's field;
#: the servers need --enable-return-routed-experts, SGLang >= 0.5.7: rollout/sglang/versions.py)
ROUTING_ENGINES = ("embedded", "sglang")


def packing_problem(actor: ActorConfig) -> str:
    """Why ``actor``'s settings cannot pack sequences, or "" (the rule of the config and of the
    actor's plan, which asks it again once ``auto`` is decided)."""
    if actor.pack_sequences and actor.attention == "unfused":
        return ("actor.pack_sequences=true needs actor.attention sdpa or te (megatron's unfused attention cannot "
                "keep packed sequences apart); set actor.pack_sequences: false to use it")
    return ""


def lora_problem(actor: ActorConfig) -> str:
    """Why ``actor.lora`` cannot be built, or "" (the rule of the config and of the actor's plan,
    which asks it again once ``attention: auto`` is decided)."""
    lora = actor.lora
    if lora is None:
        return ""
    if lora.rank <= 0:
        return f"actor.lora.rank: must be > 0, got {lora.rank!r}"
    if lora.alpha <= 0:
        return f"actor.lora.alpha: must be > 0, got {lora.alpha!r}"
    if not 0.0 <= lora.dropout < 1.0:
        return f"actor.lora.dropout: must be in [0, 1), got {lora.dropout!r}"
    if actor.attention == "te":
        return ("actor.lora: adapters go on megatron's local linears, and actor.attention te builds Transformer "
                "Engine's (their layernorm-fused linears are not adapted yet); set actor.attention: sdpa")
    unknown = [t for t in lora.target_modules if t not in LORA_TARGETS]
    if unknown or not lora.target_modules:
        return (f"actor.lora.target_modules: {unknown or 'empty'}: choose from {', '.join(LORA_TARGETS)} "
                f"(q/k/v are the fused linear_qkv, gate/up the fused linear_fc1)")
    if lora.sync not in LORA_SYNCS:
        return f"actor.lora.sync: {lora.sync!r}: choose from {', '.join(LORA_SYNCS)}"
    return ""


def _positive(cfg: Any, prefix: str, names: List[str], allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"{prefix}.{name}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def template_kwargs(cfg: RunConfig) -> Dict[str, Any]:
    """The chat template's arguments every rendering of the run uses (the prompts, the episodes' turn
    boundaries, the comparator): ``data.tools``, else the environment's own tools
    (:meth:`~megatron_tepo.environments.base.Environment.tool_schemas`: the Python tool's in Qwen3's
    ``<tool_call>`` format), and ``data.chat_template_kwargs``."""
    default_tools: list = []
    if cfg.environment.name != "none":
        from megatron_tepo.environments.choice import environment_class

        default_tools = environment_class(cfg.environment.name).tool_schemas(cfg.environment.format)
    return cfg.data.template_kwargs(default_tools)


def sandbox_settings(cfg: RunConfig):
    """``environment.sandbox`` as the sandbox's typed settings, checked (ConfigError naming the field)."""
    from megatron_tepo.environments.settings import SandboxConfig

    raw = dict(cfg.environment.sandbox)
    if "ro_binds" in raw:
        raw["ro_binds"] = tuple(raw["ro_binds"] or ())
    try:
        return SandboxConfig(**raw).check("environment.sandbox")
    except TypeError as exc:
        known = sorted(f.name for f in dataclasses.fields(SandboxConfig))
        unknown = sorted(set(raw) - set(known))
        raise ConfigError(f"environment.sandbox: unknown key(s) {unknown} (valid keys: {', '.join(known)})") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def episode_turns(cfg: RunConfig):
    """(the turns an episode may take, a tool call's wall time): (1, 0) without an environment (the
    time limits of a sampling round: megatron_tepo/time_limits.py)."""
    if cfg.environment.name == "none":
        return 1, 0.0
    return cfg.environment.max_turns, float(sandbox_settings(cfg).wall_seconds)


def _check_environment(cfg: RunConfig) -> None:
    e = cfg.environment
    _positive(e, "environment", ["max_turns", "tool_workers"])
    if e.max_turn_tokens is not None:
        _positive(e, "environment", ["max_turn_tokens"])
    if e.max_calls_per_turn is not None:
        _positive(e, "environment", ["max_calls_per_turn"])
    sandbox_settings(cfg)
    if e.name == "none":
        return
    from megatron_tepo.environments.choice import environment_class

    try:  # a shipped name, or a user's class by import path: found and an Environment
        environment_class(e.name, "environment.name")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    # (actor.routing_replay: r3 works with episodes: the final turn's request covers the whole sequence,
    # rollout/episode.py; with partial rollout it is refused in validate, as for one-turn samples)


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
    a = cfg.actor
    try:  # the layout's rules that need neither the model nor the world: the one rule set's
        validate_layout(cfg.parallel, None, None, sequence_parallel=a.sequence_parallel,
                        pack_sequences=a.pack_sequences)
    except LayoutError as exc:
        field, why = exc.problems[0] if exc.problems else ("parallel", str(exc))
        raise ConfigError(f"{field}: {why}") from None
    _positive(a, "actor", ["max_tokens_per_micro_batch", "recompute_num_layers"])
    problem = packing_problem(a) or lora_problem(a)
    if problem:
        raise ConfigError(problem)
    if a.lora is not None and a.lora.sync == "adapters" and r.engine != "sglang":
        raise ConfigError(f"actor.lora.sync: adapters goes to SGLang's LoRA endpoints; rollout.engine {r.engine!r} "
                          f"takes the merged weights (set actor.lora.sync: merged)")
    if a.lora is not None and a.lora.init_from and not os.path.isdir(os.path.expanduser(a.lora.init_from)):
        raise ConfigError(f"actor.lora.init_from: {a.lora.init_from!r} is not a directory (a PEFT adapter folder)")
    if a.routing_replay == "r3" and r.engine not in ROUTING_ENGINES:
        raise ConfigError(f"actor.routing_replay: r3 replays the engine's routing, which rollout.engine "
                          f"{r.engine!r} does not return (engines that do: {', '.join(ROUTING_ENGINES)}); use r2 or off")
    if a.routing_replay == "r3" and r.engine == "sglang" and r.router == "sglang_router":
        raise ConfigError("rollout.router: sglang_router drops return_routed_experts from the requests it forwards "
                          "(sglang-router 0.3.2), which actor.routing_replay: r3 asks for; set rollout.router: auto "
                          "(r3's requests go to the servers directly) or none")
    if a.routing_replay == "r2" and cfg.algorithm.old_log_prob == "rollout":
        raise ConfigError("actor.routing_replay: r2 records the routing in the actor's old-log-prob pass, which "
                          "algorithm.old_log_prob: rollout skips; use r3 or old_log_prob: recompute")
    _check_environment(cfg)
    _positive(cfg.reward, "reward", ["workers", "timeout_s"])
    if cfg.reward.function:
        from megatron_tepo.environments.user_code import load_object

        try:
            fn = load_object(cfg.reward.function, "reward.function")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not callable(fn):
            raise ConfigError(f"reward.function: {cfg.reward.function!r} is not callable")
    _positive(cfg.fault, "fault", ["probe_timeout_s"])
    _positive(cfg.fault, "fault", ["server_restarts", "restart_backoff_s", "server_return_timeout_s",
                                   "watchdog_generate_s", "watchdog_collective_s", "watchdog_sync_s",
                                   "max_steps_without_update", "inject_hang_at_step"], allow_zero=True)
    _positive(r, "rollout", ["sync_bucket_mb", "drift_warn_mean", "drift_warn_max", "decode_floor_tokens_per_s"])
    if r.request_timeout_s is not None:
        _positive(r, "rollout", ["request_timeout_s"])
        from megatron_tepo.time_limits import check_request_limit

        too_short = check_request_limit(r)
        if too_short:
            raise ConfigError(too_short)
    if isinstance(r.max_staleness, bool) or not isinstance(r.max_staleness, int) or r.max_staleness < 0:
        raise ConfigError(f"rollout.max_staleness: expected an integer >= 0, found {r.max_staleness!r}")
    if r.max_staleness > 1 and not r.partial_rollout:
        raise ConfigError(f"rollout.max_staleness: {r.max_staleness} needs rollout.partial_rollout: true (without it "
                          f"0 alternates generation and training, 1 generates one step off)")
    if r.partial_rollout and r.colocated:
        raise ConfigError("rollout.partial_rollout: the engine generates while the actor trains, and rollout.colocated "
                          "takes turns with the GPUs; set partial_rollout: false")
    if r.partial_rollout and a.routing_replay == "r3":
        raise ConfigError("rollout.partial_rollout: an interrupted request's routing is not returned (a "
                          "multi-turn episode's turn included), which actor.routing_replay: r3 replays; use r2 or "
                          "partial_rollout: false")
    if r.max_inflight_groups is not None and r.max_inflight_groups < r.prompts_per_step:
        raise ConfigError(f"rollout.max_inflight_groups: {r.max_inflight_groups} is fewer than rollout.prompts_per_step "
                          f"({r.prompts_per_step}): a step could never find its groups")
    if r.colocated and r.max_staleness:
        raise ConfigError("rollout.max_staleness: one-step-off generation needs the engine and the actor on the "
                          "GPUs at once, which rollout.colocated takes turns with; set max_staleness: 0")
    if not r.colocated and a.offload not in ("auto", "none"):
        raise ConfigError(f"actor.offload: {a.offload!r} moves the actor out of the GPUs while the engine "
                          f"generates, which only rollout.colocated does; set rollout.colocated: true or offload: none")
    if r.sync_mode == "ipc" and cfg.parallel.pp > 1:
        raise ConfigError("rollout.sync_mode: 'ipc' hands each rank's buckets to the server on its GPU, and with "
                          f"parallel.pp={cfg.parallel.pp} a rank holds only its stage's; use distributed or tensor")
    if r.sync_mode == "disk" and r.engine == "sglang" and not r.sync_dir:
        raise ConfigError("rollout.sync_dir: sync_mode 'disk' needs a directory the SGLang servers can read")
