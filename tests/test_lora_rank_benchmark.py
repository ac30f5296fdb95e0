"""benchmarks/lora_rank.py's table (``--collect``, no run started, no memory count): steps to the
threshold are the first evaluated step reaching it, censored at the run's steps; a seed without a
finished run is named, not fatal."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("lora_rank", ROOT / "benchmarks" / "lora_rank.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(folder: Path, evals, after):
    folder.mkdir(parents=True)
    folder.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward_mean": 0.5, **({"eval_acc": a} if a is not None else {})}) + "\n"
        for s, a in evals))
    folder.joinpath("summary.json").write_text(json.dumps({"accuracy_before": 0.5, "accuracy_after": after,
                                                           "seconds": 1.0}))


def test_collect_makes_the_table_and_names_missing_seeds(tmp_path, capsys):
    runs = tmp_path / "runs"
    _run(runs / "full-s1", [(5, None), (10, 0.7), (20, 0.8)], 0.9)
    _run(runs / "full-s2", [(10, 0.6), (20, 0.7)], 0.7)  # never reaches 0.75: censored at 20
    _run(runs / "lora_r8-s1", [(10, 0.76), (20, 0.8)], 0.8)
    json_out = tmp_path / "out.json"
    _module().main(["--seeds", "2", "--steps", "20", "--variants", "full", "lora r8", "--out", str(tmp_path),
                    "--collect", "--no-memory", "--json", str(json_out)])
    out = capsys.readouterr().out
    assert "| full | - | - | 20.0 | 1/2 | 0.800 [0.700, 0.900] | 2/2 |" in out
    assert "| lora r8 | - | - | 10.0 | 1/1 | 0.800 [0.800, 0.800] | 1/2 (missing seeds 2) |" in out
    saved = json.loads(json_out.read_text())
    assert saved["results"]["lora r8"]["2"] is None and saved["results"]["full"]["2"]["reached"] is False
