#!/usr/bin/env python
"""Evaluate a Hugging Face checkpoint on math benchmarks: avg@k and pass@k per benchmark.

Reads a benchmark list (``--benchmarks FILE``, see examples/eval/paper_benchmarks.yaml: per
benchmark a prompt file, ``n`` samples, temperature, top-p, max new tokens; temperature 0 means
greedy, top-p 1 no nucleus cut) or one ad-hoc ``--file`` with ``--n/--temperature/--top-p/
--max-new-tokens`` (with ``--benchmarks`` these flags are refused: the file sets them). Prompts go
through the tokenizer's chat template. ``--reward math_verify`` (default): each response's last ``\\boxed{}`` is checked
with math-verify in a process pool with a per-answer time-out (time-outs and parser errors score
0 and are counted); ``--reward exact_match``: the response, stripped, equals the answer (the
trainer's ``reward.kind: exact_match``). Prints a table and writes a JSON report (atomically) with
``--out``, whose folder is created (and checked writable) before the evaluation starts. A bad
argument or file is one line and exit status 2 (``--traceback`` for the whole story), found before
the model loads: every prompt file is read first.

``--config RUN.yaml`` evaluates as that run trains: its ``reward`` scores (``reward.function``, a
user's function by import path, run in the reward pool; else ``reward.kind``; ``--reward`` given
overrides the kind), the prompts render with its ``data.tools`` (else its environment's own tools)
and ``data.chat_template_kwargs`` (``enable_thinking: false`` ...), and its ``environment`` section
(``name: python``, ``guess_number``, a user's) gives the model its tool: each response is an episode
(multi-turn, the tool's code in the sandbox), scored on its final turn or by the environment, and the
report adds the episodes' counts (tool calls, errors, turns).

Left out: the SGLang fleet (this tool uses the embedded engine, fine for small models and CI;
the trainer evaluates through whichever engine it runs), and LLM-judge grading.

    python tools/evaluate.py --model outputs/hf --benchmarks examples/eval/paper_benchmarks.yaml --out eval.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from megatron_tepo.cli import UserError, add_traceback_flag, prog, user_errors
from megatron_tepo.rewards import REWARD_KINDS

GREEDY_T = 1e-5  # temperature 0 in a benchmark file: sampling at this temperature is argmax
FILE_SAMPLING = {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 1024}  # --file's defaults


def load_benchmarks(path: Path) -> dict:
    from megatron_tepo.config import read_yaml_file

    data = read_yaml_file(path) or {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping with 'benchmarks', found {type(data).__name__}")
    unknown = set(data) - {"defaults", "benchmarks"}
    if unknown:
        raise UserError(f"{path}: unknown top-level keys {sorted(unknown)} (expected defaults, benchmarks)")
    defaults = {**FILE_SAMPLING, **(data.get("defaults") or {})}
    out = {}
    for name, spec in (data.get("benchmarks") or {}).items():
        spec = {**defaults, **(spec or {})}
        bad = set(spec) - {"file", "n", "temperature", "top_p", "max_new_tokens"}
        if bad:
            raise UserError(f"{path}: benchmark {name!r}: unknown keys {sorted(bad)}")
        if "file" not in spec:
            raise UserError(f"{path}: benchmark {name!r}: missing 'file'")
        check_top_p(spec["top_p"], f"{path}: benchmark {name!r}: top_p")
        spec["file"] = str((path.parent / spec["file"]).resolve()) if not Path(spec["file"]).is_absolute() else spec["file"]
        out[name] = spec
    if not out:
        raise UserError(f"{path}: no benchmarks listed")
    return out


def check_top_p(value, where: str) -> None:
    """top-p must be a number in (0, 1] (1: no nucleus cut)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UserError(f"{where}: must be a number in (0, 1], got {value!r}")


