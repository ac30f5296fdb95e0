#!/usr/bin/env python
"""Check that a launch layout fits in GPU memory before anything starts (exit 1 if it does not).

    python tools/fit_check.py --config examples/models/qwen3_14b.yaml [--gpu-mem-gib 80] \\
        [--hf-config /models/Qwen3-14B/config.json] [launch.actor_nodes=4 parallel.tp=8 ...] \\
        [--write-run-config RUN.yaml] [--print-shell] [--trainer-python PYTHON [--dry-run]]

Prints the per-GPU arithmetic (actor: weights, grads, optimizer, activations, logits, reserve;
SGLang servers: weights + KV cache; a colocated layout, ``launch.rollout.placement: colocated``: each
phase's peak -- rollout, training, weight sync -- at the offload level it picks, the least that
fits, the servers' derived ``mem_fraction_static`` and the pinned host memory per node); on a
misfit or a bad file prints one line naming the setting to change and exits 2 (``--traceback`` for
the whole story).
``--write-run-config`` writes the RunConfig file the trainer is started with (a colocated layout's
with ``rollout.colocated: true`` and, on cuda, the picked ``actor.offload``); ``--print-shell``
prints ``FIT_*=value`` lines for slurm/lib.sh (on stdout; the report then goes to stderr). A launch
file with ``launch.device: cpu`` (examples/models/tiny_cpu.yaml) gets no GPU arithmetic, only the
layout rules, and still writes the run config and the FIT_* lines.
``--trainer-python PYTHON`` (slurm/lib.sh gives its ``TEPO_PYTHON``): on ``launch.device: cuda``
also check the job's pythons, PYTHON for the trainer and the SGLang python the servers will find
(megatron_tepo/launch/pythons.py: a CPU build of torch, no Transformer Engine where the layout needs
it, SGLang's CPU build are refused, naming the variable to set); with ``--dry-run`` (a preview: a
login node's python may well be a CPU one) that refusal is one line of the report and the check
goes on. A run with a tool environment (``environment.name`` not ``none``) also has its sandbox made
here once, running ``print(1)`` (megatron_tepo/environments/choice.py's ``check_sandbox``): one that
cannot start (bwrap missing, user namespaces forbidden) stops the job before any server starts; in a
dry run it is one line.
The formulas: docs/LAUNCH.md ("The fit-check arithmetic"); the code: megatron_tepo/launch/.
"""
import argparse
import sys


from megatron_tepo.cli import add_traceback_flag, prog, user_errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="launch file, e.g. examples/models/qwen3_14b.yaml")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="GPU memory (overrides launch.gpu_mem_gib)")
    ap.add_argument("--hf-config", default=None, help="an HF config.json to use instead of the file's numbers")
    ap.add_argument("--write-run-config", default=None, help="write the trainer's RunConfig YAML here")
    ap.add_argument("--print-shell", action="store_true", help="print FIT_* shell variables on stdout")
    ap.add_argument("--trainer-python", default=None,
                    help="launch.device cuda: check this python (the trainer's) and the SGLang python")
    ap.add_argument("--dry-run", action="store_true",
                    help="a preview (slurm/lib.sh's TEPO_DRY_RUN=1): what a real run would refuse of the pythons "
                         "is one line, and the check goes on")
    ap.add_argument("overrides", nargs="*", help="dotted overrides: launch.actor_nodes=4 parallel.tp=8 ...")
    add_traceback_flag(ap)
    args = ap.parse_args(argv)
    with user_errors(prog(), args.traceback):
        return _run(args)


def _run(args) -> int:
    from megatron_tepo.cli import UserError
    from megatron_tepo.config import ConfigError
    from megatron_tepo.launch import FitError, check_fit, load_launch, render_shell, write_run_config

    overrides = list(args.overrides)
    if args.gpu_mem_gib is not None:
        overrides.append(f"launch.gpu_mem_gib={args.gpu_mem_gib}")
    report_out = sys.stderr if args.print_shell else sys.stdout
    try:
        spec = load_launch(args.config, overrides, hf_config=args.hf_config)
        report = check_fit(spec.shape(), spec.cfg, spec.launch, raise_error=False)
        print(f"fit check of {spec.path} (architecture from {spec.architecture_source})", file=report_out)
        print(report.render(), file=report_out)
        _say_sandbox_memory(spec, report_out)
        check_fit(spec.shape(), spec.cfg, spec.launch)
        if args.trainer_python:
            from megatron_tepo.launch.pythons import check_pythons

            try:
                for line in check_pythons(spec, args.trainer_python):
                    print(line, file=report_out)
            except FitError as exc:
                if not args.dry_run:
                    raise
                print(f"DRY RUN: a real run would stop here: {exc}", file=report_out)
            _check_sandbox_here(spec.cfg, args.dry_run, report_out)
    except (ConfigError, FitError, NotImplementedError, ValueError) as exc:
        if args.traceback:
            raise
        raise UserError(f"fit check FAILED: {exc}") from None
    if args.write_run_config:
        write_run_config(spec, args.write_run_config)
        print(f"run config written to {args.write_run_config}", file=report_out)
    if args.print_shell:
        print(render_shell(spec))
    return 0


def _say_sandbox_memory(spec, out) -> None:
    """One line of the report for a run with bubblewrap sandboxes: their worst case on the driver's
    node against the share of its memory they may take (``check_fit`` refuses more)."""
    from megatron_tepo.launch.fit import node_host_memory
    from megatron_tepo.launch.memory import SANDBOX_MEMORY_SHARE, GiB, sandbox_memory

    sb = sandbox_memory(spec.cfg)
    if sb is None:
        return
    host = node_host_memory(spec.launch)
    limit = (f"at most {SANDBOX_MEMORY_SHARE:.0%} of {host.bytes / GiB:.1f} GiB ({host.source})" if host.bytes
             else f"at most {SANDBOX_MEMORY_SHARE:.0%} of the node's memory, {host.source}")
    print(f"tool sandboxes: {sb.concurrent} at once x {sb.per_sandbox / GiB:.2f} GiB = {sb.total / GiB:.1f} GiB "
          f"on the driver's node ({limit})", file=out)


def _check_sandbox_here(cfg, dry_run: bool, out) -> None:
    """A run with a tool environment: its sandbox is made here once and runs ``print(1)`` (this is the
    job's first node, where the driver's episodes run, before any server starts); one that cannot
    start stops the job (``FitError``: exit 2), or, in a dry run, is one line and the check goes on."""
    from megatron_tepo.config.validation import sandbox_settings
    from megatron_tepo.environments.choice import check_sandbox, uses_sandbox

    if not uses_sandbox(cfg.environment.name):
        return
    from megatron_tepo.environments.sandbox import SandboxUnavailable
    from megatron_tepo.launch import FitError

    try:
        print(check_sandbox(sandbox_settings(cfg), "environment.sandbox"), file=out)
    except SandboxUnavailable as exc:
        if not dry_run:
            raise FitError(str(exc)) from None
        print(f"DRY RUN: a real run would stop here: {exc}", file=out)


cli = main  # (the name the tests use)


if __name__ == "__main__":
    sys.exit(main())
