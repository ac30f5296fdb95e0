"""torchrun worker (1 process): a published-style Qwen3.5 checkpoint (``Qwen3_5ForConditionalGeneration``:
the text model under ``model.language_model.``, a vision tower, ``mtp.*`` tensors) through the actor.

    conditional_generation_worker.py ROOT

ROOT/hf (made by the test) -> the actor loads its text model; log-probs against transformers'
``Qwen3_5ForConditionalGeneration`` text-only forward; one training step; then
* ``actor.export_hf`` -> ROOT/export (the source's config and names, the carried tensors);
* the conversion sidecars each of the trainer's checkpoints gets -> ROOT/sidecars;
* the embedded engine on ROOT/hf takes the actor's weight update (its export stream): each of its
  parameters equals the stream's tensor; its generation log-probs against transformers' model of
  ROOT/export.
Results (errors, names) via write_result; the test asserts.
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import hf_log_probs, make_batch


def conditional_generation(path):
    import transformers

    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()


def main():
    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.rollout.embedded import EmbeddedEngine

    root = Path(sys.argv[1])
    hf = root / "hf"
    out = {}
    actor = MegatronActor(str(hf), hf_weights=str(hf), optim=OptimConfig(lr=1e-3), precision="fp32",
                          attention="sdpa", pack_sequences=True, max_tokens_per_micro_batch=64)
    batch = make_batch(seed=1)
    with torch.no_grad():
        ref_lp, ref_ent = hf_log_probs(conditional_generation(hf), batch)
    lp, ent = actor.compute_log_probs(batch)
    out["logprob_abs_err"] = float((lp - ref_lp).abs().max())
    out["entropy_abs_err"] = float((ent - ref_ent).abs().max())
    batch.old_log_probs = (ref_lp + 0.05 * torch.randn(ref_lp.shape, generator=torch.Generator().manual_seed(7))) \
        * batch.response_mask
    actor.train_step(batch, PolicyLoss.of(name="grpo"))

    stream = {n: t.clone() for n, t in actor.export_hf_state()}  # what the weight sync sends
    out["stream_names"] = sorted(stream)
    actor.export_hf(root / "export", str(hf))
    (root / "sidecars").mkdir()
    actor.write_conversion_files(root / "sidecars", str(hf))  # (what each of the trainer's checkpoints gets)
    torch.save(stream, root / "stream.pt")

    # the embedded engine on the published folder, updated from the actor's export
    engine = EmbeddedEngine(str(hf), seed=3)
    out["engine_model"] = type(engine.model).__name__
    engine.update_weights(iter(stream.items()))
    params = dict(engine.model.named_parameters())
    out["engine_params"] = sorted(params)
    out["engine_differ"] = sorted(n for n, p in params.items() if not torch.equal(p.detach(), stream[n]))
    prompts = [[5, 17, 42], [7, 9]]
    groups = engine.generate(prompts, n=2, temperature=1.0, max_new_tokens=6)
    model = conditional_generation(root / "export")  # the exported folder: the trained weights
    err = 0.0
    with torch.no_grad():
        for prompt, group in zip(prompts, groups):
            for sample in group:
                ids = torch.tensor([prompt + sample.token_ids])
                logp = torch.log_softmax(model(input_ids=ids).logits.float()[0], -1)
                want = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
                err = max(err, float((want - torch.tensor(sample.log_probs)).abs().max()))
    out["engine_logprob_abs_err"] = err
    write_result(out)


if __name__ == "__main__":
    main()
