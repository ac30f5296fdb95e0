"""Evaluation: avg@k / pass@k arithmetic, and the tools/evaluate.py CLI on a tiny local model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tepo.rollout.engine import RolloutEngine, Sample
from megatron_tepo.trainer import evaluate

REPO = Path(__file__).resolve().parents[1]


class ScriptedEngine(RolloutEngine):
    """Answers prompt i with the scripted token lists (a stand-in for the model's choices)."""

    def __init__(self, script):
        self.script = script
        self.top_p = []  # per call

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=128, stop_token_ids=()):
        self.top_p.append(top_p)
        return [[Sample(list(t), [0.0] * len(t), "stop") for t in self.script[p[0]][:n]] for p in prompts]

    def update_weights(self, named_tensors):
        raise NotImplementedError


def test_avg_and_pass_at_k():
    engine = ScriptedEngine({0: [[1], [1], [0], [0]], 1: [[0], [0], [0], [0]], 2: [[1], [1], [1], [1]]})
    out = evaluate(engine, [[0], [1], [2]], ["1", "1", "1"], lambda rs, ans: [float(str(r[0]) == a) for r, a in zip(rs, ans)],
                   [], n=4)
    assert out["avg@4"] == pytest.approx((2 + 0 + 4) / 12)
    assert out["pass@4"] == pytest.approx(2 / 3)
    evaluate(engine, [[0]], ["1"], lambda rs, ans: [0.0] * len(rs), [], n=2, top_p=0.25)
    assert engine.top_p == [1.0, 0.25]  # the default samples from every token; a given top-p reaches the engine


def test_cli_top_p_reaches_the_sampling(tmp_path, monkeypatch, capsys):
    """``--top-p`` (one --file) and a benchmark's ``top_p`` are what the engine samples with, and the
    report says so."""
    from megatron_tepo.commands.evaluate import command
    from megatron_tepo.rollout.embedded import EmbeddedEngine
    from tests.checkpoint.fixtures import make_hf_dir

    model = make_hf_dir(tmp_path / "m", "qwen3", tie=False, vocab_size=320)
    (tmp_path / "b.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n')
    (tmp_path / "bench.yaml").write_text("defaults: {max_new_tokens: 2, top_p: 0.9}\nbenchmarks:\n"
                                         "  a: {file: b.jsonl, n: 2, temperature: 0.7, top_p: 0.3}\n  b: {file: b.jsonl}\n")
    seen = []
    generate = EmbeddedEngine.generate
    monkeypatch.setattr(EmbeddedEngine, "generate", lambda self, *a, **kw: seen.append(kw["top_p"]) or generate(self, *a, **kw))
    common = ["--model", str(model), "--reward", "exact_match"]
    report = command([*common, "--file", str(tmp_path / "b.jsonl"), "--top-p", "0.5", "--max-new-tokens", "2"])
    assert seen == [0.5] and report["b"]["top_p"] == 0.5
    report = command([*common, "--benchmarks", str(tmp_path / "bench.yaml")])
    assert seen[1:] == [0.3, 0.9] and (report["a"]["top_p"], report["b"]["top_p"]) == (0.3, 0.9)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # a per-benchmark flag beside a benchmark list: refused, not dropped
        command([*common, "--benchmarks", str(tmp_path / "bench.yaml"), "--top-p", "0.5"])
    assert exc.value.code == 2 and "--top-p: set per benchmark in the --benchmarks file" in capsys.readouterr().err


def test_cli_on_tiny_model(tmp_path):
    sys.path.insert(0, str(REPO))
    from tests.checkpoint.fixtures import make_hf_dir

    model = make_hf_dir(tmp_path / "m", "qwen3", tie=False, vocab_size=320)  # BPE of 300 tokens
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "1+2=", "answer": "3"},
        {"prompt": [{"role": "user", "content": "12*7="}], "reward_model": {"ground_truth": "84"}},
        {"prompt": "hello", "answer": "1"}]) + "\n")
    (tmp_path / "bench.yaml").write_text(
        "defaults: {max_new_tokens: 6}\nbenchmarks:\n  tiny_greedy: {file: b.jsonl, n: 1, temperature: 0}\n"
        "  tiny_sampled: {file: b.jsonl, n: 3, temperature: 0.6}\n")
    out = tmp_path / "not" / "yet" / "report.json"  # the folder is created
    proc = subprocess.run([sys.executable, str(REPO / "tools/evaluate.py"), "--model", str(model),
                           "--benchmarks", str(tmp_path / "bench.yaml"), "--out", str(out), "--workers", "1"],
                          capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"tiny_greedy", "tiny_sampled"}
    g, s = report["tiny_greedy"], report["tiny_sampled"]
    assert (g["num_prompts"], g["n"], s["n"]) == (3, 1, 3)
    assert 0.0 <= s["avg@3"] <= s["pass@3"] <= 1.0 and 0.0 <= g["avg@1"] <= 1.0
    # a random model writes no \boxed{} answer: every sample is counted as no_answer, none crash
    assert g["num_no_answer"] + g["num_errors"] + g["num_timeouts"] == 3
    assert "tiny_sampled" in proc.stdout and "pass@3" in proc.stdout


