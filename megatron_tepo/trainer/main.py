"""Train on real prompt files: the run config's model, data and reward wired into the RL loop.

``python tools/train.py --config METHOD.yaml --config MODEL.yaml [override ...]`` loads the HF
checkpoint at ``model.path`` (weights + tokenizer) into the Megatron actor and the embedded rollout
engine, reads ``data.train_files`` / ``data.eval_files`` through the tokenizer's chat template
(over-long prompts dropped and counted; malformed rows an error naming file and line, or skipped
and counted with ``data.on_bad_row: skip``), scores responses with math-verify in a process pool
(``reward``), and runs :func:`megatron_tepo.trainer.loop.train` with checkpoints and resume under
``train.output_dir``.

Left out (next steps on the launcher issue): more than one process (a TP/PP actor needs the
rollouts generated once and broadcast, and the SGLang fleet as engine), and a reference policy.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import torch

from megatron_tepo.config import RunConfig, dump_config, load_config


def build_task(cfg: RunConfig, tokenizer, pool):
    from megatron_tepo.data import load_prompts
    from megatron_tepo.trainer.loop import Task

    if not cfg.data.train_files:
        raise ValueError("data.train_files: no training prompt files given")
    kw = dict(max_prompt_len=cfg.rollout.max_prompt_len, apply_chat_template=cfg.data.apply_chat_template,
              on_bad_row=cfg.data.on_bad_row)
    train = load_prompts(cfg.data.train_files, tokenizer, **kw)
    evals = load_prompts(cfg.data.eval_files, tokenizer, **kw) if cfg.data.eval_files else None
    if not train.records:
        raise ValueError(f"data.train_files: no usable prompts in {cfg.data.train_files} "
                         f"({train.num_too_long} too long, {train.num_bad_rows} malformed)")
    counters = {"reward_timeouts": 0, "reward_errors": 0, "reward_no_answer": 0}

    def reward_fn(responses: List[List[int]], answers: List[str]) -> List[float]:
        res = pool.score([tokenizer.decode(r, skip_special_tokens=True) for r in responses], answers)
        counters["reward_timeouts"] += res.num_timeouts
        counters["reward_errors"] += res.num_errors
        counters["reward_no_answer"] += res.num_no_answer
        return res.rewards

    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop[0] if stop else 0)
    task = Task([r.input_ids for r in train.records], [r.answer for r in train.records], reward_fn, stop, pad,
                [r.input_ids for r in evals.records] if evals else None,
                [r.answer for r in evals.records] if evals else None)
    data_stats = {"train_prompts": len(train), "train_too_long": train.num_too_long,
                  "train_bad_rows": train.num_bad_rows}
    return task, counters, data_stats


def build_actor_and_engine(cfg: RunConfig, model_dir: str, pad_token_id: int):
    """The Megatron actor and the embedded rollout engine, both loaded from the HF checkpoint
    ``model_dir`` with ``cfg``'s layout, optimizer and seed (one process; starts its gloo world)."""
    from transformers import AutoModelForCausalLM

    from megatron_tepo.actor import MegatronActor, ParallelLayout
    from megatron_tepo.actor.parallel import single_process_env
    from megatron_tepo.rollout.embedded import EmbeddedEngine

    single_process_env()
    updates_per_step = cfg.train.epochs_per_step * (cfg.rollout.prompts_per_step // cfg.train.mini_batch_prompts)
    actor = MegatronActor(model_dir, hf_weights=model_dir,
                          layout=ParallelLayout(tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep),
                          optim=cfg.optim, max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
                          seed=cfg.train.seed, total_steps=cfg.train.steps * updates_per_step)
    engine = EmbeddedEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                            seed=cfg.train.seed, pad_token_id=pad_token_id)
    return actor, engine


def main(config_files: List[str], overrides: Optional[List[str]] = None) -> dict:
    cfg = load_config(config_files, overrides)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise NotImplementedError("tools/train.py runs in one process for now (WORLD_SIZE > 1 needs rollouts "
                                  "broadcast across ranks; see the module docstring)")
    if not cfg.model.path:
        raise ValueError("model.path: the Hugging Face checkpoint to train is not set")
    from transformers import AutoTokenizer

    from megatron_tepo.metrics import MetricsLogger
    from megatron_tepo.rewards import MathRewardPool
    from megatron_tepo.trainer.loop import evaluate, train

    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, out / "config.yaml")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    torch.manual_seed(cfg.train.seed)
    with MathRewardPool(cfg.reward.workers, cfg.reward.timeout_s) as pool:
        task, counters, data_stats = build_task(cfg, tokenizer, pool)
        actor, engine = build_actor_and_engine(cfg, cfg.model.path, task.pad_token_id)

        def eval_fn():
            if not task.eval_prompts:
                return {}
            return {f"eval/{k}": v for k, v in evaluate(engine, task.eval_prompts, task.eval_answers, task.reward_fn,
                                                           task.stop_token_ids,
                                                           max_new_tokens=cfg.rollout.max_new_tokens).items()}

        def on_step(step, metrics):
            metrics.update(counters)
            print(f"[step {step}/{cfg.train.steps}] reward {metrics['reward_mean']:.3f} "
                  f"loss {metrics.get('loss', float('nan')):.4f} grad_norm {metrics.get('grad_norm', 0):.3f}", flush=True)

        logger = MetricsLogger(out / "metrics.jsonl")
        history = train(cfg, actor, engine, task, logger=logger, on_step=on_step, eval_fn=eval_fn,
                        checkpoint_root=out / "checkpoints")
        logger.close()
    summary = {**data_stats, **counters, "steps_run": len(history)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
