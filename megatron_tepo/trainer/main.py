"""Train on real prompt files: the run config's model, data and reward wired into the RL loop.

``python tools/train.py --config METHOD.yaml --config MODEL.yaml [override ...]`` (one process) or
``torchrun --nproc-per-node N tools/train.py ...`` (a TP / PP / DP actor) loads the HF checkpoint at
``model.path`` (weights + tokenizer) into the Megatron actor and the rollout engine
(``rollout.engine``, built by the engine registry :mod:`megatron_tepo.rollout.registry`:
``embedded``, an in-process HF model, or ``sglang``, a fleet of SGLang servers
attached by URL from ``TEPO_SGLANG_URLS`` / ``rollout.sglang_urls``, kept in sync after every update by
``rollout.sync_mode``; in ``distributed`` mode the servers connect back to ``TEPO_SYNC_ADDRESS`` /
``rollout.sync_address``, by default this host's interface on the route to the first server; the
servers' API key comes from ``TEPO_SGLANG_API_KEY``). Global rank 0 drives (generates, scores, evaluates, logs; see
:class:`~megatron_tepo.trainer.driver.Driver`); every rank runs the actor. It reads ``data.train_files`` / ``data.eval_files`` through the tokenizer's chat template
(over-long prompts dropped and counted; malformed rows an error naming file and line, or skipped
and counted with ``data.on_bad_row: skip``), scores responses (``reward.kind``: math-verify in a
process pool, or exact match), and runs :func:`megatron_tepo.trainer.loop.train` with checkpoints and resume under
``train.output_dir``.

Left out: a reference policy (``algorithm.kl_target: ref``) and launching SGLang servers from here
(the Slurm launchers and tests start them; this attaches).
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import List, Optional

import torch

from megatron_tepo.config import RunConfig, dump_config, load_config
from megatron_tepo.trainer.stalls import NoUpdateError, no_update_cause  # noqa: F401 -- (imported from here too)


def build_task(cfg: RunConfig, tokenizer, pool):
    from megatron_tepo.config.validation import template_kwargs
    from megatron_tepo.data import load_prompts
    from megatron_tepo.rewards import token_reward
    from megatron_tepo.rewards.custom import function_reward
    from megatron_tepo.trainer.rollouts import Task

    if not cfg.data.train_files:
        raise ValueError("data.train_files: no training prompt files given")
    kw = dict(max_prompt_len=cfg.rollout.max_prompt_len, apply_chat_template=cfg.data.apply_chat_template,
              on_bad_row=cfg.data.on_bad_row, require_answer=not cfg.reward.function,
              template_kwargs=template_kwargs(cfg))
    train = load_prompts(cfg.data.train_files, tokenizer, **kw)
    evals = load_prompts(cfg.data.eval_files, tokenizer, **kw) if cfg.data.eval_files else None
    if not train.records:
        raise ValueError(f"data.train_files: no usable prompts in {cfg.data.train_files} "
                         f"({train.num_too_long} too long, {train.num_bad_rows} malformed)")
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop[0] if stop else 0)
    reward = (function_reward(cfg.reward.function, tokenizer, pool) if cfg.reward.function
              else token_reward(cfg.reward.kind, tokenizer, pool))
    task = Task([r.input_ids for r in train.records], [r.answer for r in train.records],
                reward, stop, pad,
                [r.input_ids for r in evals.records] if evals else None,
                [r.answer for r in evals.records] if evals else None,
                [r.row for r in train.records], [r.row for r in evals.records] if evals else None)
    data_stats = {"train_prompts": len(train), "train_too_long": train.num_too_long,
                  "train_bad_rows": train.num_bad_rows}
    return task, data_stats


def reward_pool(cfg: RunConfig):
    """The reward's process pool: math-verify's, or the user's ``reward.function`` in it (its
    time-outs, errors and counts as math-verify's)."""
    from megatron_tepo.rewards import MathRewardPool
    from megatron_tepo.rewards.custom import ImportedReward

    if cfg.reward.function:
        return MathRewardPool(cfg.reward.workers, cfg.reward.timeout_s, reward_fn=ImportedReward(cfg.reward.function))
    return MathRewardPool(cfg.reward.workers, cfg.reward.timeout_s)