def _evaluate(*args):
    return subprocess.run([sys.executable, str(REPO / "tools/evaluate.py"), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("text, needle", [
    ("benchmarks:\n  x: {n: 1}\n", "benchmark 'x': missing 'file'"),
    ("benchmarks:\n  x: {file: [a\n", "bench.yaml:3:1: invalid YAML"),
    ("benchmark: {}\n", "unknown top-level keys ['benchmark']"),
    ("benchmarks:\n  x: {file: a.jsonl, top_p: 0}\n", "benchmark 'x': top_p: must be a number in (0, 1], got 0"),
])
def test_cli_bad_benchmark_file_is_one_line_and_status_2(tmp_path, text, needle):
    (tmp_path / "bench.yaml").write_text(text)
    proc = _evaluate("--model", str(tmp_path), "--benchmarks", str(tmp_path / "bench.yaml"))
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith("evaluate.py: error: ") and len(proc.stderr.strip().splitlines()) == 1
    full = _evaluate("--model", str(tmp_path), "--benchmarks", str(tmp_path / "bench.yaml"), "--traceback")
    assert full.returncode == 1 and "Traceback (most recent call last)" in full.stderr


def test_cli_out_that_cannot_be_written_fails_before_evaluating(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "file").write_text("")
    proc = _evaluate("--model", str(tmp_path / "no_model"), "--file", str(tmp_path / "b.jsonl"),
                     "--out", str(tmp_path / "file" / "report.json"))
    assert proc.returncode == 2 and "report.json: cannot write there" in proc.stderr and "Traceback" not in proc.stderr
    proc = _evaluate("--model", str(tmp_path / "no_model"), "--file", str(tmp_path / "b.jsonl"))
    assert proc.returncode == 2 and "no_model: not a Hugging Face model folder" in proc.stderr
    proc = _evaluate("--model", str(tmp_path / "no_model"), "--file", str(tmp_path / "b.jsonl"), "--top-p", "1.5")
    assert proc.returncode == 2 and "--top-p: must be a number in (0, 1], got 1.5" in proc.stderr


@pytest.mark.parametrize("content, needle", [
    (None, "nope.jsonl: no such file"),
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n', "nope.jsonl:2: missing field 'answer'"),
    ("", "no prompts in"),
])
def test_a_bad_prompt_file_fails_in_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys, content, needle):
    """Issue #35: the prompt files are read before the tokenizer and the weights load (on a 14B model
    minutes); the error is one line and exit status 2."""
    import transformers

    from megatron_tepo.commands.evaluate import command

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loaded)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    prompts = tmp_path / "nope.jsonl"
    if content is not None:
        prompts.write_text(content)
    with pytest.raises(SystemExit) as done:
        command(["--model", str(tmp_path / "model"), "--file", str(prompts)])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and needle in err and len(err.splitlines()) == 1, err


