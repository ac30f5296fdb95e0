#!/usr/bin/env python
"""The main job: a tiny TEPO run on CPU that shows held-out accuracy going up, with a picture.

What it does, in order:
1. builds a character tokenizer and a tiny Qwen3 (2 layers, hidden 128) locally -- no hub;
2. warms it up with a short supervised run on two-digit addition ("37+45=" -> "82"), cached under
   ``.cache/tiny_tepo`` so later runs skip it;
3. runs TEPO (examples/tiny_tepo/config.yaml; any method: --config examples/ablations/X.yaml
   --config examples/tiny_tepo/sizes.yaml) with the
   Megatron actor (one process, gloo) and the embedded rollout engine, syncing weights after every
   step;
4. prints greedy held-out accuracy before and after, writes metrics.jsonl, summary.json and
   curves.png to the output directory.

``--task chain`` swaps the task for examples/chain_task/chain.py (column-by-column sums of 3-7
digits, 14-73-token responses, its own 4-layer warm-up cached under ``.cache/tiny_chain``); use it
with ``--config examples/chain_task/sizes.yaml``. ``--task tir`` is examples/tiny_tir/tir.py:
two-digit multiplication with a Python tool (multi-turn episodes in a chat template, the tool's
code in the sandbox), warmed up on traces that call it (``.cache/tiny_tir``); use it with
``--config examples/tiny_tir/config.yaml``. ``--model qwen3_5`` swaps the addition task's tiny Qwen3 for a
tiny Qwen3.5 (three Gated DeltaNet layers and one gated-attention layer: the actor on megatron-core's
HybridModel, the embedded engine on transformers' Qwen3.5), warmed up the same way.

Deliberately left out: real math data and math-verify (the reward is exact match of the sum),
SGLang and parallelism beyond one process. Checkpoints are written every train.save_every steps
under <output_dir>/checkpoints, and a run started again over the same output directory resumes
from the newest complete one (train.resume=false starts over). It is a demonstration that the whole loop
learns, sized for 2 CPU cores in a few minutes, not a benchmark.

    python examples/tiny_tepo/run.py [--task addition|chain] [--config FILE] [override ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import addition  # noqa: E402 -- the main job's task

TASKS = {"addition": Path(addition.__file__),  # the main job's task
         "chain": REPO / "examples/chain_task/chain.py",  # long, variable-length chains (chain.py)
         "tir": REPO / "examples/tiny_tir/tir.py"}  # multiplication with a Python tool (multi-turn episodes)


def load_task(name: str):
    """The task module: ``PAD``, ``EOS``, ``problems(n, seed)``, ``reward_fn`` and ``warm_up(cache)``."""
    if name == "addition":
        return addition  # already imported
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tepo_task_{name}", TASKS[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    ap = argparse.ArgumentParser(description="tiny TEPO run on CPU")
    ap.add_argument("--config", action="append",
                    help="config file (repeatable, merged left to right; default examples/tiny_tepo/config.yaml)")
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--task", choices=sorted(TASKS), default="addition",
                    help="addition (two-digit sums, the main job), chain (column-by-column sums of 3-7 "
                         "digits, 14-73-token responses: examples/chain_task) or tir (two-digit products "
                         "with a Python tool: examples/tiny_tir)")
    ap.add_argument("--model", choices=["qwen3", "qwen3_5"], default="qwen3",
                    help="the addition task's tiny model: qwen3 (the main job) or qwen3_5 (a Gated DeltaNet hybrid)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    args = ap.parse_args(argv)

    from megatron_tepo.config import dump_config, load_config

    cfg = load_config(args.config or [REPO / "examples/tiny_tepo/config.yaml"], args.overrides)
    from megatron_tepo.cli import prog, user_errors
    from megatron_tepo.trainer.main import check_environment

    with user_errors(prog()):  # the tool's sandbox before the warm-up (minutes): one line, exit 2, if it cannot start
        check_environment(cfg)
    torch.manual_seed(cfg.train.seed)
    out = Path(cfg.train.output_dir)
    if not out.is_absolute():
        out = REPO / out
    out.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, out / "config.yaml")
    task_mod = load_task(args.task)
    EOS, PAD, problems, reward_fn = task_mod.EOS, task_mod.PAD, task_mod.problems, task_mod.reward_fn  # noqa: N806
    if args.model != "qwen3" and args.task != "addition":
        ap.error(f"--model {args.model}: only the addition task has it")
    cache = REPO / ".cache" / ("tiny_tepo" if args.task == "addition" else f"tiny_{args.task}")
    sft_dir = task_mod.warm_up(cache, model=args.model) if args.model != "qwen3" else task_mod.warm_up(cache)

    from megatron_tepo.metrics import MetricsLogger
    from megatron_tepo.trainer import Task, evaluate, train
    from megatron_tepo.trainer.main import build_actor_and_engine, no_update_cause

    actor, engine = build_actor_and_engine(cfg, str(sft_dir), PAD)
    train_items, eval_items = problems(5000, seed=1), problems(args.eval_size, seed=2)
    task = Task([p for p, _ in train_items], [a for _, a in train_items], reward_fn, stop_token_ids=[EOS],
                pad_token_id=PAD)

    def held_out():
        return evaluate(engine, [p for p, _ in eval_items], [a for _, a in eval_items], reward_fn, [EOS],
                        max_new_tokens=cfg.rollout.max_new_tokens)["avg@1"]

    t0 = time.time()
    from megatron_tepo.checkpoint.store import find_latest_checkpoint

    log_path, ckpt_root = out / "metrics.jsonl", out / "checkpoints"
    resuming = cfg.train.resume and find_latest_checkpoint(ckpt_root) is not None
    extra = {}
    if not resuming:
        if log_path.exists():
            log_path.unlink()
        extra["accuracy_before"] = held_out()
    logger = MetricsLogger(log_path)

    def progress(step, m):
        if m.get("updates", 1.0) == 0:
            print(f"[step {step:3d}/{cfg.train.steps}] NO UPDATE: {no_update_cause(m, cfg.rollout.n_samples)}"
                  + (f"  held-out accuracy {m['eval_acc']:.3f}" if "eval_acc" in m else ""), flush=True)
            return
        print(f"[step {step:3d}/{cfg.train.steps}] reward {m['reward_mean']:.3f}  entropy {m.get('entropy', 0):.3f}  "
              f"clip {m.get('clip_frac', 0):.3f}  kl_mask {m.get('kl_mask_frac', 0):.3f}  "
              f"grad_norm {m.get('grad_norm', 0):.2f}  dropped {m['groups_dropped']}  {m['step_s']:.1f}s", flush=True)

    print(f"[tepo] loss={cfg.algorithm.loss} kl_coef={cfg.algorithm.kl_coef} kl_mask={cfg.algorithm.kl_mask}"
          + (f"; resuming from {find_latest_checkpoint(ckpt_root)}" if resuming else
             f"; held-out greedy accuracy before: {extra['accuracy_before']:.3f}"), flush=True)
    train(cfg, actor, engine, task, logger=logger, on_step=progress, eval_fn=lambda: {"eval_acc": held_out()},
          checkpoint_root=ckpt_root, extra_state=extra, report=lambda line: print(f"[tepo] {line}", flush=True))
    before = extra["accuracy_before"]
    logger.close()
    if cfg.rollout.colocated:  # train() hands the memory back to the actor: the engine takes it again
        from megatron_tepo.rollout.engine import MEMORY_TAGS
        from megatron_tepo.trainer.rollouts import sync_weights

        engine.resume_memory(MEMORY_TAGS)
        sync_weights(actor, engine)
    after = held_out()
    summary = {"accuracy_before": before, "accuracy_after": after, "improvement": after - before,
               "steps": cfg.train.steps, "seconds": time.time() - t0, "loss": cfg.algorithm.loss}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    from megatron_tepo.commands.plot_metrics import plot

    png = plot([str(log_path)], [cfg.algorithm.loss], out / "curves.png", smooth=5)
    print(f"[tepo] held-out greedy accuracy: before {before:.3f} -> after {after:.3f} "
          f"(improvement {after - before:+.3f}) in {summary['seconds']:.0f}s; plot: {png}")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
