#!/usr/bin/env python
"""Train a Hugging Face checkpoint with TEPO (or any baseline) on prompt files.

    python tools/train.py --config examples/ablations/table1_tepo_qwen2.5_7b.yaml --config my_run.yaml \\
        model.path=/models/Qwen2.5-7B data.train_files=[dapo_math.parquet] train.output_dir=runs/tepo

(``torchrun --nproc-per-node N tools/train.py ...`` for a TP / PP / DP actor.) Writes under
``train.output_dir``: ``config.yaml`` (what runs), ``metrics.jsonl``, ``checkpoints/step_N``
(every ``train.save_every`` steps and the last), ``hf/`` (the trained policy as a Hugging Face
model, ``train.export_hf``) and ``summary.json``. Running the same command again resumes.

Exit status: 0; 2 for a user error (a bad setting or file: one line, ``--traceback`` for the
whole story); 3 when the run made no update at all (the policy did not change: the line says
why; also after ``fault.max_steps_without_update`` steps in a row without an update); 75 from a
rank the hang watchdog stopped (megatron_tepo/trainer/watchdog.py; under torchrun the command's
status is torchrun's, 1). With ``TEPO_EXIT_REASON_FILE`` set (slurm/lib.sh does), exits 2 and 3 and
the watchdog write there why, and whether requeueing the job could help. See
megatron_tepo/trainer/main.py for what it wires together and what it leaves out.
"""
import argparse
import os
import sys


from megatron_tepo.cli import add_traceback_flag, prog, user_errors

EXIT_NO_UPDATE = 3


def command(argv=None) -> dict:
    """The command: parse, train, print the summary; returns it (``SystemExit`` 2 or 3 on an error)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", required=True, help="config file (repeatable, merged in order)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    add_traceback_flag(ap)
    args = ap.parse_args(argv)
    from megatron_tepo.trainer.main import NoUpdateError, main

    from megatron_tepo.trainer.watchdog import write_exit_reason

    try:
        with user_errors(prog(), args.traceback):
            try:
                summary = main(args.config, args.overrides)
            except NoUpdateError as exc:
                write_exit_reason("no_update", False, str(exc))  # it would stall again: no requeue
                if args.traceback:
                    raise
                if os.environ.get("RANK", "0") == "0":
                    print(f"{prog()}: {exc}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_NO_UPDATE) from None
    except SystemExit as exc:
        if exc.code == 2:  # a bad setting or input file (the line above says which): it would fail again
            write_exit_reason("user_error", False, "a bad setting or input file: see the error line in the log")
        raise
    if os.environ.get("RANK", "0") == "0":
        print(summary)
    return summary


def main(argv=None) -> int:
    command(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
