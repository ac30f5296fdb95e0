#!/usr/bin/env python
"""Benchmarks of tasks with an environment (#58 item 7; results in docs/BENCHMARKS.md, "Tasks with an
environment (#58)"). Three subcommands:

``guess``: one training run on the guessing game (megatron_tepo/environments/guess_number.py) with
the tiny Qwen3 of examples/tiny_tir (its character tokenizer and ChatML template): every prompt is
the same text, the secret (0..``--numbers``-1) is the row's, the model guesses one digit a turn and
the environment answers ``((`` (higher) / ``))`` (lower), or, with ``--feedback off``, ``==`` to
every wrong guess (``environment.args.feedback=false``: the same game, no information); at most
``--turns`` guesses; the reward is the environment's (1 for the number found). The model is first
warmed up (cached under .cache/tiny_guess) on episodes of uniformly random guesses that ignore the
answers: it knows the format and nothing of the game, so what it gains is RL's. ``--method tepo``
(examples/ablations/table1_tepo_qwen2.5_7b.yaml) or ``grpo`` (table1_grpo_dapo.yaml), both with
examples/tiny_tir/sizes.yaml and the overrides printed at the start. Writes ``metrics.jsonl``.

``summary DIR...``: the table of runs (``--key`` per step, ``reward_mean_all`` by default: every
episode of the step's first sampling round, before dynamic sampling drops groups; of every
``metrics.jsonl`` under the folders, grouped by the folder's name without its ``-s<seed>`` tail):
its mean over the first and the last ``--window`` steps (mean +- sd over seeds), the first step whose
``--window``-step moving average reaches ``--target`` (median over the seeds that reach it; how many
did), and ``--extra`` metrics over the last ``--window`` steps (turns, tool calls per episode).

``overhead``: episodes per second and the EpisodeEngine's own time per turn, with a scripted inner
engine (tests' style: it answers at once) and the guessing game: wall time of
``EpisodeEngine.generate`` minus the inner engine's and the environment's time, per model turn.

Left out: held-out greedy evaluation of the game (the curves are the training episodes' reward at
temperature 1), SGLang, any GPU. The numbers in the docs were made on a shared 2-core CPU machine.

    python benchmarks/episodes.py guess --method tepo --feedback on --seed 1 --out /tmp/bench58/guess/tepo-fbon-s1
    python benchmarks/episodes.py summary /tmp/bench58/guess --window 10 --target 0.5
    python benchmarks/episodes.py overhead --episodes 256 --repeats 3
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples/tiny_tir"))

HIGHER, LOWER, NEUTRAL = "((", "))", "=="
METHODS = {"tepo": "examples/ablations/table1_tepo_qwen2.5_7b.yaml",
           "grpo": "examples/ablations/table1_grpo_dapo.yaml"}


def _tir():
    import tir  # examples/tiny_tir/tir.py: the tokenizer, the template, the tiny Qwen3

    return tir


def prompt_text(numbers: int) -> str:
    return f"0{numbers - 1}"  # the range, the same for every row (the secret is the row's only)


def trace(tok, secret: int, numbers: int, turns: int, rng: random.Random, feedback: bool = True):
    """A warm-up episode: uniformly random guesses that ignore the answers, until found or ``turns``;
    its ids and the mask of the tokens the model writes."""
    tir = _tir()
    conv = [{"role": "user", "content": prompt_text(numbers)}]
    ids = tir.render_ids(tok, conv, add_generation_prompt=True)
    mask = [0] * len(ids)
    for t in range(turns):
        g = rng.randrange(numbers)
        conv.append({"role": "assistant", "content": str(g)})
        full = tir.render_ids(tok, conv)[:-1]  # up to the turn's <|im_end|>
        mask += [1] * (len(full) - len(ids))
        ids = full
        if g == secret or t == turns - 1:
            break
        conv.append({"role": "tool", "content": (HIGHER if g < secret else LOWER) if feedback else NEUTRAL})
        nxt = tir.render_ids(tok, conv, add_generation_prompt=True)
        mask += [0] * (len(nxt) - len(ids))
        ids = nxt
    return ids, mask


def warm_up(numbers: int, turns: int, steps: int = 150, batch: int = 64, lr: float = 3e-3, seed: int = 0) -> Path:
    """The tiny Qwen3 trained on random-guess episodes (half with the answers, half with ``==``),
    cached by its settings under .cache/tiny_guess."""
    import torch

    from megatron_tepo.cache_dir import build_once

    tir = _tir()
    key = hashlib.sha1(json.dumps([numbers, turns, steps, batch, lr, seed, tir.VOCAB, tir.CHARS, tir.WORDS,
                                   tir.CHAT_TEMPLATE, "v1"]).encode()).hexdigest()[:10]
    out = REPO / ".cache" / "tiny_guess" / f"sft-{key}"

    def train(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        tok = tir.hf_tokenizer()
        model = AutoModelForCausalLM.from_config(tir.tiny_qwen3_config())
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        rng = random.Random(seed)
        t = time.time()
        for _ in range(steps):
            rows = [trace(tok, rng.randrange(numbers), numbers, turns, rng, feedback=rng.random() < 0.5)
                    for _ in range(batch)]
            width = max(len(ids) for ids, _ in rows)
            ids = torch.tensor([r + [tir.PAD] * (width - len(r)) for r, _ in rows])
            labels = torch.tensor([[x if m else -100 for x, m in zip(r, mk)] + [-100] * (width - len(r))
                                   for r, mk in rows])
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"[warm-up] {steps} supervised steps on random guesses in {time.time() - t:.0f}s, "
              f"final loss {loss.item():.3f}", flush=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": tir.EOS, "eos_token_id": tir.EOS, "pad_token_id": tir.PAD}))

    return build_once(out, train)


def guess_overrides(a) -> list:
    return [f"train.seed={a.seed}", f"train.steps={a.steps}", f"train.output_dir={a.out}", "train.save_every=0",
            "train.export_hf=false", "train.resume=false", f"rollout.prompts_per_step={a.prompts}",
            f"rollout.n_samples={a.samples}", f"train.mini_batch_prompts={a.prompts}",
            f"rollout.max_new_tokens={16 * a.turns}", f"optim.lr={a.lr}",
            "environment.name=guess_number", f"environment.max_turns={a.turns}", "environment.max_turn_tokens=4",
            "environment.sandbox.kind=none", f"environment.args.feedback={'true' if a.feedback == 'on' else 'false'}",
            f"environment.args.higher='{HIGHER}'", f"environment.args.lower='{LOWER}'",
            f"environment.args.neutral='{NEUTRAL}'"]


def cmd_guess(a) -> None:
    import torch

    from megatron_tepo.config import dump_config, load_config

    tir = _tir()
    cfg = load_config([REPO / METHODS[a.method], REPO / "examples/tiny_tir/sizes.yaml"], guess_overrides(a))
    print("[guess] overrides: " + " ".join(guess_overrides(a)), flush=True)
    torch.manual_seed(cfg.train.seed)
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, out / "config.yaml")
    model_dir = warm_up(a.numbers, a.turns)

    from megatron_tepo.metrics import MetricsLogger
    from megatron_tepo.trainer import Task, train
    from megatron_tepo.trainer.main import build_actor_and_engine

    actor, engine = build_actor_and_engine(cfg, str(model_dir), tir.PAD)
    tok = tir.hf_tokenizer()
    prompt = tir.prompt_ids(tok, prompt_text(a.numbers))
    rng = random.Random(a.seed)
    secrets = [rng.randrange(a.numbers) for _ in range(4000)]
    rows = [{"prompt": prompt_text(a.numbers), "secret": s} for s in secrets]
    task = Task([list(prompt) for _ in secrets], [str(s) for s in secrets],
                lambda responses, answers: [0.0] * len(responses),  # the environment gives the reward
                stop_token_ids=[tir.EOS], pad_token_id=tir.PAD, train_rows=rows)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    logger = MetricsLogger(out / "metrics.jsonl")
    t0 = time.time()

    def progress(step, m):
        print(f"[step {step:3d}/{a.steps}] reward {m.get('reward_mean', float('nan')):.3f}  "
              f"turns {m.get('episode_turns_mean', m.get('turns_per_episode', float('nan')))}  "
              f"{m.get('step_s', 0):.1f}s", flush=True)

    train(cfg, actor, engine, task, logger=logger, on_step=progress, checkpoint_root=out / "checkpoints",
          report=lambda line: print(f"[guess] {line}", flush=True))
    logger.close()
    (out / "summary.json").write_text(json.dumps({"seconds": time.time() - t0, "method": a.method,
                                                   "feedback": a.feedback, "seed": a.seed}))
    print(f"[guess] done in {time.time() - t0:.0f}s", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _read(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ms(xs) -> str:
    if not xs:
        return "-"
    return f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def summarize(dirs, window: int, target: float, key: str = "reward_mean_all",
              extra=("episode_turns_mean", "episode_tool_calls_mean")) -> list:
    """One row per configuration (the folder's name without ``-s<seed>``): see the module docstring."""
    groups: dict = {}
    for d in dirs:
        for f in sorted(Path(d).rglob("metrics.jsonl")):
            rows = [r for r in _read(f) if key in r]
            if rows:
                groups.setdefault(re.sub(r"-s\d+$", "", f.parent.name), []).append(rows)
    table = []
    for name, runs in sorted(groups.items()):
        first = [statistics.mean(r[key] for r in run[:window]) for run in runs]
        last = [statistics.mean(r[key] for r in run[-window:]) for run in runs]
        reach = []
        for run in runs:
            vals = [r[key] for r in run]
            reach.append(next((i + 1 for i in range(window - 1, len(vals))
                               if statistics.mean(vals[i - window + 1:i + 1]) >= target), None))
        got = [h for h in reach if h is not None]
        row = {"run": name, "seeds": len(runs), "steps": min(len(r) for r in runs), "first": _ms(first),
               "last": _ms(last), "to_target": (f"{statistics.median(got):.0f}" if got else "-")
               + f" ({len(got)}/{len(runs)})"}
        for k in extra:
            row[k] = _ms([statistics.mean(r[k] for r in run[-window:] if k in r)
                          for run in runs if any(k in r for r in run[-window:])])
        table.append(row)
    return table


def cmd_summary(a) -> None:
    table = summarize(a.dirs, a.window, a.target, a.key, a.extra)
    print(f"| run | seeds | steps | {a.key}, first {a.window} steps | last {a.window} steps | "
          f"step reaching {a.target} ({a.window}-step mean; median, seeds) | "
          + " | ".join(f"{k}, last {a.window}" for k in a.extra) + " |")
    print("| --- " * (6 + len(a.extra)) + "|")
    for r in table:
        print(f"| {r['run']} | {r['seeds']} | {r['steps']} | {r['first']} | {r['last']} | {r['to_target']} | "
              + " | ".join(r[k] for k in a.extra) + " |")


class _Scripted:
    """The inner engine, scripted: a turn is a bisecting guess over 0..63 read from the episode's ids
    (the environment's ``((`` / ``))``), given at once; its time (decoding and the answer) is counted."""
    interruptible = True

    def __init__(self, tok, eos, prompt_len):
        import threading

        self.tok, self.eos, self.prompt_len, self.done, self.seconds = tok, eos, prompt_len, [], 0.0
        self.lock = threading.Lock()

    def _turn(self, prompt):
        text = self.tok.decode(prompt[self.prompt_len:])
        lo, hi = 0, 63
        for g, hint in re.findall(r"(\d+)<\|im_end\|>.*?<tool_response>\n(\(\(|\)\))\n", text, flags=re.S):
            lo, hi = (int(g) + 1, hi) if hint == HIGHER else (lo, int(g) - 1)
        return self.tok(str((lo + hi) // 2), add_special_tokens=False)["input_ids"] + [self.eos]

    def submit(self, requests, params):
        from megatron_tepo.rollout.engine import FINISH_LENGTH, FINISH_STOP, Sample

        t = time.perf_counter()
        for r in requests:
            out = self._turn(list(r.prompt))[:r.remaining]
            self.done.append((r, Sample(out, [-0.5] * len(out), FINISH_STOP if out[-1] == self.eos else FINISH_LENGTH)))
        self.seconds += time.perf_counter() - t

    def collect(self, timeout=0.0):
        t = time.perf_counter()
        out, self.done = self.done, []
        self.seconds += time.perf_counter() - t
        return out

    def interrupt(self):
        return self.collect()

    def update_weights(self, named):
        pass

    def close(self):
        pass


def cmd_overhead(a) -> list:
    """Episodes per second and the episode engine's own time per model turn (scripted inner engine,
    the guessing game over 0..63 with its answers); returns the table's rows."""
    import threading

    from megatron_tepo.environments.guess_number import GuessNumber
    from megatron_tepo.rollout.episode import EpisodeEngine, EpisodeLimits, TurnFormat

    tir = _tir()
    tok = tir.hf_tokenizer()
    prompt = tir.prompt_ids(tok, "063")
    lock = threading.Lock()

    class Timed(GuessNumber):
        seconds = 0.0

        def step(self, state, turn, turn_index):
            t = time.perf_counter()
            try:
                return super().step(state, turn, turn_index)
            finally:
                with lock:
                    Timed.seconds += time.perf_counter() - t

    rows = []
    for workers in a.workers:
        for _ in range(a.repeats):
            Timed.seconds = 0.0
            inner = _Scripted(tok, tir.EOS, len(prompt))
            engine = EpisodeEngine(inner, Timed(higher=HIGHER, lower=LOWER), TurnFormat(tok, tir.EOS),
                                   EpisodeLimits(max_turns=a.turns, tool_workers=workers))
            data = [{"prompt": "063", "secret": (37 * i + 11) % 64} for i in range(a.episodes)]
            t = time.perf_counter()
            groups = engine.generate([prompt] * a.episodes, n=1, max_new_tokens=16 * a.turns,
                                     stop_token_ids=[tir.EOS], rows=data)
            wall = time.perf_counter() - t
            engine.close()
            turns = sum(s.meta["episode"]["turns"] for g in groups for s in g)
            own = wall - inner.seconds - Timed.seconds
            rows.append({"workers": workers, "episodes": a.episodes, "turns": turns, "wall_s": wall,
                         "episodes_per_s": a.episodes / wall, "inner_ms_per_turn": 1e3 * inner.seconds / turns,
                         "env_ms_per_turn": 1e3 * Timed.seconds / turns, "overhead_ms_per_turn": 1e3 * own / turns})
    print("| tool_workers | episodes | model turns | wall (s) | episodes / s | inner engine (ms / turn) | "
          "environment (ms / turn) | episode engine's own (ms / turn) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workers']} | {r['episodes']} | {r['turns']} | {r['wall_s']:.2f} | {r['episodes_per_s']:.0f} | "
              f"{r['inner_ms_per_turn']:.3f} | {r['env_ms_per_turn']:.3f} | {r['overhead_ms_per_turn']:.3f} |")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("guess", help="one training run on the guessing game")
    g.add_argument("--method", choices=sorted(METHODS), default="tepo")
    g.add_argument("--feedback", choices=["on", "off"], default="on")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--steps", type=int, default=80)
    g.add_argument("--numbers", type=int, default=6, help="the secret is 0..numbers-1 (at most 10: one digit)")
    g.add_argument("--turns", type=int, default=3, help="guesses per episode at most")
    g.add_argument("--prompts", type=int, default=16)
    g.add_argument("--samples", type=int, default=8)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--out", required=True)
    s = sub.add_parser("summary", help="the table of runs")
    s.add_argument("dirs", nargs="+")
    s.add_argument("--window", type=int, default=5)
    s.add_argument("--target", type=float, default=0.6)
    s.add_argument("--key", default="reward_mean_all",
                   help="the curve: reward_mean_all (every episode of the step's first round), "
                        "reward_mean (kept groups)")
    s.add_argument("--extra", nargs="*", default=["episode_turns_mean", "episode_tool_calls_mean"],
                   help="more metrics, mean of the last --window steps")
    o = sub.add_parser("overhead", help="episodes per second and the episode engine's overhead per turn")
    o.add_argument("--episodes", type=int, default=256)
    o.add_argument("--turns", type=int, default=8, help="max_turns (bisecting 0..63 takes up to 6)")
    o.add_argument("--workers", type=int, nargs="+", default=[1, 8], help="environment.tool_workers, each")
    o.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if a.cmd == "guess" and not 2 <= a.numbers <= 10:
        ap.error("--numbers: 2..10 (one digit a guess)")
    {"guess": cmd_guess, "summary": cmd_summary, "overhead": cmd_overhead}[a.cmd](a)


if __name__ == "__main__":
    main()
