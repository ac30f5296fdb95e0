"""One process: ``kill -9`` while an asynchronous checkpoint save is in flight (issue #32 row 8).

``run ROOT``: an actor trains a step and saves ``step_1`` asynchronously (published), keeping its
parameters in ``ROOT/expected.pt``; it trains another step, starts the asynchronous save of
``step_2`` and kills itself with SIGKILL right away (the writer process it forked may still be
writing). ``resume ROOT``: a fresh actor resumes from the newest complete checkpoint under ROOT and
writes ``ROOT/resumed.json``: which one it took, whether its parameters equal ``expected.pt``, and
the directories it found.
"""
import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from tests.megatron.helpers import hf_state, make_batch, make_hf_model, tiny_hf_config


def _actor(weights):
    from megatron_tepo.actor import MegatronActor

    # (on a GPU, where the GPU check runs this: the host copy of CUDA tensors, then the forked writer)
    return MegatronActor(tiny_hf_config("qwen3"), hf_weights=weights, precision="fp32", attention="sdpa",
                         packed_attention="loop")


def _batch(seed):
    b = make_batch(seed=seed)
    b.old_log_probs = -2.0 * b.response_mask
    return b


def _params(actor):
    return {n: p.detach().cpu().clone() for n, p in actor.model[0].named_parameters()}


def main():
    from megatron_tepo.algorithms import PolicyLoss
    from megatron_tepo.megatron.parallel import single_process_env

    mode, root = sys.argv[1], Path(sys.argv[2])
    single_process_env()
    loss = PolicyLoss.of("grpo")
    if mode == "run":
        actor = _actor(hf_state(make_hf_model(tiny_hf_config("qwen3"), seed=0)))
        actor.train_step(_batch(1), loss)
        actor.save_checkpoint(root / "step_1", {"step": 1}, asynchronous=True)
        torch.save(_params(actor), root / "expected.pt")
        actor.finalize_checkpoints(blocking=True)
        actor.train_step(_batch(2), loss)
        actor.save_checkpoint(root / "step_2", {"step": 2}, asynchronous=True)
        os.kill(os.getpid(), signal.SIGKILL)  # before the save is published
    else:
        from megatron_tepo.actor.checkpointing import load_newest_checkpoint

        actor = _actor(None)
        listing = sorted(p.name for p in root.iterdir())
        path, extra = load_newest_checkpoint(actor.train_model, root, optim=actor.optim_cfg)
        want, got = torch.load(root / "expected.pt"), _params(actor)
        (root / "resumed.json").write_text(json.dumps({
            "path": path.name, "extra": extra, "listing": listing,
            "params_equal": sorted(want) == sorted(got) and all(torch.equal(want[n], got[n]) for n in want)}))


if __name__ == "__main__":  # (dist_checkpointing starts processes)
    main()
