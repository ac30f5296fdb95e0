"""Resume: a run killed with SIGKILL after a checkpoint and started again produces the same
metrics as an uninterrupted run, with generation and training alternating and one step off (the
checkpoint then holds the next step's rollout); partial checkpoint directories are ignored."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import kill_at_checkpoint

REPO = Path(__file__).resolve().parents[2]
VOLATILE = {"time", "step_s", "sync_s", "rollout_s", "train_s", "tokens_per_s"}


def _cmd(out, *extra):
    return [sys.executable, str(REPO / "examples/tiny_tepo/run.py"), "train.save_every=2", "train.eval_every=3",
            f"train.output_dir={out}", *extra, "--eval-size", "20"]


def _env(port):
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(port)}


def _metrics(out):
    return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.journey  # (whole runs.py runs, killed and resumed: the second lane, tools/test.sh)
@pytest.mark.parametrize("staleness,steps,lora", [(0, 6, False), (1, 6, False), (0, 6, True)],
                         ids=["staleness0", "staleness1", "lora"])  # (killed after step 4's checkpoint)
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, staleness, steps, lora):
    """``lora``: the same with LoRA adapters (actor.lora.rank=8): the checkpoint holds the adapters
    and references the base folder (model.path), which the resumed run checks and keeps."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    port = 23000 + os.getpid() % 5000 + 10 * staleness + 5 * lora
    extra = [f"train.steps={steps}", f"rollout.max_staleness={staleness}"] + (["actor.lora.rank=8"] if lora else [])
    done = subprocess.run(_cmd(ref, *extra), env=_env(port), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]

    kill_at_checkpoint(_cmd(run, *extra), run / "checkpoints" / "step_4" / "complete", _env(port + 1), 300)
    # A crash during a later write: a checkpoint directory without its marker, and a tmp dir.
    (run / "checkpoints" / "step_99").mkdir(parents=True)
    (run / "checkpoints" / "step_98.tmp-1234").mkdir()
    resumed = subprocess.run(_cmd(run, *extra), env=_env(port + 2), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "step_99" not in resumed.stdout

    got, want = _metrics(run), _metrics(ref)
    assert [m["step"] for m in got] == list(range(1, steps + 1))
    assert got == want  # every metric of every step, bit for bit
    assert [m["rollout_staleness"] for m in got] == [0.0] + [float(staleness)] * (steps - 1)
    if staleness:  # the killed run's checkpoint held the next step's rollout, which the resumed one trained
        assert (run / "checkpoints" / "step_4" / "pending_rollout.pt").exists()
    if lora:  # the base referenced, not copied
        base = json.loads((run / "checkpoints" / "step_4" / "lora_base.json").read_text())
        assert base["saved_in_full"] is False and base["base"]["fingerprint"], base
    assert json.loads((run / "summary.json").read_text())["accuracy_after"] == \
        json.loads((ref / "summary.json").read_text())["accuracy_after"]


def _tir_partial_run(model: Path, train_file: Path, run: Path, *extra: str) -> list:
    """``tools/train.py`` on examples/tiny_tir's sizes: ``model`` on ``train_file`` (exact match), 4 steps
    of 4 prompts x 2 with partial rollout (staleness 4: the run's length) and a checkpoint every 2,
    into ``run``; ``extra`` overrides."""
    return [sys.executable, str(REPO / "tools/train.py"), "--config", str(REPO / "examples/tiny_tir/sizes.yaml"),
            f"model.path={model}", f"data.train_files=[{train_file}]", "reward.kind=exact_match",
            f"train.output_dir={run}", "train.steps=4", "train.save_every=2", "train.export_hf=false",
            "rollout.prompts_per_step=4", "rollout.n_samples=2", "train.mini_batch_prompts=4",
            "rollout.dynamic_sampling=false", "rollout.partial_rollout=true", "rollout.max_staleness=4", *extra]


def _every_prompt_once(run: Path, steps: int, per_step: int) -> None:
    """By the ledger (the last attempt of each step says what it trained and dropped) every drawn
    prompt's group was trained once, dropped, or is held by the last checkpoint's buffer (dropped
    there after its step's take included)."""
    import torch

    last = {}
    for line in (run / "checkpoints" / "rollout_ledger.jsonl").read_text().splitlines():
        entry = json.loads(line)
        last[entry["step"]] = entry
    assert sorted(last) == list(range(1, steps + 1))
    trained = [g for s in last for g, _ in last[s]["trained"]]
    dropped = [g for s in last for g, _ in last[s]["dropped"]]
    final = torch.load(run / "checkpoints" / f"step_{steps}" / "rollout_buffer.pt", weights_only=True)
    held = [g["gid"] for g in final["groups"]] + [g for g, _ in final["dropped"]]
    assert len(trained) == len(set(trained)) == steps * per_step  # no group trained twice
    assert sorted(trained + dropped + held) == list(range(final["next_gid"]))  # none lost, none counted twice


@pytest.mark.slow
@pytest.mark.journey
def test_sigkill_with_partial_responses_in_flight_resumes_every_prompt_once(tmp_path):
    """Partial rollout: killed after step 2's checkpoint, whose rollout buffer holds responses cut
    by the update, and resumed. The resumed run continues those responses (its first step says how
    many), and by the ledger every drawn prompt's group was trained once, dropped by dynamic
    sampling, or is still in the last checkpoint's buffer."""
    run, port = tmp_path / "run", 24000 + os.getpid() % 5000
    # 1000 groups in flight (8000 requests): more than the engine finishes before step 2's update, so
    # that update cuts a batch after at least one token (the embedded engine takes the next batch
    # without a gap, and every row gets its first token: CI once saw an update land between two
    # batches, with nothing cut). Killed after step 2, not 4: here the engine had finished 1040 of the
    # 8000 requests at step 2's update but 7752 at step 4's, and CI once saw all of them finished by
    # step 4 (nothing left to cut: a race with the trainer's speed, which step 2 wins by far).
    # Staleness 6 (the run's length): no response is regenerated, so the cut ones are in the
    # checkpoint whatever the machine's speed. (At staleness 1 the response cut at step 4's update
    # may hold step 3's tokens and start again from its prompt: CI saw none left.)
    bound = 6
    extra = ["train.steps=6", "rollout.partial_rollout=true", f"rollout.max_staleness={bound}",
             "rollout.max_inflight_groups=1000"]
    kill_at_checkpoint(_cmd(run, *extra), run / "checkpoints" / "step_2" / "complete", _env(port), 400)
    import torch

    saved = torch.load(run / "checkpoints" / "step_2" / "rollout_buffer.pt", weights_only=True)
    partial = sum(1 for g in saved["groups"] for k, r in enumerate(g["requests"])
                  if g["finish"][k] is None and r["token_ids"])
    resumed = subprocess.run(_cmd(run, *extra), env=_env(port + 1), capture_output=True, text=True, timeout=600,
                             cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    got = _metrics(run)
    assert [m["step"] for m in got] == list(range(1, 7))
    assert got[2]["resumed_from_checkpoint"] == partial > 0  # step 3, the resumed run's first
    assert all(m["updates"] > 0 for m in got)  # (no step skipped: each took its 16 groups)
    assert sum(m["partial_resumed"] for m in got) > 0
    assert all(m["staleness_max"] <= bound for m in got)  # the bound holds for every token trained
    assert sum(m["stale_regenerated"] for m in got) == 0
    _every_prompt_once(run, steps=6, per_step=16)


def _tool_model(out: Path) -> Path:
    """A tiny chat model (examples/tiny_tir) taught one solved episode: it calls the Python tool, then
    answers; with its tokenizer (the chat template the episodes' tool turns come from)."""
    sys.path.insert(0, str(REPO / "examples" / "tiny_tir"))
    import tir

    tok = tir.hf_tokenizer()
    ids, mask = tir.tool_trace(tok, "37*45", "1665")
    return _taught(tir, tok, ids, [t if m else -100 for t, m in zip(ids, mask)], out)


def _taught(tir, tok, ids, labels, out: Path) -> Path:
    """examples/tiny_tir's tiny Qwen3 (hidden 64, seed 0) taught ``ids`` (the loss on ``labels``, -100
    left out) for 60 AdamW steps, saved to ``out`` with ``tok`` and tiny_tir's EOS / PAD."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tir.tiny_qwen3_config()
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 64, 128, 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    x, y = torch.tensor([ids]), torch.tensor([labels])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        model(input_ids=x, labels=y).loss.backward()
        opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tir.EOS, "pad_token_id": tir.PAD}))
    return out


@pytest.mark.slow
@pytest.mark.journey
def test_sigkill_with_episodes_in_flight_resumes_every_prompt_once(tmp_path):
    """#52: multi-turn episodes with partial rollout (each calls the Python tool in the sandbox, then
    answers), killed with SIGKILL after step 2's checkpoint and resumed: the resumed run goes on
    from the buffer's episodes (their turns, the tool's answers and their loss masks in the
    checkpoint), and by the ledger every drawn prompt was trained once, dropped, or is still held."""
    from tests.environments.conftest import require_bwrap

    require_bwrap()
    model = _tool_model(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": "37*45", "answer": "1665"}) + "\n"
                                                  for _ in range(64)))
    run, port = tmp_path / "run", 25000 + os.getpid() % 5000
    cmd = _tir_partial_run(model, tmp_path / "train.jsonl", run, "rollout.max_inflight_groups=40",
                           "environment.sandbox.wall_seconds=30")
    kill_at_checkpoint(cmd, run / "checkpoints" / "step_2" / "complete", _env(port), 400)
    import torch

    saved = torch.load(run / "checkpoints" / "step_2" / "rollout_buffer.pt", weights_only=True)
    reqs = [r for g in saved["groups"] for r in g["requests"]]
    assert all(r["loss_mask"] is None or len(r["loss_mask"]) == len(r["token_ids"]) for r in reqs)  # episodes whole
    resumed = subprocess.run(cmd, env=_env(port + 1), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    got = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert all(m["tool_calls"] > 0 and m["tokens_env"] > 0 for m in got)  # episodes with the tool, every step
    assert sum(m["reward_mean"] for m in got) > 0  # (the taught answer)
    _every_prompt_once(run, steps=4, per_step=4)


#: the guessing game's environment, logged (a user's file, by import path): GuessNumber itself, which
#: also writes one line per turn it answers (the process, the episode, the state it was handed), so
#: that the test sees a resumed run's episodes go on from the state in the checkpoint
LOGGED_GUESS = '''
import json, os, uuid
from megatron_tepo.environments.guess_number import GuessNumber

class Logged(GuessNumber):
    def __init__(self, log, **kw):
        super().__init__(**kw)
        self.log = log

    def start(self, row, messages):
        state = super().start(row, messages)
        state.update(uid=uuid.uuid4().hex, row=row["id"], pid=os.getpid())
        return state

    def step(self, state, turn, turn_index):
        line = {"pid": os.getpid(), "uid": state["uid"], "row": state["row"], "secret": state["secret"],
                "before": list(state["guesses"]), "turn_index": turn_index}
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\\n")
        return super().step(state, turn, turn_index)
'''


def _guess_model(out: Path) -> Path:
    """A tiny chat model (examples/tiny_tir's tokenizer) taught to guess 1, 2, 3, 4 on "((" (higher)."""
    sys.path.insert(0, str(REPO / "examples" / "tiny_tir"))
    import tir

    tok = tir.hf_tokenizer()
    conv = [{"role": "user", "content": "0"}]
    for guess in "1234":
        conv += [{"role": "assistant", "content": guess}, {"role": "tool", "content": "(("}]
    ids = tir.render_ids(tok, conv[:-1])[:-1]
    prompt = len(tir.prompt_ids(tok, "0"))
    return _taught(tir, tok, ids, [-100] * prompt + ids[prompt:], out)


@pytest.mark.slow
@pytest.mark.journey
def test_sigkill_with_stateful_episodes_in_flight_resumes_each_from_its_state(tmp_path):
    """#58 acceptance, a stateful environment under ``kill -9`` and resume: the guessing game (each
    row its own secret) with partial rollout, killed after step 2's checkpoint and resumed. Each
    episode the checkpoint's buffer held mid-way goes on in the resumed run from its state there
    (``Request.episode["env"]``): its row's secret and the guesses made before the kill, at the next
    turn; and by the ledger every drawn prompt was trained once, dropped, or is still held."""
    model = _guess_model(tmp_path / "model")
    secrets = [1 + i % 5 for i in range(64)]  # (5: never found in 4 turns, the episode ends at max_turns)
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"prompt": "0", "answer": str(s), "secret": s, "id": i}) + "\n" for i, s in enumerate(secrets)))
    (tmp_path / "logged_guess.py").write_text(LOGGED_GUESS)
    log = tmp_path / "turns.jsonl"
    run, port = tmp_path / "run", 26000 + os.getpid() % 5000
    # 2000 groups in flight (4000 episodes): far more than the engine ends before step 2's update, so the
    # checkpoint holds episodes mid-way whatever the machine's speed (here, on a busy machine, 118 and
    # 1908 of 4000 had ended in two runs, about 2000 of those left mid-way had guessed; with 256 groups,
    # 511 of 512 had ended). Staleness 4 (the run's length): none is regenerated from its prompt.
    cmd = _tir_partial_run(model, tmp_path / "train.jsonl", run,
                           f"environment.name={tmp_path / 'logged_guess.py'}:Logged", f"environment.args.log={log}",
                           "environment.args.higher=((", "environment.args.lower=))", "environment.max_turns=4",
                           "rollout.max_new_tokens=64", "rollout.max_inflight_groups=2000")
    kill_at_checkpoint(cmd, run / "checkpoints" / "step_2" / "complete", _env(port), 400)
    import torch

    saved = torch.load(run / "checkpoints" / "step_2" / "rollout_buffer.pt", weights_only=True)
    mid = {r["episode"]["env"]["state"]["uid"]: r["episode"]["env"]["state"] for g in saved["groups"]
           for k, r in enumerate(g["requests"]) if g["finish"][k] is None and "env" in r["episode"]}
    assert mid, "no episode was mid-way in step 2's checkpoint"
    assert all(s["secret"] == secrets[s["row"]] for s in mid.values())
    resumed = subprocess.run(cmd, env=_env(port + 1), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    turns = [json.loads(x) for x in log.read_text().splitlines()]
    went_on = {}  # each held episode's first turn in the resumed run (another process than the one that opened it)
    for t in turns:
        if t["uid"] in mid and t["pid"] != mid[t["uid"]]["pid"]:
            went_on.setdefault(t["uid"], t)
    assert went_on, "no episode of the checkpoint went on in the resumed run"
    for uid, t in went_on.items():
        state = mid[uid]
        assert (t["row"], t["secret"], t["before"], t["turn_index"]) == \
            (state["row"], secrets[state["row"]], state["guesses"], len(state["guesses"])), (state, t)
    assert any(mid[uid]["guesses"] for uid in went_on)  # (some had guessed before the kill)
    got = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    _every_prompt_once(run, steps=4, per_step=4)
