"""benchmarks/episodes.py (#58 item 7): its smallest configuration runs and prints its table (a
benchmark, not a test of speed: nothing here is timed)."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "episodes.py"


def _bisect_turns(secret, lo=0, hi=63):
    turns = 1
    while (lo + hi) // 2 != secret:
        g = (lo + hi) // 2
        lo, hi = (g + 1, hi) if g < secret else (lo, g - 1)
        turns += 1
    return turns


def test_the_overhead_benchmark_runs_its_smallest_configuration_and_prints_its_table(capsys):
    spec = importlib.util.spec_from_file_location("episodes_benchmark", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["overhead", "--episodes", "8", "--workers", "2", "--repeats", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| tool_workers | episodes | model turns |") and len(out) == 3
    cells = [c.strip() for c in out[2].strip("|").split("|")]
    # every scripted episode bisected to its own secret: the turns are the bisection's, episode by episode
    assert cells[:3] == ["2", "8", str(sum(_bisect_turns((37 * i + 11) % 64) for i in range(8)))]
