"""torchrun worker: a LoRA actor's adapters exported as a PEFT adapter folder, loaded by ``peft``
onto the HF base, and imported back (``actor.lora.init_from``).

argv[1]: a scratch root (shared by the ranks); argv[2]: TP size. A LoRA actor (rank 4, alpha 8,
every target, fp32) on a tiny Qwen3 with random nonzero B (A is random already, and differs per
linear) reports

* ``peft_names``: the exported adapter's tensor names (rank 0);
* ``peft_vs_merged``: the largest difference of the logits of ``peft.PeftModel`` (the HF base plus
  the exported adapter) and of the HF model holding the merged weights the weight export sends;
  ``peft_vs_actor``: the largest difference of that PEFT model's log-probs and the actor's (rank 0);
* ``import_equal``: a fresh LoRA actor started from the folder (``init_from``, other seed) holds
  the same adapters, bit for bit (gathered full tensors, every rank); ``import_lp_err``: its log-probs
  against the first actor's.
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from tests.dist_utils import write_result
from tests.megatron.helpers import hf_log_probs, hf_state, make_batch, make_hf_model, tiny_hf_config
from tests.megatron.workers.lora_worker import ACTOR, OPT, _set_random_b


def main():
    import torch.distributed as dist
    import transformers

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.config import LoraConfig
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.lora import adapter_full_tensors

    root, tp = Path(sys.argv[1]), int(sys.argv[2])
    hf_cfg = tiny_hf_config("qwen3", tie=False)
    model = make_hf_model(hf_cfg, seed=0)
    base_dir = root / "base"
    if int(os.environ.get("RANK", "0")) == 0:
        model.save_pretrained(base_dir)
    lora = LoraConfig(rank=4, alpha=8.0)
    layout = ParallelLayout(tp=tp)
    actor = MegatronActor(hf_cfg, hf_weights=hf_state(model), layout=layout, optim=OptimConfig(**OPT), lora=lora,
                          **ACTOR)
    dist.barrier()
    _set_random_b(actor)
    batch = make_batch(seed=1)
    lp, _ = actor.compute_log_probs(batch)
    merged = {n: t.clone() for n, t in actor.export_hf_state()}
    folder = actor.export_peft(root / "peft", str(base_dir))
    want = {n: t.clone() for n, t in adapter_full_tensors(actor.model)}
    out = {}
    if dist.get_rank() == 0:
        from peft import PeftModel
        from safetensors.torch import load_file

        out["peft_names"] = sorted(load_file(str(folder / "adapter_model.safetensors")))
        out["adapter_config"] = json.loads((folder / "adapter_config.json").read_text())
        peft_model = PeftModel.from_pretrained(make_hf_model(hf_cfg, seed=0), str(folder)).eval()
        merged_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager",
                                                                     dtype=torch.float32)
        merged_model.load_state_dict(merged, strict=True)
        with torch.no_grad():
            got = peft_model(input_ids=batch.input_ids).logits
            ref = merged_model.eval()(input_ids=batch.input_ids).logits
            out["peft_vs_merged"] = float((got - ref).abs().max())
            plp, _ = hf_log_probs(peft_model, batch)
        out["peft_vs_actor"] = float((plp - lp).abs().max())
        out["lp_scale"] = float(lp.abs().max())
    del actor
    imported = MegatronActor(hf_cfg, hf_weights=hf_state(model), layout=layout, optim=OptimConfig(**OPT), seed=99,
                             lora=LoraConfig(rank=4, alpha=8.0, init_from=str(root / "peft")), **ACTOR)
    got = {n: t.clone() for n, t in adapter_full_tensors(imported.model)}
    out["import_equal"] = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    ilp, _ = imported.compute_log_probs(batch)
    out["import_lp_err"] = float((ilp - lp).abs().max())
    write_result(out)


if __name__ == "__main__":
    main()
