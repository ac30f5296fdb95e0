"""torchrun worker: one train step of the actor built exactly as the trainer builds it.

argv[1]: JSON {"run_config": the run.yaml that ``tools/fit_check.py --write-run-config`` wrote,
"model_dir": an HF model directory}. Builds ``MegatronActor(model_dir, hf_weights=model_dir,
**megatron_tepo.actor.actor_args(cfg))``, takes one optimizer step on a random batch and reports the
``TransformerConfig`` fields the actor section sets, the loss and whether the weights moved.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import make_batch


def main():
    args = json.loads(sys.argv[1])
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor import MegatronActor
    from megatron_tepo.config import load_config
    from megatron_tepo.megatron.sharding import unwrap_model
    from megatron_tepo.actor import actor_args

    cfg = load_config(args["run_config"])
    actor = MegatronActor(args["model_dir"], hf_weights=args["model_dir"], **actor_args(cfg))
    c = actor.config
    batch = make_batch(seed=1, vocab=actor.family_cfg.vocab_size)
    batch.old_log_probs = torch.full_like(batch.response_mask, -2.0) * batch.response_mask
    before = {n: t.clone() for n, t in actor.export_hf_state()}
    m = actor.train_step(batch.split_for_data_parallel(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
                         PolicyLoss.of(cfg.algorithm.loss))
    after = dict(actor.export_hf_state())
    write_result({
        "tc": {"bf16": c.bf16, "params_dtype": str(c.params_dtype), "sequence_parallel": c.sequence_parallel,
               "recompute_granularity": c.recompute_granularity, "recompute_method": c.recompute_method,
               "recompute_num_layers": c.recompute_num_layers, "tp": c.tensor_model_parallel_size,
               "pp": c.pipeline_model_parallel_size, "ep": c.expert_model_parallel_size,
               "bias_activation_fusion": c.bias_activation_fusion},
        "attention": actor.settings.attention, "packed": actor.settings.pack_sequences,
        "core_attention": type(unwrap_model(actor.model[0]).decoder.layers[0].self_attention.core_attention).__name__,
        "loss": m["loss"], "moved": any(not torch.equal(before[n], after[n]) for n in before)})


if __name__ == "__main__":
    main()