def test_evaluate_runs_with_the_tool(tmp_path, capsys):
    """``--config`` with an environment section: each response is an episode whose tool call runs in
    the sandbox, scored on its final turn; the report has the episodes' counts. A tiny model taught
    one solved trace (a tool call, then the answer) solves its problem with one call an episode."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_tepo.commands.evaluate import command
    from tests.environments.conftest import require_bwrap

    require_bwrap()
    sys.path.insert(0, str(REPO / "examples" / "tiny_tir"))
    import tir

    tok = tir.hf_tokenizer()
    cfg = tir.tiny_qwen3_config()
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 64, 128, 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids, mask = tir.tool_trace(tok, "37*45", "1665")
    x = torch.tensor([ids])
    labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):  # (memorised: the call, then the answer)
        opt.zero_grad()
        model(input_ids=x, labels=labels).loss.backward()
        opt.step()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "p.jsonl").write_text('{"prompt": "37*45", "answer": "1665"}\n')
    (tmp_path / "run.yaml").write_text("environment: {name: python, sandbox: {wall_seconds: 30}}\n")
    common = ["--model", str(tmp_path / "m"), "--reward", "exact_match", "--file", str(tmp_path / "p.jsonl"),
              "--max-new-tokens", "48"]
    report = command([*common, "--config", str(tmp_path / "run.yaml")])["p"]
    assert (report["avg@1"], report["episode_tool_calls_mean"], report["tool_errors"]) == (1.0, 1.0, 0.0)
    assert report["episode_turns_mean"] == 2.0
    alone = command(common)["p"]  # without the tool: one turn, the call itself is the answer
    assert alone["avg@1"] == 0.0 and "episode_turns_mean" not in alone
    capsys.readouterr()


def test_evaluate_with_a_run_config_scores_with_its_reward_function(tmp_path, monkeypatch, capsys):
    """``--config`` whose ``reward.function`` is a user's file: the evaluation scores with it (in the
    reward pool, seeing each row; rows need no answer), as training does; ``--reward`` beside it is
    refused. (It used to score with math_verify, and a row without an answer was refused.)"""
    from megatron_tepo.commands.evaluate import command
    from tests.checkpoint.fixtures import make_hf_dir

    model = make_hf_dir(tmp_path / "m", "qwen3", tie=False, vocab_size=320)
    (tmp_path / "b.jsonl").write_text('{"prompt": "1+2=", "weight": 0.25}\n{"prompt": "3+4=", "weight": 0.75}\n')
    (tmp_path / "my_reward.py").write_text("def score(text, ids, row, episode):\n"
                                           "    return row['weight'] if isinstance(ids, list) else -1.0\n")
    (tmp_path / "run.yaml").write_text(f"reward: {{function: {tmp_path / 'my_reward.py'}:score}}\n")
    common = ["--model", str(model), "--file", str(tmp_path / "b.jsonl"), "--max-new-tokens", "2", "--workers", "1"]
    report = command([*common, "--config", str(tmp_path / "run.yaml")])["b"]
    assert (report["avg@1"], report["pass@1"], report["num_errors"]) == (0.5, 1.0, 0)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        command([*common, "--config", str(tmp_path / "run.yaml"), "--reward", "exact_match"])
    assert exc.value.code == 2 and "the run config scores with reward.function" in capsys.readouterr().err


def test_evaluate_with_a_run_config_renders_the_prompts_and_turns_with_its_tools_and_template_arguments(
        tmp_path, monkeypatch, capsys):
    """``--config`` with ``data.tools`` and ``data.chat_template_kwargs``: the prompts evaluated are the
    chat template's rendering with ``tools=`` and those arguments (as the training prompts are), and
    the episodes' turn boundaries use them too. (They used to be rendered without.)"""
    import megatron_tepo.trainer
    from megatron_tepo.commands.evaluate import command
    from tests.checkpoint.fixtures import make_hf_dir
    from tests.rollout.qwen3_template import tokenizer

    model = make_hf_dir(tmp_path / "m", "qwen3", tie=False, vocab_size=320)
    tok = tokenizer()
    tok.save_pretrained(model)
    (tmp_path / "b.jsonl").write_text('{"prompt": "What is 1+2?", "secret": 3, "answer": "3"}\n')
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    (tmp_path / "run.yaml").write_text(json.dumps({"data": {"tools": tools, "chat_template_kwargs": {
        "enable_thinking": False}}, "environment": {"name": "guess_number"}, "reward": {"kind": "exact_match"}}))
    seen = {}

    def evaluate(engine, prompts, answers, reward_fn, stop, **kw):
        seen.update(engine=engine, prompts=prompts, rows=kw["rows"])
        return {"avg@1": 0.0, "pass@1": 0.0, "reward_timeouts": 0, "reward_errors": 0, "reward_no_answer": 0}

    monkeypatch.setattr(megatron_tepo.trainer, "evaluate", evaluate)
    command(["--model", str(model), "--file", str(tmp_path / "b.jsonl"), "--config", str(tmp_path / "run.yaml"),
             "--workers", "1"])
    want = tok.apply_chat_template([{"role": "user", "content": "What is 1+2?"}], tools=tools, enable_thinking=False,
                                   add_generation_prompt=True, tokenize=False)
    assert seen["prompts"] == [tok(want, add_special_tokens=False)["input_ids"]]
    assert '"name": "calc"' in want and want.endswith("<think>\n\n</think>\n\n")
    assert seen["engine"].fmt.template_kwargs == {"tools": tools, "enable_thinking": False}
    assert seen["rows"][0]["secret"] == 3
    capsys.readouterr()
