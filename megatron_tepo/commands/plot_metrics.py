#!/usr/bin/env python
"""Draw a run's training curves to PNG from its metrics JSONL (the TEPO paper's Figures 2-4).

Panels: reward, response length, entropy, clip fraction, gradient norm, KL-mask fraction, and the
four advantage/entropy-change quadrants (A>0/A<0 x entropy up/down) over steps; the schedule's
(staleness, partial rollout, engine idle, throughput); multi-turn episodes' (turns and tool calls per
episode, tool errors and time-outs, tool time, response tokens by source, the template comparator). Several runs can
be overlaid (``--log a.jsonl --log b.jsonl --label TEPO --label GRPO``). A metric missing from a
log is left out of that panel, and a panel none of the logs has data for is not drawn
(:func:`panels_with_data`: a one-turn run draws no episode panels).

Left out: smoothing beyond an optional moving average (``--smooth N``), and evaluation tables.

    python tools/plot_metrics.py --log outputs/run/metrics.jsonl --out outputs/run/curves.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


from megatron_tepo.metrics import read_metrics

PANELS = [
    ("reward", ["reward_mean"], "reward"),
    ("response length", ["response_length_mean"], "tokens"),
    ("entropy", ["entropy"], "nats"),
    ("clip fraction", ["clip_frac"], "fraction"),
    ("gradient norm", ["grad_norm"], "norm"),
    ("KL-mask fraction", ["kl_mask_frac"], "fraction"),
    ("advantage x entropy change", ["quad_pos_adv_inc_ent", "quad_pos_adv_dec_ent",
                                    "quad_neg_adv_inc_ent", "quad_neg_adv_dec_ent"], "fraction of tokens"),
    # the rollout's schedule (partial rollout: trainer/partial.py)
    ("staleness of trained tokens", ["staleness_mean", "staleness_max"], "weight versions"),
    ("partial rollout", ["partial_resumed", "stale_regenerated", "resumed_from_checkpoint"], "samples"),
    ("engine idle", ["engine_idle_fraction"], "fraction of the step"),
    ("throughput", ["tokens_per_s"], "trained response tokens / s"),
    # multi-turn episodes (rollout/episode.py: environment.name other than none)
    ("turns and tool calls", ["episode_turns_mean", "episode_tool_calls_mean"], "per episode"),
    ("tool calls, errors and time-outs", ["tool_calls", "tool_errors", "tool_timeouts", "tool_sandbox_failures",
                                          "tool_calls_capped"], "calls a step"),
    ("why episodes ended", ["episode_end_answered", "episode_end_turn_cap", "episode_end_max_turns",
                            "episode_end_budget", "episode_end_error", "episode_end_sandbox_failure"],
     "fraction of episodes"),
    ("environment reward per turn", ["env_turn_reward_mean"], "reward"),
    ("tool time", ["tool_seconds"], "seconds a step (summed over calls)"),
    ("response tokens by source", ["tokens_model", "tokens_env"], "tokens a step"),
    ("template comparator", ["template_error_rate", "template_thinking_rate", "template_retokenized_rate",
                             "template_equal_rate"], "fraction of episodes"),
]


def _smooth(values, n):
    if n <= 1:
        return values
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-n:]
        out.append(sum(acc) / len(acc))
    return out


def _points(records, key):
    return [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]


def panels_with_data(runs) -> list:
    """The :data:`PANELS` that at least one run's records (``read_metrics``) have a number for; the
    first panel alone when none has (it then says "no data")."""
    drawn = [p for p in PANELS if any(_points(records, key) for records in runs for key in p[1])]
    return drawn or PANELS[:1]


def plot(logs, labels, out, smooth=1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_metrics(p) for p in logs]
    panels = panels_with_data(runs)
    rows = -(-len(panels) // 4)
    fig, axes = plt.subplots(rows, 4, figsize=(18, 4 * rows), squeeze=False)
    axes = axes.ravel()
    for ax, (title, keys, unit) in zip(axes, panels):
        drawn = 0
        for records, label in zip(runs, labels):
            for key in keys:
                pts = _points(records, key)
                if not pts:
                    continue
                steps, vals = zip(*pts)
                short = key.replace("quad_", "").replace("staleness_", "").replace("template_", "").replace("episode_", "")
                name = label if len(keys) == 1 else f"{label} {short}"
                ax.plot(steps, _smooth(list(vals), smooth), label=name)
                drawn += 1
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", action="append", required=True, help="metrics JSONL (repeatable)")
    ap.add_argument("--label", action="append", help="legend label per --log")
    ap.add_argument("--out", required=True, help="output PNG")
    ap.add_argument("--smooth", type=int, default=1, help="moving-average window")
    args = ap.parse_args(argv)
    labels = args.label or [Path(p).parent.name or Path(p).stem for p in args.log]
    if len(labels) != len(args.log):
        ap.error(f"{len(args.label)} --label for {len(args.log)} --log")
    for p in args.log:
        if not Path(p).is_file():
            ap.error(f"--log {p}: no such file")
    print(plot(args.log, labels, args.out, args.smooth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
