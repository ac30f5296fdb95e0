"""The main job says only what its user needs (issue #45): its first steps, run as a new user runs
them -- a fresh process, empty caches (HOME, XDG, matplotlib, TorchInductor, Triton, Hugging Face all
in a new folder), no ``PYTHONWARNINGS`` -- print progress lines, the accuracy line and the plot's path,
and not one warning line, on both stacks: ``./.venv`` (the newest) and ``./.venv-oldest`` (Python
3.11, megatron-core 0.16.1). The same for ``tools/train.py`` on the tiny task's files. What other
libraries say that a user can do nothing about is silenced in one place, ``megatron_tepo/__init__.py``
(``tests/test_library_noise_filter.py``)."""
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STACKS = {"newest": REPO / ".venv/bin/python", "oldest": REPO / ".venv-oldest/bin/python"}

#: A warning line: Python's warnings (``UserWarning: ...``, ``warnings.warn(``), a library's logged
#: warning or deprecation (``... is deprecated``, ``IS DEPRECATED``, ``Warning:``), glog-style
#: warning/error lines (PyTorch's ``W1127 18:55:21.272000 ...``), and a traceback or an exception
#: ignored at exit.
WARNING_LINE = re.compile(r"warn|deprecat|^[WE]\d{4} \d\d:\d\d:\d\d|Traceback|Exception ignored", re.IGNORECASE)


def _fresh_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "MTEPO_", "PYTEST_", "TORCHINDUCTOR_", "TRITON_", "HF_", "XDG_"))}
    caches = {"HOME": home, "XDG_CACHE_HOME": home / ".cache", "XDG_CONFIG_HOME": home / ".config",
              "MPLCONFIGDIR": home / "mpl", "TORCHINDUCTOR_CACHE_DIR": home / "inductor",
              "TRITON_CACHE_DIR": home / "triton", "HF_HOME": home / "hf"}
    env.update({k: str(v) for k, v in caches.items()})
    # as examples/tiny_tepo/run.sh sets them
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(25000 + os.getpid() % 5000))
    return env


def warning_lines(text: str):
    return [line for line in text.splitlines() if WARNING_LINE.search(line)]


def test_warning_line_definition():
    said = """W1127 18:55:21.272000 31669 torch/utils/cpp_extension.py:178] No CUDA runtime is found
GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes
/x/base_configs.py:12: UserWarning: MimoModelConfig is experimental
  warnings.warn(
x.py:1: FutureWarning: `past_key_values` is deprecated and will be removed in version 5.40.0
[transformers] `past_key_values`/`cache_params` are deprecated. Use `cache` instead.
MCore's async save is deprecated and will be removed in the future releases.
Exception ignored in: <function AsyncCallsQueue.__del__ at 0x7f>
[step   1/2] reward 0.383  entropy 0.411  clip 0.203  kl_mask 0.123  grad_norm 2.82  dropped 5  0.2s
[tepo] held-out greedy accuracy: before 0.600 -> after 0.700 (improvement +0.100) in 3s; plot: /o/curves.png"""
    assert len(warning_lines(said)) == len(said.splitlines()) - 2


@pytest.mark.journey
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["main_job", "train_tool"])
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_first_steps_say_only_what_a_user_needs(stack, command, tiny, tmp_path):
    python = STACKS[stack]
    if not python.exists():
        pytest.skip(f"no {python.relative_to(REPO)}: the {stack} stack is not installed here (tools/test.sh "
                    "makes both; MTEPO_PYTHON=python3.11 bash tools/setup_env.sh makes the oldest)")
    out = tmp_path / "out"
    if command == "main_job":  # bash examples/tiny_tepo/run.sh's command, two steps
        args = ["examples/tiny_tepo/run.py", "--eval-size", "10", "train.steps=2", "train.save_every=1"]
    else:
        args = ["tools/train.py", "--config", "examples/tiny_tepo/config.yaml", "reward.kind=exact_match",
                f"model.path={tiny / 'model'}", f"data.train_files=[{tiny / 'train.jsonl'}]",
                "rollout.prompts_per_step=8", "train.mini_batch_prompts=4", "train.steps=2", "train.save_every=1"]
    proc = subprocess.run([str(python), *args, f"train.output_dir={out}"], cwd=REPO, env=_fresh_env(tmp_path / "home"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280)
    said = proc.stdout
    assert proc.returncode == 0, said[-4000:]
    assert warning_lines(said) == [], said[-4000:]
    assert (out / "checkpoints" / "step_2" / "complete").exists()  # (an asynchronous save was made and published)
    if command == "main_job":
        assert re.search(r"^\[step +2/2\] reward ", said, re.MULTILINE), said
        assert re.search(r"held-out greedy accuracy: before [0-9.]+ -> after [0-9.]+ .*plot: .*curves\.png$", said,
                         re.MULTILINE), said
