"""What every sandbox shares: the output cap (head and tail kept, the marker between, never more held
than the budget and one chunk), which limit an exit hit, and the line the model reads."""
import signal

import pytest

from megatron_tepo.environments.sandbox import OutputCap, classify_exit, limit_message


def test_the_output_cap_keeps_head_and_tail():
    cap = OutputCap(8)
    cap.add(b"abc")
    assert (cap.text(), cap.cut) == ("abc", 0)
    cap.add(b"defgh")
    assert (cap.text(), cap.cut) == ("abcdefgh", 0)
    for _ in range(1000):
        cap.add(b"0123456789")
        assert len(cap.head) + len(cap.tail) <= 8
    assert cap.total == 10008 and cap.cut == 10000
    assert cap.text() == "abcd\n[... 10000 bytes cut ...]\n6789"
    assert cap.text(stopped=True) == "abcd\n[... at least 10000 bytes cut ...]\n6789"
    lines = OutputCap(8)
    lines.add(b"ab\n" + b"x" * 20)
    assert lines.text() == "ab\nx\n[... 15 bytes cut ...]\nxxxx"
    odd = OutputCap(4)
    odd.add("é".encode() * 4)  # cut inside a character: replaced, never an error
    assert odd.text() == "é\n[... 4 bytes cut ...]\né"


@pytest.mark.parametrize("exit_code, stderr, limit", [
    (0, "", None),
    (None, "", None),
    (1, "Traceback ...\nZeroDivisionError: division by zero\n", None),
    (128 + signal.SIGXCPU, "", "cpu"),
    (1, "Traceback ...\n    x.append(bytearray(1 << 30))\nMemoryError\n", "memory"),
    (1, "  File \"/tmp/main.py\", line 2, in <module>\n    os.fork()\nBlockingIOError: [Errno 11] Resource "
        "temporarily unavailable\n", "processes"),
    (1, "RuntimeError: can't start new thread\n", "processes"),
    (1, "BlockingIOError: [Errno 11] Resource temporarily unavailable\n", None),  # not from a fork
    (1, "OSError: [Errno 28] No space left on device\n", "disk"),
    (1, "OSError: [Errno 27] File too large\n", "disk"),
    (137, "", None),
])
def test_which_limit_an_exit_hit(exit_code, stderr, limit):
    assert classify_exit(exit_code, stderr) == limit


def test_the_line_the_model_reads():
    limits = dict(wall_seconds=2.5, cpu_seconds=1, memory_mb=256, processes=16, output_bytes=1000, tmp_mb=16)
    assert limit_message(None, 0, limits) is None
    assert limit_message(None, 3, limits) == "Error: the code exited with status 3."
    assert limit_message(None, 137, limits) == "Error: the code was killed by SIGKILL."
    assert limit_message("wall", None, limits) == ("Error: the code ran longer than its time limit (2.5 s) and "
                                                   "was stopped.")
    assert limit_message("processes", 1, limits) == "Error: the code tried to run more than 16 processes or threads."
