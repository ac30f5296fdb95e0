"""torchrun worker: a MegatronActor at TP=2 pushes its weights to real SGLang servers.

argv[1]: JSON {"urls", "keys", "model_dir" (the servers' original weights), "weights" (a
safetensors file with the actor's HF weights), "config_dir", "modes", "seq", "prompt_len",
"bucket_bytes", "shared_dir"}. For each mode, rank 0 resets the servers to the original weights
(from disk), scores the fixed text, the actor exports + pushes (collective: both ranks drain the
export), and rank 0 scores again. Rank 0 writes before/after log-probs per server and the stats.
"""
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from tests.dist_utils import write_result


def reset_weights(server, model_dir: str) -> None:
    """The server back on ``model_dir``'s weights. An earlier test's requests may still be winding down
    on the shared server: SGLang then loads the weights but answers HTTP 400 (its cache not flushed
    while requests run); asked again until it flushes (up to 120 s)."""
    from megatron_tepo.rollout.sglang.client import RequestFailed

    deadline = time.time() + 120
    while True:
        try:
            out = server.post("/update_weights_from_disk", {"model_path": model_dir}, timeout=300)
            break
        except RequestFailed as exc:
            if "cache was not flushed" not in str(exc) or time.time() > deadline:
                raise
            time.sleep(1.0)
    assert out.get("success"), out


def main():
    args = json.loads(sys.argv[1])
    from safetensors.torch import load_file

    from megatron_tepo.actor.actor import MegatronActor
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
    from megatron_tepo.rollout.sglang.weight_sync import make_weight_sync

    actor = MegatronActor(args["config_dir"], hf_weights=load_file(args["weights"]),
                          layout=ParallelLayout(tp=2, pp=1), precision="fp32")
    rank = dist.get_rank()
    fleet = SGLangFleet(FleetConfig(urls=args["urls"], api_keys=args["keys"])) if rank == 0 else None
    seq, pl = args["seq"], args["prompt_len"]

    def score_each():
        outs = []
        for s in fleet.servers:
            o = s.post("/generate", {"input_ids": seq, "sampling_params": {"max_new_tokens": 0},
                                     "return_logprob": True, "logprob_start_len": pl - 1})
            outs.append([t[0] for t in o["meta_info"]["input_token_logprobs"][1:]])
        return outs

    result = {"modes": {}}
    for mode in args["modes"]:
        if rank == 0:
            for s in fleet.servers:
                reset_weights(s, args["model_dir"])
            before = score_each()
        dist.barrier()
        own = {"shared_dir": args["shared_dir"]} if mode == "disk" else {}
        ws = make_weight_sync(mode, fleet, bucket_bytes=args["bucket_bytes"], is_sender=rank == 0, **own)
        stats = ws.push(actor.export_hf_state("param"))
        ws.close()
        dist.barrier()
        if rank == 0:
            result["modes"][mode] = {"before": before, "after": score_each(), "tensors": stats.tensors,
                                     "buckets": stats.buckets, "bytes": stats.bytes,
                                     "peak_bucket_bytes": stats.peak_bucket_bytes}
    write_result(result)


if __name__ == "__main__":
    main()
