"""torchrun worker of test_sglang_tp2_sync.py: a MegatronActor at TP=2 pushes its weights to a
real SGLang server that runs at TP=2 itself (two TP worker processes), in ``distributed`` mode.

argv[1]: JSON {"url", "key", "weights" (a safetensors file with the actor's HF weights, not the
server's), "config_dir", "prompts", "max_new_tokens", "seq", "prompt_len", "bucket_bytes"}. The
fleet attaches by URL, so the sync has to ask the server its TP size. Rank 0 generates greedily
and scores ``seq`` before and after the push (collective: both ranks drain the export) and writes
both, with the update group's rank offsets and world size and the push's stats.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch.distributed as dist

from tests.dist_utils import write_result


def main():
    args = json.loads(sys.argv[1])
    from safetensors.torch import load_file

    from megatron_tepo.actor.actor import MegatronActor
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
    from megatron_tepo.rollout.sglang.weight_sync import DistributedSync

    actor = MegatronActor(args["config_dir"], hf_weights=load_file(args["weights"]),
                          layout=ParallelLayout(tp=2, pp=1), precision="fp32")
    rank = dist.get_rank()
    fleet = (SGLangFleet(FleetConfig(urls=[args["url"]], api_keys=[args["key"]], router="none"))
             if rank == 0 else None)

    def observe():
        s = fleet.servers[0]
        gens = []
        for p in args["prompts"]:
            o = s.post("/generate", {"input_ids": p, "sampling_params": {"max_new_tokens": args["max_new_tokens"],
                                                                         "temperature": 0.0, "ignore_eos": True},
                                     "return_logprob": True}, timeout=300)
            gens.append(o["output_ids"])
        o = s.post("/generate", {"input_ids": args["seq"], "sampling_params": {"max_new_tokens": 0},
                                 "return_logprob": True, "logprob_start_len": args["prompt_len"] - 1}, timeout=300)
        return {"greedy": gens, "log_probs": [t[0] for t in o["meta_info"]["input_token_logprobs"][1:]]}

    before = observe() if rank == 0 else None
    dist.barrier()
    ws = DistributedSync(fleet, bucket_bytes=args["bucket_bytes"], is_sender=rank == 0, timeout=600.0)
    sent = []
    if rank == 0:  # record what the update group was told (the arithmetic under test)
        real_start = ws._start_each

        def start_each(path, posts, *rest, **kw):
            if path == "/init_weights_update_group":
                sent.extend({"rank_offset": p["rank_offset"], "world_size": p["world_size"]} for _, p in posts)
            return real_start(path, posts, *rest, **kw)

        ws._start_each = start_each
    stats = ws.push(actor.export_hf_state("param"))
    dist.barrier()
    if rank == 0:
        after = observe()
        write_result({"before": before, "after": after, "group": sent,
                      "tp_size": getattr(fleet.servers[0], "tp_size", None), "tensors": stats.tensors,
                      "buckets": stats.buckets})
    ws.close()


if __name__ == "__main__":
    main()
