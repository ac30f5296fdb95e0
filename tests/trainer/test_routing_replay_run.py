"""The main job's loop on a tiny Qwen3-MoE with the embedded engine and ``actor.routing_replay: r3``
(issue 41): the engine returns each sample's routing, the trainer carries it in the batch, the
actor replays it in the old-log-prob pass and in every update, and the step metrics hold the gates of
both passes (``old_routing_*``: the old-log-prob pass): coverage 1.0, and the actor's unforced routing agrees with the engine's (both fp32: the same
experts but for an fp32 near tie). ``r2`` runs through the same loop."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import REPO, kill_at_checkpoint

BASE = ["--config", str(REPO / "examples/tiny_tepo/config.yaml"), "reward.kind=exact_match",
        "rollout.prompts_per_step=8", "train.mini_batch_prompts=4", "train.steps=2", "train.export_hf=false",
        "rollout.dynamic_sampling=false"]  # (a random MoE scores 0 everywhere: keep the equal-reward groups)


def _moe_model(tiny: Path, out: Path) -> Path:
    """A random tiny Qwen3-MoE (2 layers, 8 experts, top-2) with the tiny task's tokenizer
    (tools/make_tiny_model.py's ``make_moe``, which the GPU check runs too)."""
    sys.path.insert(0, str(REPO / "tools"))
    from make_tiny_model import make_moe

    return make_moe(tiny, out)


@pytest.mark.journey  # (a whole tools/train.py run: tools/test.sh runs these beside the rest)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["r2"])  # (r3: the one-step-off kill test below runs it and checks the same gates)
def test_the_loop_replays_the_routing_and_logs_the_gates(tiny, tmp_path, mode):
    model = _moe_model(tiny, tmp_path / "moe")
    out = tmp_path / "run"
    args = [*BASE, f"model.path={model}", f"data.train_files=[{tiny / 'train.jsonl'}]", f"train.output_dir={out}",
            f"actor.routing_replay={mode}"]
    proc = subprocess.run([sys.executable, str(REPO / "tools/train.py"), *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["updates"] > 0 and m["routing_coverage"] == 1.0, m
        # the actor routes as the engine did (r3) / as it did itself one pass before (r2): fp32 on
        # both sides, so any disagreement is a near tie in the router's logits
        assert m["routing_mismatch_max"] <= 1e-2 and m["routing_mismatch_mean"] <= 1e-2, m
        assert m["drift_max"] < 1e-4, m  # the engine's log-probs equal the actor's (replayed) ones
        if mode == "r3":  # the old-log-prob pass replays the engine's routing too, and logs its gates
            assert m["old_routing_coverage"] == 1.0 and m["old_routing_mismatch_max"] <= 1e-2, m
        else:  # r2: that pass records the actor's own routing: nothing replayed, no gate
            assert not any(k.startswith("old_routing") for k in m), m


VOLATILE = {"time", "step_s", "sync_s", "rollout_s", "train_s", "tokens_per_s"}


@pytest.mark.journey
@pytest.mark.timeout(900)
def test_a_one_step_off_r3_run_killed_after_a_checkpoint_resumes_and_equals_the_uninterrupted_run(tiny, tmp_path):
    """The fourth GPU reading's row 8: one step off, the checkpoint holds the next step's rollout,
    whose samples must keep their routing. An r3 run of 3 steps (the reference: the engine's routing
    replayed in the old-log-prob pass and every update, coverage 1.0), and the same run killed with
    SIGKILL once step 2's checkpoint is complete, then resumed: step 3 trains on the saved rollout
    (its routing read back from the checkpoint) and every metric equals the reference's. On the old
    writer the resumed run failed: ``routed_experts: the batch has none``."""
    model = _moe_model(tiny, tmp_path / "moe")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

    def cmd(out):
        return [sys.executable, str(REPO / "tools/train.py"), *BASE, "train.steps=3", "train.save_every=1",
                "rollout.max_staleness=1", "actor.routing_replay=r3", f"model.path={model}",
                f"data.train_files=[{tiny / 'train.jsonl'}]", f"train.output_dir={out}"]

    def metrics(out):
        return [{k: v for k, v in json.loads(x).items() if k not in VOLATILE}
                for x in (out / "metrics.jsonl").read_text().splitlines()]

    ref, run = tmp_path / "ref", tmp_path / "run"
    done = subprocess.run(cmd(ref), capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    want = metrics(ref)
    assert [m["rollout_staleness"] for m in want] == [0.0, 1.0, 1.0]
    for m in want:  # the routing reached every pass of every step, the stale ones' too
        assert m["routing_coverage"] == 1.0 and m["old_routing_coverage"] == 1.0, m
    first = want[0]  # on-policy: the actor routes as the engine did, and scores as it did
    assert first["routing_mismatch_max"] <= 1e-2 and first["old_routing_mismatch_max"] <= 1e-2, first
    assert first["drift_max"] < 1e-4, first

    kill_at_checkpoint(cmd(run), run / "checkpoints" / "step_2" / "complete", env, 600)
    saved = torch.load(run / "checkpoints" / "step_2" / "pending_rollout.pt", weights_only=True)
    assert all(s["routed_experts"] is not None for g in saved["groups"] for s in g)
    resumed = subprocess.run(cmd(run), capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout
    assert metrics(run) == want  # every metric of every step, bit for bit


THREE_TURNS = '''
from megatron_tepo.environments import Environment, Reply


class ThreeTurns(Environment):
    """Answers the first two turns (whatever they say), ends the episode at the third."""
    name = "three-turns"

    def respond(self, turn, turn_index):
        return Reply(done=True) if turn_index >= 2 else Reply(done=False, message="1665")
'''


def _tool_moe(out: Path) -> Path:
    """A random tiny Qwen3-MoE (2 layers, 8 experts, top-2) with the tiny tool task's chat tokenizer
    (examples/tiny_tir: the template the environment's answers come from)."""
    import transformers

    sys.path.insert(0, str(REPO / "examples" / "tiny_tir"))
    import tir

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=tir.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, eos_token_id=tir.EOS, pad_token_id=tir.PAD)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else None
    model.save_pretrained(out)
    tir.hf_tokenizer().save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tir.EOS, "pad_token_id": tir.PAD}))
    return out


@pytest.mark.journey
@pytest.mark.timeout(900)
def test_r3_with_three_turn_episodes_replays_the_final_turns_routing_in_every_pass(tmp_path):
    """#58 item 3: ``actor.routing_replay: r3`` with an environment (three turns, two answers in every
    episode), one step off: step 1's episodes are generated before it (as the synchronous schedule
    does), step 2's in the background while step 1 trains. Each episode's sample carries the routing
    its final turn's request returned, whose input is the whole episode: the actor replays it in the
    old-log-prob pass and every update with coverage 1.0 (a position without routing, the earlier
    turns' or the answers', would fail the replay's check), and on-policy its replayed log-probs equal
    the engine's and its unforced routing agrees with the engine's as in the single-turn run above
    (drift and mismatch bounds). Before: refused in the config."""
    model = _tool_moe(tmp_path / "moe")
    (tmp_path / "three_turns.py").write_text(THREE_TURNS)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}*45", "answer": str(a * 45)}) + "\n"
                                                  for a in range(10, 26)))
    out = tmp_path / "run"
    args = ["--config", str(REPO / "examples/tiny_tir/sizes.yaml"), f"model.path={model}",
            f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"environment.name={tmp_path / 'three_turns.py'}:ThreeTurns",
            "environment.max_turns=3", "environment.max_turn_tokens=4", "rollout.max_new_tokens=64",
            "reward.kind=exact_match", "reward.workers=1", "rollout.prompts_per_step=4", "rollout.n_samples=2",
            "rollout.dynamic_sampling=false", "train.mini_batch_prompts=4", "train.steps=2", "train.export_hf=false",
            "rollout.max_staleness=1", "actor.routing_replay=r3", f"train.output_dir={out}"]
    proc = subprocess.run([sys.executable, str(REPO / "tools/train.py"), *args], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and [m["rollout_staleness"] for m in lines] == [0.0, 1.0]
    for m in lines:  # every episode: three turns, two answers (masked), replayed whole in every pass
        assert m["episode_turns_mean"] == 3.0 and m["tokens_env"] > 0, m
        assert m["routing_coverage"] == 1.0 and m["old_routing_coverage"] == 1.0, m
    first = lines[0]  # on-policy: the actor routes as the engine did, and scores as it did
    assert first["routing_mismatch_max"] <= 1e-2 and first["old_routing_mismatch_max"] <= 1e-2, first
    assert first["drift_max"] < 1e-4, first
