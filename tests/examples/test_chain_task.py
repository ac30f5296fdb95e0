"""The chain task's generator and reward (examples/chain_task/chain.py): the chains are correct
arithmetic, the answers are the sums, and the lengths follow the distribution the docstring states."""
import importlib.util
import random
import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("chain", REPO / "examples/chain_task/chain.py")
chain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chain)

FULL = re.compile(r"(\d)\+(\d)\+(\d)=(\d+);")
TERSE = re.compile(r"=(\d+);")


def columns(text):
    """Parse a response into [(form, x, y, carry, sum)] and the final answer."""
    body, answer = text.split(">")
    cols, i = [], 0
    while i < len(body):
        m = FULL.match(body, i) or TERSE.match(body, i)
        assert m, f"unparseable at {i}: {body!r}"
        cols.append(("full", *map(int, m.groups())) if m.re is FULL else ("terse", None, None, None, int(m.group(1))))
        i = m.end()
    return cols, answer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_chain_is_correct_arithmetic_and_ends_with_the_sum(seed):
    rng = random.Random(seed)
    for _ in range(300):
        a, b = chain.operands(rng)
        text = chain.sample_response(a, b, rng)
        cols, answer = columns(text)
        assert answer == str(a + b)
        assert len(cols) == len(str(a)) == len(str(b))
        carry = 0
        for i, (form, x, y, c, s) in enumerate(cols):
            dx, dy = int(str(a)[::-1][i]), int(str(b)[::-1][i])
            assert s == dx + dy + carry, (a, b, text)
            if form == "full":
                assert (x, y, c) == (dx, dy, carry), (a, b, text)
            carry = s // 10
        digits = "".join(str(s % 10) for *_, s in cols)[::-1]
        assert int(str(carry) + digits) == a + b


def test_problems_answers_are_the_sums_and_digits_are_uniform():
    items = chain.problems(5000, seed=3)
    counts = Counter()
    for ids, answer in items:
        text = chain.decode(ids)
        a, b = map(int, text.rstrip("=").split("+"))
        assert answer == str(a + b)
        assert len(str(a)) == len(str(b))
        assert len(ids) <= chain.MAX_PROMPT
        counts[len(str(a))] += 1
    assert set(counts) == set(chain.DIGITS)
    for d in chain.DIGITS:  # uniform: 1000 each, binomial sd ~28
        assert abs(counts[d] - 1000) < 150, counts
    assert chain.problems(50, seed=3) == items[:50]  # deterministic


def test_lengths_follow_the_stated_distribution():
    rng = random.Random(7)
    by_digits = {d: [] for d in chain.DIGITS}
    for _ in range(4000):
        a, b = chain.operands(rng)
        n = len(chain.encode(chain.sample_response(a, b, rng))) + 1  # + EOS
        d = len(str(a))
        lo, hi = chain.length_range(d)
        assert lo <= n <= hi, (a, b, n, lo, hi)
        by_digits[d].append(n)
    # a column is 3 + 5 [full] + [its sum >= 10] tokens, full with probability P_FULL, a two-digit
    # sum about half the time; the answer is '>' + d digits (+ a final carry, half the time) + EOS:
    # mean d (4.5 + 5 P_FULL) + 2.5
    for d, ns in by_digits.items():
        mean = sum(ns) / len(ns)
        assert abs(mean - (d * (4.5 + 5 * chain.P_FULL) + 2.5)) < 1.0, (d, mean)
    everything = [n for ns in by_digits.values() for n in ns]
    assert min(everything) >= chain.length_range(min(chain.DIGITS))[0] and max(everything) <= chain.MAX_RESPONSE
    assert 20 <= sorted(everything)[len(everything) // 10]  # 90% of responses are 20 tokens or more
    assert sorted(everything)[-len(everything) // 10] >= 45  # and a tenth 45 or more


def test_length_varies_within_a_group():
    rng = random.Random(11)
    spreads = []
    for _ in range(50):
        a, b = chain.operands(rng)
        lengths = {len(chain.sample_response(a, b, rng)) for _ in range(8)}
        spreads.append(max(lengths) - min(lengths))
    assert sum(s > 0 for s in spreads) >= 48  # a group of 8 almost never has one length
    assert sum(spreads) / len(spreads) >= 8


def test_reward_is_exact_match_after_the_last_marker_whatever_the_form():
    a, b = 4785, 3917
    full = chain.encode(chain.chain(a, b, [True] * 4)) + [chain.EOS]
    terse = chain.encode(chain.chain(a, b, [False] * 4)) + [chain.EOS]
    assert chain.chain(a, b, [True, False, True, False]) == "5+7+0=12;=10;7+9+1=17;=8;>8702"
    wrong = chain.encode("5+7+0=12;>8703") + [chain.EOS]
    no_answer = chain.encode("5+7+0=12;=9;") + [chain.EOS]
    two_markers = chain.encode(">1>8702") + [chain.EOS, 5, 6]  # text after EOS is ignored
    truncated = chain.encode("5+7+0=12;>870")  # cut by max_new_tokens
    assert chain.reward_fn([full, terse, wrong, no_answer, two_markers, truncated], ["8702"] * 6) == \
        [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
