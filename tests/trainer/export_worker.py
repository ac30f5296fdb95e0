"""Worker: the trained actor (its last checkpoint, loaded into an actor built from the starting
model) against the exported Hugging Face folder: log-probs of the same tokens.

argv[1]: JSON {"model": the starting HF folder, "checkpoint": a trainer checkpoint, "hf": the exported
folder, "prompts": a prompt file}. Writes the largest |difference| of per-token log-probs over
every prompt of the file followed by its answer, the number of tokens compared, and how far the
exported weights are from the starting ones."""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from tests.dist_utils import write_result


def main():
    args = json.loads(sys.argv[1])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tepo.actor import MegatronActor, RolloutBatch
    from megatron_tepo.config import load_config
    from megatron_tepo.actor import actor_args

    cfg = load_config(os.path.join(args["checkpoint"], "run_config.yaml"))
    actor = MegatronActor(args["model"], hf_weights=args["model"], **actor_args(cfg))
    actor.load_checkpoint(args["checkpoint"])
    tok = AutoTokenizer.from_pretrained(args["hf"])
    rows = [json.loads(x) for x in open(args["prompts"])]
    seqs = [(tok(r["prompt"])["input_ids"], tok(r["answer"])["input_ids"] + [tok.eos_token_id]) for r in rows]
    width = max(len(p) + len(a) for p, a in seqs)
    resp = max(len(a) for _, a in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), resp)
    for i, (p, a) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, :len(a)] = 1
    batch = RolloutBatch(input_ids=ids, prompt_lens=torch.tensor([len(p) for p, _ in seqs]), response_mask=mask)
    lp, _ = actor.compute_log_probs(batch)
    hf = AutoModelForCausalLM.from_pretrained(args["hf"], dtype=torch.float32).eval()
    start = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits.float(), -1)
    diff = 0.0
    for i, (p, a) in enumerate(seqs):
        for j in range(len(a)):
            diff = max(diff, abs(float(logp[i, len(p) + j - 1, ids[i, len(p) + j]]) - float(lp[i, j])))
    moved = max(float((x - y).abs().max()) for x, y in zip(hf.state_dict().values(), start.state_dict().values()))
    write_result({"max_abs_diff": diff, "tokens": int(mask.sum()), "moved_from_start": moved})


if __name__ == "__main__":
    main()
