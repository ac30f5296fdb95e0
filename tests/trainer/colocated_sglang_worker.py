"""A TP=2 training run (torchrun, gloo, 2 processes) on a real SGLang CPU server, attached by URL
(``TEPO_SGLANG_URLS``, ``TEPO_SGLANG_API_KEY``), colocated or not (``"colocated"``), with the
``ipc`` weight sync: tools/train.py's wiring (the task, the actor, the engine from the registry on
the driver and a follower elsewhere, ``train()``), plus two checks.

* After every weight sync (the engine's ``update_weights`` wrapped on every rank, since the export
  is collective) the actor's weights are exported once more, gathered to rank 0 and loaded into an
  HF model (float32): its greedy completions of three prompts are what the server must generate.
  The export's digest (sha256 of its tensors) and the HF model's log-probs of the three prompts'
  tokens are kept too.
* After every step (``on_step``, on rank 0: the engine holds its memory again by then) the server
  is asked for those completions greedily, and for its log-probs of the same prompt tokens.

Sampling is made reproducible (two runs must sample alike; SGLang honours ``sampling_seed`` only
with ``--enable-deterministic-inference``, which its CPU attention backend does not support): each
sample is a request of its own and the requests go one at a time, so that a fresh server started
with a fixed ``--random-seed`` draws the same numbers for them in either run.

Writes (rank 0) ``{"checks": [{"step", "got", "want", "digest", "lp_gap"}], "fleet": ...}`` (``lp_gap``: the
largest difference between the server's prompt log-probs and the HF model's) with tests/dist_utils.write_result;
the metrics go to ``<out>/metrics.jsonl``.

    torchrun --nproc-per-node 2 tests/trainer/colocated_sglang_worker.py '{"tiny": ..., "out": ..., "colocated": true, "steps": 3}'
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tests.dist_utils import write_result  # noqa: E402
from tests.rollout.fleet_recovery_worker import GREEDY_TOKENS, greedy  # noqa: E402


def main(args):
    import requests
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tepo.config import load_config
    from megatron_tepo.metrics import MetricsLogger
    from megatron_tepo.rollout.engine import gathered_tensors
    from megatron_tepo.trainer.loop import train
    from megatron_tepo.trainer.main import build_actor_and_engine, build_task

    tiny, out = Path(args["tiny"]), Path(args["out"])
    model_dir = str(tiny / "model")
    cfg = load_config([str(REPO / "examples/tiny_tepo/config.yaml")], [
        f"model.path={model_dir}", f"data.train_files=[{tiny / 'train.jsonl'}]", "reward.kind=exact_match",
        "rollout.prompts_per_step=8", "rollout.n_samples=4", "train.mini_batch_prompts=4", "rollout.max_sampling_rounds=1",
        "rollout.engine=sglang", "rollout.router=none", "rollout.sync_mode=ipc", "rollout.sync_dtype=float32",
        f"rollout.colocated={str(args['colocated']).lower()}", "parallel.tp=2", f"train.steps={args['steps']}",
        "train.save_every=0", "train.async_save=false", f"train.output_dir={out}"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(cfg.train.seed)
    task, _ = build_task(cfg, tokenizer, None)
    actor, engine = build_actor_and_engine(cfg, model_dir, task.pad_token_id)
    driver = int(os.environ.get("RANK", "0")) == 0
    hf = AutoModelForCausalLM.from_pretrained(model_dir) if driver else None  # float32, as saved
    prompts = task.train_prompts[:3]
    want, checks, synced = [], [], {}
    sync = engine.update_weights

    def prompt_log_probs(model, p):  # log p(p[i] | p[:i]) for i >= 1, float32
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p])).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(p[1:]).view(-1, 1)).view(-1).tolist()

    def update_weights(named_tensors):  # every rank: the sync, then the reference (a collective export)
        sync(named_tensors)
        export = dict(gathered_tensors(actor.export_hf_state()))
        if driver:
            missing, unexpected = hf.load_state_dict(export, strict=False)
            assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
            want[:] = [greedy(hf, p) for p in prompts]
            digest = hashlib.sha256()
            for name in sorted(export):
                digest.update(name.encode() + export[name].float().contiguous().numpy().tobytes())
            synced.update(digest=digest.hexdigest(), log_probs=[prompt_log_probs(hf, p) for p in prompts])

    engine.update_weights = update_weights
    if driver:  # reproducible sampling (see the module docstring): one sample per request, one at a time
        generate = engine.generate
        engine.cfg.partial_inflight = 1  # (one request in flight over the fleet)

        def one_by_one(prompts, n=1, **kw):
            groups = generate([p for p in prompts for _ in range(n)], n=1, **kw)
            return [[g[0] for g in groups[i * n:(i + 1) * n]] for i in range(len(prompts))]

        engine.generate = one_by_one

    def on_step(step, metrics):  # the driver, after the step's sync and the engine's memory back
        s = engine.servers[0]
        got = [requests.post(s.url + "/generate", headers=s.headers(), timeout=120, json={
            "input_ids": p, "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0.0,
                                                "ignore_eos": True}}).json()["output_ids"] for p in prompts]
        gap = 0.0
        for p, ref in zip(prompts, synced["log_probs"]):
            meta = requests.post(s.url + "/generate", headers=s.headers(), timeout=120, json={
                "input_ids": p, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}).json()["meta_info"]
            served = [float(x[0]) for x in meta["input_token_logprobs"][1:]]
            assert len(served) == len(ref), (len(served), len(ref))
            gap = max([gap] + [abs(a - b) for a, b in zip(served, ref)])
        checks.append({"step": step, "got": got, "want": list(want), "digest": synced["digest"], "lp_gap": gap})

    logger = MetricsLogger(out / "metrics.jsonl") if driver else None
    try:
        train(cfg, actor, engine, task, logger=logger, on_step=on_step, checkpoint_root=out / "checkpoints",
              report=lambda line: print(f"[train] {line}", flush=True))
        fleet = {"servers": [s.describe() for s in engine.servers],
                 "sync_mode": type(engine.weight_sync).__name__} if driver else {}
    finally:
        if logger is not None:
            logger.close()
        engine.close()
    if driver:
        write_result({"checks": checks, **fleet})


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