def build_engine(cfg: RunConfig, model_dir: str, pad_token_id: int, driver: bool = True):
    """The rollout engine of ``rollout.engine`` (from the engine registry,
    :mod:`megatron_tepo.rollout.registry`) on the driver, running multi-turn episodes when the run
    config names an ``environment`` (:func:`~megatron_tepo.rollout.episode.with_environment`); a
    :class:`~megatron_tepo.trainer.driver.FollowerEngine` (weight-sync side only) on other ranks."""
    from megatron_tepo.rollout.registry import EngineSettings, engine_factory
    from megatron_tepo.trainer.driver import FollowerEngine

    factory = engine_factory(cfg.rollout.engine)
    routing = None
    if cfg.actor.routing_replay == "r3":  # the routing contract: the model family's config says it
        from megatron_tepo.models import routing_shape_of

        routing = routing_shape_of(model_dir)
        if routing is None:
            raise ValueError(f"actor.routing_replay: r3: {model_dir} is a dense model, with no routing to replay")
    settings = EngineSettings(cfg.rollout, model_dir, pad_token_id, cfg.train.seed, cfg.fault, routing=routing,
                              lora_adapters=cfg.actor.lora is not None and cfg.actor.lora.sync == "adapters")
    if not driver:
        return FollowerEngine(factory.follower_sync(settings))
    engine = factory.build(settings)
    if cfg.environment.name == "none":
        return engine
    from transformers import AutoTokenizer

    from megatron_tepo.config.validation import sandbox_settings, template_kwargs
    from megatron_tepo.rollout.episode import with_environment

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:  # multi-turn episodes: the engine runs each turn, the environment answers between them
        return with_environment(engine, cfg.environment, sandbox_settings(cfg), tokenizer, tokenizer.eos_token_id,
                                template_kwargs(cfg))
    except BaseException:
        engine.close()
        raise


def check_environment(cfg: RunConfig) -> None:
    """A run whose ``environment`` calls a tool: its sandbox is made once and runs ``print(1)``
    (:func:`~megatron_tepo.environments.choice.check_sandbox`), before anything expensive starts; one
    that cannot start is a :class:`~megatron_tepo.environments.sandbox.SandboxUnavailable`, a user error
    (exit 2, no requeue). Nothing without an environment, or for one that runs no code (its
    constructor takes no sandbox: :func:`~megatron_tepo.environments.choice.uses_sandbox`)."""
    from megatron_tepo.config.validation import sandbox_settings
    from megatron_tepo.environments.choice import check_sandbox, uses_sandbox

    if not uses_sandbox(cfg.environment.name):
        return

    print(f"[megatron_tepo] {check_sandbox(sandbox_settings(cfg), 'environment.sandbox')}", flush=True)


def build_actor_and_engine(cfg: RunConfig, model_dir: str, pad_token_id: int):
    """The policy (every rank: the ``megatron`` backend of :func:`~megatron_tepo.trainer.policy.build_policy`)
    and the rollout engine (the driver, global rank 0; a follower that only takes part in the
    weight sync on the others), both loaded from the HF checkpoint ``model_dir`` with ``cfg``'s
    layout, actor settings (``cfg.actor``), optimizer and seed. Outside torchrun it starts a
    one-process gloo world."""
    from megatron_tepo.net import single_process_env
    from megatron_tepo.trainer.policy import build_policy

    single_process_env()
    actor = build_policy("megatron", cfg, model_dir)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    engine = build_engine(cfg, model_dir, pad_token_id, driver=rank == 0)
    return actor, engine


def check_resume(cfg: RunConfig, latest: Optional[Path]) -> None:
    """Refuse a resumed run whose settings differ from its newest checkpoint's (one line listing
    the changed keys), unless ``train.allow_config_change``; what ``RESUME_MAY_CHANGE`` lists may
    always change."""
    from megatron_tepo.config import RESUME_MAY_CHANGE, ConfigError, changed_settings, to_dict

    if latest is None or not (latest / RUN_CONFIG).is_file():
        return
    import yaml

    saved = yaml.safe_load((latest / RUN_CONFIG).read_text()) or {}
    changed = {k: v for k, v in changed_settings(saved, to_dict(cfg), defaults=to_dict(RunConfig())).items()
               if not any(k == m or k.startswith(m + ".") for m in RESUME_MAY_CHANGE)}
    if changed and not cfg.train.allow_config_change:
        listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in changed.items()))
        raise ConfigError(f"train.resume: {latest} was saved with other settings ({listed}); to continue with "
                          f"the new ones set train.allow_config_change=true, or start a new train.output_dir")


RUN_CONFIG = "run_config.yaml"  # in each trainer checkpoint: the settings it was trained with


