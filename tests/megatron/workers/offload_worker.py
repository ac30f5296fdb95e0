"""torchrun worker: the actor's memory to the host and back (colocated mode, issue #34).

argv[1]: JSON list of cases ``{"tp", "precision", "dist_opt"}``. Per case, two actors from the same
HF weights take the same steps; one of them, with Adam's moments made and a second batch's
gradients in its buffers, offloads its optimizer states, gradients and parameters and onloads them,
twice. Recorded per rank: the bytes each part moved, whether every storage of every part had its
memory freed while offloaded, whether the parameters, gradients and optimizer states are bit for
bit what they were, whether the host copies were reused the second time, what an offload of the
optimizer alone leaves in place, and whether the next two steps give the same weights as the
actor that never offloaded.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import make_hf_model, state_case_actor, tiny_hf_config, update_batch

LOSS = PolicyLoss.of("grpo")


def _snapshot(actor):
    """Every part's tensors, cloned, by part."""
    return {part: [t.detach().clone() for t in tensors] for part, tensors in actor.train_model.memory_parts().items()}


def _equal(a, b):
    return all(len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a)


def _freed(actor, parts):
    tensors = actor.train_model.memory_parts()
    return all(t.untyped_storage().nbytes() == 0 for part in parts for t in tensors[part])


def case(spec):
    cfg = tiny_hf_config("qwen3")
    hf = make_hf_model(cfg, seed=0)
    moved, plain = state_case_actor(spec, cfg, hf), state_case_actor(spec, cfg, hf)
    for a in (moved, plain):
        a.train_step(update_batch(10), LOSS)  # Adam's moments exist
        a.forward_backward(update_batch(20), LOSS)  # gradients in the buffers
    before = _snapshot(moved)
    out = {"sizes": {k: len(v) for k, v in before.items()},
           "nonzero_grads": any(bool(g.abs().sum() > 0) for g in before["grads"])}
    rounds = []
    for _ in range(2):
        n_out = moved.offload(("optimizer", "grads", "params"))
        freed = _freed(moved, ("optimizer", "grads", "params"))
        offloaded = list(moved.train_model.offloaded)
        host = dict(moved.train_model._host)
        n_in = moved.onload()
        rounds.append({"out": n_out, "in": n_in, "freed": freed, "offloaded": offloaded,
                       "back": list(moved.train_model.offloaded), "equal": _equal(before, _snapshot(moved)),
                       "host_ids": {k: id(v) for k, v in host.items()}})
    out["rounds"] = rounds
    # the optimizer alone: the parameters and gradients keep their memory
    moved.offload(("optimizer",))
    out["optimizer_only"] = {"optimizer_freed": _freed(moved, ("optimizer",)),
                             "params_kept": all(t.untyped_storage().nbytes() > 0
                                                for t in moved.train_model.memory_parts()["params"])}
    moved.onload()
    try:
        moved.offload(("activations",))
    except ValueError as exc:
        out["unknown_part"] = str(exc)
    for a in (moved, plain):
        a.optimizer_step()
        a.train_step(update_batch(30), LOSS)
    out["same_as_never_offloaded"] = _equal(_snapshot(moved), _snapshot(plain))
    return out


def main():
    cases = json.loads(sys.argv[1])
    write_result({"cases": [case(c) for c in cases]})


if __name__ == "__main__":
    main()
