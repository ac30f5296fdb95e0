"""torchrun worker (one process): what the actor launches, syncs and compiles (:mod:`megatron_tepo.actor.costs`).

argv[1]: JSON list of cases, each ``{"kind": ...}``:

* ``growth`` -- one step (log-prob pass, forward-backward, optimizer step) over the same 512 tokens as
  2 sequences of 256 and as 16 of 32, packed into one micro-batch; records each phase's aten ops and
  host syncs for both (the core attention left out: on CPU it is one SDPA call per sequence);
* ``optimizer_syncs`` -- the host syncs of one optimizer step at 2 and at 4 layers (bf16);
* ``compiles`` -- with ``fusions: on``, dynamo's compiled graphs after each pass over three packed
  lengths in turn (``recompute`` from the case);
* ``step`` -- one clipped train step from megatron's seeded init (``precision`` from the case):
  the grad norm, the loss and every parameter after the step (the test runs it with and without
  ``MTEPO_FAST_PATHS=0`` and compares). Also which fast paths were in effect.
"""
import atexit
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.actor import MegatronActor
from megatron_tepo.actor.costs import count_compiles, count_step
from megatron_tepo.algorithms import PolicyLoss
from megatron_tepo.batch import RolloutBatch
from tests.dist_utils import write_result
from tests.megatron.helpers import tiny_hf_config

LOSS = PolicyLoss.of("tepo", kl_coef=1e-3)


def _model_dir(layers: int) -> str:
    cfg = tiny_hf_config("qwen3", num_hidden_layers=layers, max_position_embeddings=1024)
    path = tempfile.mkdtemp(prefix="mtepo-costs-")
    atexit.register(shutil.rmtree, path, True)  # 225 of these were left in /tmp before
    cfg.save_pretrained(path)
    return path


def _batch(rows: int, length: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompt = max(1, length // 8)
    resp = length - prompt
    return RolloutBatch(input_ids=torch.randint(0, 256, (rows, length), generator=g),
                        prompt_lens=torch.full((rows,), prompt), response_mask=torch.ones(rows, resp),
                        advantages=torch.randn(rows, resp, generator=g), old_log_probs=torch.zeros(rows, resp))


def _actor(layers: int, **settings) -> MegatronActor:
    settings = {"precision": "bf16", "attention": "sdpa", "pack_sequences": True,
                "max_tokens_per_micro_batch": 4096, **settings}
    return MegatronActor(_model_dir(layers), **settings)


def growth(case):
    actor = _actor(2, precision=case.get("precision", "bf16"))
    count_step(actor, _batch(2, 64), LOSS)  # warm-up: the optimizer's state, caches
    return {shape: count_step(actor, _batch(*map(int, shape.split("x"))), LOSS) for shape in ("2x256", "16x32")}


def optimizer_syncs(case):
    out = {}
    for layers in (2, 4):
        actor = _actor(layers)
        count_step(actor, _batch(2, 64), LOSS)  # the first step creates the optimizer's state
        out[str(layers)] = count_step(actor, _batch(2, 64, seed=1), LOSS)["optimizer_step"]
    return out


def compiles(case):
    actor = _actor(2, fusions="on", recompute=case.get("recompute", "none"))
    return {"fusions": [actor.config.bias_activation_fusion, actor.config.bias_dropout_fusion],
            "graphs": count_compiles(actor, [_batch(2, 100), _batch(3, 77), _batch(4, 61)], LOSS)}


def step(case):
    from megatron_tepo.config import OptimConfig
    from megatron_tepo.megatron.fast_paths import applied_fast_paths
    from megatron_tepo.megatron.sharding import unwrap_model

    torch.manual_seed(7)  # megatron's CPU initialisation draws from torch's default generator
    actor = MegatronActor(_model_dir(2), optim=OptimConfig(lr=1e-2, clip_grad=0.05), seed=7,
                          precision=case["precision"], attention="sdpa", pack_sequences=True,
                          max_tokens_per_micro_batch=4096)
    batch = _batch(3, 48, seed=3)
    batch.old_log_probs, batch.old_entropy = actor.compute_log_probs(batch)
    metrics = actor.train_step(batch, LOSS)
    fused = [g.get("fused") for o in actor.optimizer.chained_optimizers for g in o.optimizer.param_groups]
    params = {n: p.detach().float().flatten().tolist() for n, p in unwrap_model(actor.model[0]).named_parameters()}
    return {"grad_norm": metrics["grad_norm"], "loss": metrics["loss"], "params": params,
            "fast_paths": applied_fast_paths(), "fused_adam": fused}


def main():
    cases = json.loads(sys.argv[1])
    results = []
    for case in cases:
        results.append({"growth": growth, "optimizer_syncs": optimizer_syncs, "compiles": compiles, "step": step}[case["kind"]](case))
    write_result({"cases": results})


if __name__ == "__main__":
    main()