def main(config_files: List[str], overrides: Optional[List[str]] = None) -> dict:
    cfg = load_config(config_files, overrides)
    if not cfg.model.path:
        raise ValueError("model.path: the Hugging Face checkpoint to train is not set")
    if not (Path(cfg.model.path) / "config.json").is_file():
        raise ValueError(f"model.path: {cfg.model.path} is not a Hugging Face model folder (no config.json)")
    from transformers import AutoTokenizer

    from megatron_tepo.checkpoint.store import find_latest_checkpoint
    from megatron_tepo.metrics import MetricsLogger
    from megatron_tepo.rewards import COUNT_NAMES
    from megatron_tepo.trainer.loop import evaluate, train

    from megatron_tepo.rollout.registry import engine_factory

    driver = int(os.environ.get("RANK", "0")) == 0
    if driver:
        engine_factory(cfg.rollout.engine).check(cfg.rollout)  # fail before the actor is built
        check_environment(cfg)  # the tool's sandbox too (the episodes run on the driver)
    out = Path(cfg.train.output_dir)
    ckpt_root = out / "checkpoints"
    latest = find_latest_checkpoint(ckpt_root) if cfg.train.resume else None
    if not cfg.train.resume and find_latest_checkpoint(ckpt_root) is not None:
        raise ValueError(f"train.resume: false, but {ckpt_root} holds checkpoints of an earlier run; "
                         f"use a new train.output_dir (or remove them) to start over")
    check_resume(cfg, latest)
    if driver:
        out.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out / "config.yaml")  # (after the checks: it is what runs)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    torch.manual_seed(cfg.train.seed)
    scoring = driver and (cfg.reward.kind == "math_verify" or bool(cfg.reward.function))
    with (reward_pool(cfg) if scoring else contextlib.nullcontext()) as pool:
        task, data_stats = build_task(cfg, tokenizer, pool)
        actor, engine = build_actor_and_engine(cfg, cfg.model.path, task.pad_token_id)
        if cfg.train.allow_config_change:
            actor.prefer_settings_over_checkpoint()  # the new optim.* win over the checkpoint's
        if driver:
            print(f"[train] world {int(os.environ.get('WORLD_SIZE', '1'))}, engine {cfg.rollout.engine}, "
                  f"output {out}", flush=True)

        def eval_fn():
            if not task.eval_prompts:
                return {}
            return {f"eval/{k}": v for k, v in evaluate(engine, task.eval_prompts, task.eval_answers, task.reward_fn,
                                                           task.stop_token_ids, max_new_tokens=cfg.rollout.max_new_tokens,
                                                           rows=task.eval_rows).items()}

        def on_step(step, metrics):
            if metrics.get("updates", 1.0) == 0:
                print(f"[step {step}/{cfg.train.steps}] NO UPDATE: "
                      f"{no_update_cause(metrics, cfg.rollout.n_samples)}", flush=True)
                return
            print(f"[step {step}/{cfg.train.steps}] reward {metrics['reward_mean']:.3f} "
                  f"loss {metrics.get('loss', float('nan')):.4f} grad_norm {metrics.get('grad_norm', 0):.3f}", flush=True)

        def checkpoint_files(tmp: Path) -> None:  # what makes a trainer checkpoint resumable-checked and convertible
            dump_config(cfg, tmp / RUN_CONFIG)
            actor.write_conversion_files(tmp, cfg.model.path)

        def report(line: str) -> None:
            print(f"[train] {line}", flush=True)

        logger = MetricsLogger(out / "metrics.jsonl") if driver else None
        state: dict = {}
        try:
            history = train(cfg, actor, engine, task, logger=logger, on_step=on_step, eval_fn=eval_fn,
                            checkpoint_root=ckpt_root, extra_state=state, checkpoint_files=checkpoint_files,
                            report=report)
            updates = sum(m.get("updates", 0.0) for m in history)
            exported = None
            if cfg.train.export_hf and (history or state.get("resumed_from")):
                exported = actor.export_hf(out / "hf", cfg.model.path)
                if cfg.actor.lora is not None:  # beside the merged model: the adapters as a PEFT adapter folder
                    actor.export_peft(out / "peft", cfg.model.path)
        finally:
            if logger is not None:
                logger.close()
            if engine is not None:
                engine.close()
    counts = {k: sum(m.get(k, 0) for m in history) for k in COUNT_NAMES}  # the rollouts' of the steps run here
    summary = {**data_stats, **counts, "steps_run": len(history), "updates": int(updates),
               "steps_without_update": sum(1 for m in history if m.get("updates", 0.0) == 0),
               "resumed_from": state.get("resumed_from"),
               "last_checkpoint": str(find_latest_checkpoint(ckpt_root)) if find_latest_checkpoint(ckpt_root) else None,
               "exported_hf": str(exported) if exported else None}
    if driver:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if exported:
            print(f"[train] policy exported as a Hugging Face model: {exported}", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if history and updates == 0:
        raise NoUpdateError(f"no update in {len(history)} step(s): the policy did not change "
                            f"({no_update_cause(history[-1], cfg.rollout.n_samples)}); see {out / 'metrics.jsonl'}")
    return summary
