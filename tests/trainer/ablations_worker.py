"""Run one RL step of every examples/ablations config through the same loop, actor and engine.

Writes per config: finite metrics, whether the actor's weights moved, and the engine/actor drift.
"""
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "tiny_tepo"))


def main(out_path):
    from megatron_tepo.megatron.parallel import single_process_env

    single_process_env()
    import torch

    import run as tiny
    from megatron_tepo.config import load_config
    from megatron_tepo.trainer import Task, train
    from megatron_tepo.trainer.main import build_actor_and_engine

    sft = tiny.addition.warm_up(REPO / ".cache" / "tiny_tepo")
    base = load_config(REPO / "examples/tiny_tepo/config.yaml")
    actor, engine = build_actor_and_engine(base, str(sft), tiny.addition.PAD)
    items = tiny.addition.problems(500, seed=1)
    task = Task([p for p, _ in items], [a for _, a in items], tiny.addition.reward_fn, [tiny.addition.EOS], tiny.addition.PAD)
    overrides = ["rollout.prompts_per_step=8", "rollout.n_samples=4", "rollout.max_new_tokens=4",
                 "train.steps=1", "train.mini_batch_prompts=4", "train.epochs_per_step=1", "optim.lr=1e-4",
                 "rollout.max_sampling_rounds=3"]
    results = {}
    for path in sorted((REPO / "examples" / "ablations").glob("[!_]*.yaml")):
        cfg = load_config(path, overrides)
        before = {n: t.clone() for n, t in actor.export_hf_state()}
        history = train(cfg, actor, engine, task)
        after = dict(actor.export_hf_state())
        m = history[-1]
        results[path.stem] = {
            "finite": all(isinstance(v, (int, float)) and math.isfinite(v) for v in m.values()),
            "bad": [k for k, v in m.items() if not (isinstance(v, (int, float)) and math.isfinite(v))],
            "moved": any(not torch.equal(before[n], after[n]) for n in before),
            "drift_max": m.get("drift_max", float("nan")), "skipped": m.get("skipped_step", 0.0),
            "keys": sorted(m),
        }
    # A NaN loss: the update is skipped and reported, the weights stay finite and unchanged.
    from megatron_tepo.batch import RolloutBatch
    from megatron_tepo.algorithms import PolicyLoss
    from megatron_tepo.trainer.loop import generate_groups, policy_update
    import random

    cfg = load_config(REPO / "examples/tiny_tepo/config.yaml", overrides)
    prompts, groups, rewards, _ = generate_groups(engine, task, list(range(8)), cfg, random.Random(0))
    batch = RolloutBatch.from_groups(prompts, groups, tiny.addition.PAD, advantages=torch.zeros(sum(len(g) for g in groups)))
    batch.old_log_probs, batch.old_entropy = actor.compute_log_probs(batch)
    batch.advantages = torch.where(batch.response_mask != 0, torch.full_like(batch.advantages, float("nan")),
                                   batch.advantages)
    before = {n: t.clone() for n, t in actor.export_hf_state()}
    m = policy_update(actor, batch, PolicyLoss.from_config(cfg.algorithm))
    after = dict(actor.export_hf_state())
    results["_nan"] = {"skipped": m["skipped_update"], "loss": m["loss"],
                       "unchanged": all(torch.equal(before[n], after[n]) for n in before)}
    batch.advantages = torch.nan_to_num(batch.advantages, nan=1.0) * batch.response_mask
    m = policy_update(actor, batch, PolicyLoss.from_config(cfg.algorithm))
    after2 = dict(actor.export_hf_state())
    results["_after_nan"] = {"skipped": m["skipped_update"],
                             "finite": all(bool(torch.isfinite(t).all()) for t in after2.values()),
                             "moved": any(not torch.equal(after[n], after2[n]) for n in after)}
    # Rollout correction on, and the engine's log-probs as the old policy's: the loop runs both
    # (the engine first gets the weights of the updates above, made outside the loop).
    from megatron_tepo.trainer.loop import sync_weights

    sync_weights(actor, engine)
    for key, extra in (("_correction", ["algorithm.rollout_correction.rollout_is=geometric",
                                        "algorithm.rollout_correction.rollout_rs=token",
                                        "algorithm.rollout_correction.rollout_rs_bounds=[0.999, 1.001]"]),
                       ("_old_from_rollout", ["algorithm.old_log_prob=rollout", "algorithm.delta_entropy=predicted",
                                              "algorithm.kl_coef=0.001"])):
        cfg = load_config(REPO / "examples/tiny_tepo/config.yaml", overrides + extra)
        before = {n: t.clone() for n, t in actor.export_hf_state()}
        m = train(cfg, actor, engine, task)[-1]
        after = dict(actor.export_hf_state())
        results[key] = {"metrics": {k: v for k, v in m.items() if k.startswith(("rollout_", "drift_", "updates"))},
                        "moved": any(not torch.equal(before[n], after[n]) for n in before)}
    # One-step-off generation: step k trains on the rollout generated with the weights step k-1
    # started from; the correction sees the one-update difference.
    cfg = load_config(REPO / "examples/tiny_tepo/config.yaml",
                      overrides + ["train.steps=3", "rollout.max_staleness=1",
                                   "algorithm.rollout_correction.rollout_is=token"])
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train(cfg, actor, engine, task)
    results["_one_step_off_warnings"] = [str(w.message) for w in caught if "max_staleness" in str(w.message)]
    results["_one_step_off"] = [{k: m.get(k) for k in ("rollout_staleness", "drift_max", "rollout_mismatch_kl",
                                                      "rollout_is_weight", "updates")} for m in history]
    # A deliberate mismatch: the engine samples at temperature 0.7, the actor scores at 1.0. The
    # correction's token weights are then the known ratio p_1(token) / p_0.7(token).
    from megatron_tepo.algorithms import RolloutCorrection, rollout_correction_weights

    prompts = [task.train_prompts[i] for i in range(6)]
    groups = engine.generate(prompts, n=3, temperature=0.7, max_new_tokens=6, stop_token_ids=task.stop_token_ids)
    batch = RolloutBatch.from_groups(prompts, groups, tiny.addition.PAD, temperature=1.0)
    old, _ = actor.compute_log_probs(batch)
    mask = batch.response_mask != 0
    w, _ = rollout_correction_weights(old, batch.rollout_log_probs, mask, RolloutCorrection("token", 1e6))
    with torch.no_grad():
        logits = engine.model(input_ids=batch.input_ids).logits.float()
    worst, tokens = 0.0, 0
    for i in range(batch.batch_size):
        p = int(batch.prompt_lens[i])
        for j in range(int(mask[i].sum())):
            z, tok = logits[i, p + j - 1], batch.input_ids[i, p + j]
            known = float(torch.exp(torch.log_softmax(z, -1)[tok] - torch.log_softmax(z / 0.7, -1)[tok]))
            worst = max(worst, abs(float(w[i, j]) / known - 1))
            tokens += 1
    results["_mismatch"] = {"worst_rel_err": worst, "tokens": tokens,
                            "spread": float(w[mask].max() - w[mask].min())}
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