def prepare_out(out: Path) -> None:
    """Create ``out``'s folder and check it can be written, before hours of evaluation."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(f".{out.name}.probe")
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write there ({exc.strerror}: {exc.filename})") from None
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; give a file name such as {out / 'eval.json'}")


def run(model_dir: str, benchmarks: dict, *, workers: int = 2, timeout_s: float = 5.0, seed: int = 0,
        max_prompt_len: int | None = None, limit: int | None = None, reward: str = "math_verify",
        environment=None, sandbox=None, reward_function: str | None = None, template_kwargs: dict | None = None,
        apply_chat_template: bool = True) -> dict:
    """The report of ``benchmarks`` (``environment``: a run config's ``environment`` section, the
    model's tool; ``sandbox``: its typed sandbox settings; ``reward_function``: a user's reward by
    import path, which replaces ``reward``; ``template_kwargs``: the chat template's arguments, the
    run's ``config/validation.py:template_kwargs``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tepo.data import load_prompts
    from megatron_tepo.rewards import COUNT_NAMES, MathRewardPool, token_reward
    from megatron_tepo.rewards.custom import ImportedReward, function_reward
    from megatron_tepo.rollout.embedded import EmbeddedEngine
    from megatron_tepo.trainer import evaluate

    if not (Path(model_dir) / "config.json").is_file():
        raise UserError(f"--model {model_dir}: not a Hugging Face model folder (no config.json)")
    # every prompt file read before the weights load: a bad file costs seconds, not a model's loading
    for name, spec in benchmarks.items():
        if not load_prompts(spec["file"], require_answer=not reward_function).records:
            raise UserError(f"benchmark {name!r}: no prompts in {spec['file']}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = EmbeddedEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), seed=seed,
                            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if environment is not None and environment.name != "none":  # with the model's tool: multi-turn episodes
        from megatron_tepo.rollout.episode import with_environment

        engine = with_environment(engine, environment, sandbox, tok, tok.eos_token_id, template_kwargs)
    report = {}
    imported = {"reward_fn": ImportedReward(reward_function)} if reward_function else {}
    with MathRewardPool(num_workers=workers, timeout_s=timeout_s, **imported) as pool:
        reward_fn = function_reward(reward_function, tok, pool) if reward_function else token_reward(reward, tok, pool)
        for name, spec in benchmarks.items():
            t0 = time.time()
            data = load_prompts(spec["file"], tok, max_prompt_len=max_prompt_len, template_kwargs=template_kwargs,
                                apply_chat_template=apply_chat_template, require_answer=not reward_function)
            records = data.records[:limit] if limit else data.records
            if not records:
                raise UserError(f"benchmark {name!r}: no prompts in {spec['file']}")
            temperature = spec["temperature"] if spec["temperature"] > 0 else GREEDY_T
            scores = evaluate(engine, [r.input_ids for r in records], [r.answer for r in records], reward_fn,
                              stop, n=spec["n"], temperature=temperature, top_p=spec["top_p"],
                              max_new_tokens=spec["max_new_tokens"], rows=[r.row for r in records])
            counts = {f"num_{k.removeprefix('reward_')}": scores.pop(k) for k in COUNT_NAMES}  # the report's names
            report[name] = {**scores, "num_prompts": len(records), "n": spec["n"],
                            "temperature": spec["temperature"], "top_p": spec["top_p"],
                            "dropped_too_long": data.num_too_long,
                            **counts, "seconds": round(time.time() - t0, 2)}
    return report


def command(argv=None) -> dict:
    """The command: parse, evaluate, print the table; returns the report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (weights + tokenizer)")
    ap.add_argument("--benchmarks", type=Path, help="benchmark list (YAML)")
    ap.add_argument("--file", help="one prompt file instead of --benchmarks")
    # --file's sampling (a benchmark list sets its own per benchmark)
    ap.add_argument("--n", type=int, help=f"samples per prompt (default {FILE_SAMPLING['n']})")
    ap.add_argument("--temperature", type=float,
                    help=f"0: greedy (default {FILE_SAMPLING['temperature']})")
    ap.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set of tokens whose probability "
                    f"reaches this (default {FILE_SAMPLING['top_p']}: every token)")
    ap.add_argument("--max-new-tokens", type=int, help=f"default {FILE_SAMPLING['max_new_tokens']}")
    ap.add_argument("--limit", type=int, help="first N prompts of each benchmark")
    ap.add_argument("--max-prompt-len", type=int)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds per answer check")
    ap.add_argument("--reward", choices=REWARD_KINDS,
                    help="math_verify (default): the last \\boxed{} against the answer; exact_match: the whole "
                    "response (with --config: the run's reward.kind, or its reward.function, unless given)")
    ap.add_argument("--out", type=Path, help="JSON report (its folder is created)")
    ap.add_argument("--config", action="append", help="a run config to evaluate as it trains: its reward "
                    "(reward.function or reward.kind), its prompts' chat-template arguments (data.tools, "
                    "data.chat_template_kwargs) and its environment (multi-turn episodes); repeatable, merged")
    add_traceback_flag(ap)
    args = ap.parse_args(argv)
    if bool(args.benchmarks) == bool(args.file):
        ap.error("give exactly one of --benchmarks or --file")
    given = [f"--{k.replace('_', '-')}" for k in FILE_SAMPLING if getattr(args, k) is not None]
    if args.benchmarks and given:
        ap.error(f"{', '.join(given)}: set per benchmark in the --benchmarks file (these go with --file)")
    with user_errors(prog(), args.traceback):
        return _main(args)


def _main(args):
    if args.out:
        prepare_out(args.out)
    if args.benchmarks:
        benchmarks = load_benchmarks(args.benchmarks)
    else:
        spec = {k: v if (v := getattr(args, k)) is not None else default for k, default in FILE_SAMPLING.items()}
        check_top_p(spec["top_p"], "--top-p")
        benchmarks = {Path(args.file).stem: {"file": args.file, **spec}}
    run_kw = {"reward": args.reward or "math_verify"}
    if args.config:
        from megatron_tepo.config import load_config
        from megatron_tepo.config.validation import sandbox_settings, template_kwargs

        cfg = load_config(args.config)
        if args.reward and cfg.reward.function:
            raise UserError(f"--reward {args.reward}: the run config scores with reward.function "
                            f"{cfg.reward.function!r}; give one of them")
        run_kw = {"reward": args.reward or cfg.reward.kind, "reward_function": cfg.reward.function or None,
                  "environment": cfg.environment, "sandbox": sandbox_settings(cfg),
                  "template_kwargs": template_kwargs(cfg), "apply_chat_template": cfg.data.apply_chat_template}
    report = run(args.model, benchmarks, workers=args.workers, timeout_s=args.timeout,
                 max_prompt_len=args.max_prompt_len, limit=args.limit, **run_kw)
    for name, r in report.items():
        k = r["n"]
        print(f"{name:16s} avg@{k} {r[f'avg@{k}']:.4f}  pass@{k} {r[f'pass@{k}']:.4f}  "
              f"({r['num_prompts']} prompts, {r.get('num_timeouts', 0)} time-outs, {r['seconds']}s)")
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(args.out)
    return report


def main(argv=None) -> int:
    command(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
