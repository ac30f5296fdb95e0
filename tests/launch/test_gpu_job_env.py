"""What a GPU job runs its steps with (issue #32 rows 5, 7 and 9), tested on CPU.

Row 5: a ``launch.device: cuda`` job took the checkout's test environments by default (``.venv``: a
PyPI torch without Transformer Engine; ``.venv-sglang``: SGLang's CPU build), started CPU servers
with ``--device cuda`` and refused the layout only once they were up. Now its fit check refuses
those pythons first, in one line naming the variable to set (megatron_tepo/launch/pythons.py).
Stand-in pythons (tests/launch/gpu_pythons.py) answer the check's probe as each kind would.

Rows 7 and 9: the trainer's settings (``CUDA_DEVICE_MAX_CONNECTIONS=1``, ``OMP_NUM_THREADS=8``,
NCCL error handling, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set it)
were exported before the servers started, so every SGLang server inherited them. Here the whole of
slurm/lib.sh's ``tepo_main`` runs with stand-in ``srun`` (runs its command here, in the caller's
environment, as srun's default ``--export=ALL``), ``curl`` (every server healthy) and pythons that
record the environment each step's process sees (the serve command's is what SGLang gets)."""
import os
import re
import subprocess
from pathlib import Path

import pytest

from megatron_tepo.launch import FitError, load_launch
from megatron_tepo.launch.pythons import check_pythons
from megatron_tepo.rollout.sglang.options import CPU_BUILD_MARKERS, ServerConfig, cpu_build_marker, server_command
from tests.launch.gpu_pythons import gpu_pythons, standin_python

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"
TRAINER_VARS = ("CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF",
                "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TEPO_", "NCCL_", "TORCH_NCCL_")) and k not in TRAINER_VARS
           and k not in ("MTEPO_SGLANG_PYTHON", "MODEL_PATH", "TRAIN_FILES", "OUTPUT_DIR", "ACTOR_NODES",
                         "ROLLOUT_NODES")}
    env.update(extra)
    return env


# ---- row 5: the pythons of a GPU job -------------------------------------------------------------
def _checkout_with_test_venv(tmp_path, cuda):
    """A checkout whose ``.venv`` is what the README's test command makes: a PyPI torch (a CUDA build
    on Python 3.12, the CPU wheel on 3.11) without Transformer Engine."""
    ck = tmp_path / "checkout"
    ck.mkdir()
    for name in ("slurm", "tools", "megatron_tepo", "examples"):
        (ck / name).symlink_to(ROOT / name)
    standin_python(ck / ".venv", cuda=cuda, te=False)
    return ck


def _dry_run_14b(tmp_path, root=ROOT, **env):
    """``TEPO_DRY_RUN=1 bash <root>/slurm/qwen3_14b_tepo.sh`` in a clean environment plus ``env``."""
    env = _clean_env(TEPO_ROOT=str(root), TEPO_DRY_RUN="1", TEPO_NODELIST="n1 n2 n3 n4",
                     TEPO_RUN_DIR=str(tmp_path / "run"), OUTPUT_DIR=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", str(root / "slurm" / "qwen3_14b_tepo.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("cuda", ["13.0", None], ids=["pypi-cuda-torch", "cpu-torch"])
def test_a_cuda_job_with_the_default_pythons_is_refused_and_a_dry_run_says_so_and_goes_on(tmp_path, cuda, capsys):
    """TEPO_PYTHON and MTEPO_SGLANG_PYTHON unset: the checkout's .venv and the SGLang default
    (.venv-sglang, SGLang's CPU build, or failing that the trainer's python, which has no sglang) are
    refused by the fit check, one line naming both variables. A real run stops there (no srun, no
    log folder: the fit check's own refusal, below); a dry run -- a preview, from a login node whose
    python may well be a CPU one -- says in one line what a real run would refuse and goes on to
    print every step (issue #40)."""
    ck = _checkout_with_test_venv(tmp_path, cuda)
    res = _dry_run_14b(tmp_path, root=ck)
    assert res.returncode == 0, res.stderr
    refused = [line for line in res.stderr.splitlines() if "a real run would stop here" in line]
    assert len(refused) == 1, res.stderr
    line = refused[0]
    assert line.startswith("DRY RUN: a real run would stop here: ")
    assert f"the trainer's python {ck}/.venv/bin/python" in line and "set TEPO_PYTHON to" in line
    want = "needs Transformer Engine" if cuda else "has torch 2.6.0+cpu (CPU build)"
    assert want in line and "set MTEPO_SGLANG_PYTHON to" in line
    logs = next((tmp_path / "out" / "logs").iterdir())
    assert "DRY-RUN: srun" in (logs / "trainer.log").read_text()
    assert (logs / "sglang.n3.srun.log").read_text().count("DRY-RUN: srun") == 1
    # the real run's fit check (the same command without --dry-run): refused, one line, exit 2
    from tools.fit_check import cli

    with pytest.raises(SystemExit) as exit_:
        cli(["--config", str(ROOT / "examples/models/qwen3_14b.yaml"), "--trainer-python", f"{ck}/.venv/bin/python"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "fit check FAILED" in err and "set TEPO_PYTHON to" in err and "DRY RUN" not in err


def test_a_cuda_job_with_gpu_pythons_runs_and_says_which(tmp_path):
    env = gpu_pythons(tmp_path)
    res = _dry_run_14b(tmp_path, **env)
    assert res.returncode == 0, res.stderr
    fit = next((tmp_path / "out" / "logs").iterdir()) / "fit.log"
    text = fit.read_text()
    assert (f"trainer python: {env['TEPO_PYTHON']}: torch 2.6.0+cu126 (CUDA 12.6), Transformer Engine installed"
            in text)
    assert f"SGLang python: {env['MTEPO_SGLANG_PYTHON']} (MTEPO_SGLANG_PYTHON): torch 2.6.0+cu126" in text


def _spec(name="qwen3_14b", *overrides):
    return load_launch(MODELS / f"{name}.yaml", ["model.path=/models/m", *overrides])


def _sglang(tmp_path, monkeypatch, **kw):
    py = standin_python(tmp_path / "sglang-venv", **{"te": False, "sglang": True, **kw})
    monkeypatch.setenv("MTEPO_SGLANG_PYTHON", str(py))
    return py


@pytest.mark.parametrize("spec_args,trainer,needle", [
    (("qwen3_14b",), dict(cuda=None), "launch.device: cuda, but the trainer's python {py} has torch 2.6.0+cpu "
                                      "(CPU build): set TEPO_PYTHON to a python with a CUDA build of torch"),
    (("qwen3_14b",), dict(te=False), "actor.sequence_parallel: true needs Transformer Engine, which the trainer's "
                                     "python {py} does not have: set TEPO_PYTHON to"),
    (("qwen3_14b", "actor.sequence_parallel=false", "actor.attention=te"), dict(te=False),
     "actor.attention: te needs Transformer Engine"),
])
def test_the_trainers_python_is_refused_naming_the_variable(tmp_path, monkeypatch, spec_args, trainer, needle):
    _sglang(tmp_path, monkeypatch)
    py = standin_python(tmp_path / "trainer-venv", **trainer)
    with pytest.raises(FitError) as err:
        check_pythons(_spec(*spec_args), str(py))
    msg = str(err.value)
    assert needle.format(py=py) in msg and "\n" not in msg and "MTEPO_SGLANG_PYTHON" not in msg


def test_sequence_parallelism_without_te_offers_the_way_out_only_where_there_is_one(tmp_path, monkeypatch):
    _sglang(tmp_path, monkeypatch)
    py = str(standin_python(tmp_path / "trainer-venv", te=False))
    with pytest.raises(FitError, match="or set actor.sequence_parallel: false"):
        check_pythons(_spec("qwen3_14b"), py)
    with pytest.raises(FitError) as err:  # MoE at TP > 1 needs sequence parallelism: no way out
        check_pythons(_spec("qwen3_30b_a3b"), py)
    assert "needs Transformer Engine" in str(err.value) and "sequence_parallel: false" not in str(err.value)
    # no sequence parallelism, attention auto (SDPA without TE): a PyPI CUDA torch is enough
    found = check_pythons(_spec("qwen3_14b", "actor.sequence_parallel=false"), py)
    assert found[0] == f"trainer python: {py}: torch 2.6.0+cu126 (CUDA 12.6), Transformer Engine not installed"


@pytest.mark.parametrize("marker", CPU_BUILD_MARKERS)
def test_the_cpu_build_of_sglang_is_refused(tmp_path, monkeypatch, marker):
    """The venv tools/install_sglang_cpu.sh made (its mark, or the stamp of a venv made before the
    mark), whatever its torch says."""
    py = _sglang(tmp_path, monkeypatch)
    (tmp_path / "sglang-venv" / marker).write_text("x\n")
    with pytest.raises(FitError) as err:
        check_pythons(_spec(), str(standin_python(tmp_path / "trainer-venv")))
    msg = str(err.value)
    assert (f"launch.device: cuda, but the SGLang python {py} (MTEPO_SGLANG_PYTHON) is SGLang's CPU build "
            f"(tools/install_sglang_cpu.sh: {tmp_path / 'sglang-venv' / marker}): set MTEPO_SGLANG_PYTHON to") in msg
    assert "\n" not in msg and "TEPO_PYTHON to" not in msg.replace("MTEPO_SGLANG_PYTHON to", "")


@pytest.mark.parametrize("kw,needle", [
    (dict(cuda=None), "has torch 2.6.0+cpu (CPU build): set MTEPO_SGLANG_PYTHON"),
    (dict(sglang=False), "cannot import sglang: set MTEPO_SGLANG_PYTHON"),
])
def test_an_sglang_python_that_cannot_serve_a_gpu_is_refused(tmp_path, monkeypatch, kw, needle):
    _sglang(tmp_path, monkeypatch, **kw)
    with pytest.raises(FitError, match=re.escape(needle)):
        check_pythons(_spec(), str(standin_python(tmp_path / "trainer-venv")))


def test_a_colocated_layout_needs_sglangs_memory_saver(tmp_path, monkeypatch):
    """The colocated servers start with --enable-memory-saver: an SGLang python without
    torch_memory_saver would fail on every node; refused at the fit check, naming the variable."""
    py = _sglang(tmp_path, monkeypatch, memory_saver=False)
    trainer = str(standin_python(tmp_path / "trainer-venv"))
    with pytest.raises(FitError) as err:
        check_pythons(_spec("qwen3_14b_colocated"), trainer)
    msg = str(err.value)
    assert (f"launch.sglang.placement: colocated starts the servers with SGLang's memory saver, which the SGLang "
            f"python {py} (MTEPO_SGLANG_PYTHON) does not have") in msg and "set MTEPO_SGLANG_PYTHON to" in msg
    assert check_pythons(_spec("qwen3_14b"), trainer)  # the separate layout does not need it
    _sglang(tmp_path, monkeypatch, memory_saver=True)
    assert check_pythons(_spec("qwen3_14b_colocated"), trainer)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_an_sglang_too_old_for_routing_replay_is_refused_before_any_server_starts(tmp_path, monkeypatch, device):
    """Issue #50 row 4: actor.routing_replay: r3 needs SGLang >= 0.5.7 (--enable-return-routed-experts),
    later than pyproject.toml's floor: the fit check reads the SGLang python's version and refuses an
    older one in one line naming the setting, the minimum and the variable to set, on either device
    (an older SGLang's servers would die parsing their arguments); without r3 the same python
    serves; 0.5.7 serves r3 (a cpu job's servers need 0.5.14 for their own flags, named with it)."""
    py = _sglang(tmp_path, monkeypatch, sglang_version="0.5.6.post2")
    trainer = str(standin_python(tmp_path / "trainer-venv"))
    with pytest.raises(FitError) as err:
        check_pythons(_spec("qwen3_30b_a3b", f"launch.device={device}"), trainer)
    cpu = ("; launch.device: cpu needs SGLang >= 0.5.14 (the CPU servers' --cuda-graph-backend-decode/-prefill)"
           if device == "cpu" else "")
    assert str(err.value) == (f"actor.routing_replay: r3 needs SGLang >= 0.5.7 (--enable-return-routed-experts){cpu}, "
                              f"found 0.5.6.post2 in the SGLang python {py} (MTEPO_SGLANG_PYTHON): set "
                              f"MTEPO_SGLANG_PYTHON to a python with a newer SGLang (docs/ROLLOUT.md#sglang-versions)")
    found = check_pythons(_spec("qwen3_30b_a3b", f"launch.device={device}", "actor.routing_replay=off"), trainer)
    assert found == [] if device == "cpu" else "sglang 0.5.6.post2" in found[-1]
    serves = "0.5.14" if device == "cpu" else "0.5.7"
    _sglang(tmp_path, monkeypatch, sglang_version=serves)
    found = check_pythons(_spec("qwen3_30b_a3b", f"launch.device={device}"), trainer)
    assert found[-1] == f"SGLang python: {py} (MTEPO_SGLANG_PYTHON): torch 2.6.0+cu126 (CUDA 12.6), sglang {serves}"


def _fake_nvidia_smi(tmp_path, monkeypatch, capability):
    """An ``nvidia-smi`` on PATH that reports two GPUs of compute ``capability`` (``"9.0"``: Hopper)."""
    bin_ = tmp_path / "fake-bin"
    bin_.mkdir(exist_ok=True)
    smi = bin_ / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$*\" in *compute_cap*) printf '{capability}\\n{capability}\\n' ;; *) exit 9 ;; esac\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("trainer,capability,needle", [
    (dict(fla=False), None, "fla-core is not installed: pip install fla-core"),
    (dict(triton_version="3.6.0"), "9.0", "flash-linear-attention refuses the Gated DeltaNet backward on a Hopper "
                                          "GPU with Triton 3.6.0"),
], ids=["no-fla-core", "hopper-triton-3.6"])
def test_a_qwen3_5_launch_is_refused_before_any_server_when_its_gated_deltanet_cannot_train(
        tmp_path, monkeypatch, trainer, capability, needle):
    """Issue #56 rows 4-5: a Qwen3.5 job whose trainer's python lacks fla-core (the run would train on
    the pure-torch stand-in) or, on Hopper, has a Triton in [3.4.0, 3.7.1) without tilelang (the
    actor refused the model only after the servers had loaded) is refused by the fit check, one line
    naming the python and the ways out; MTEPO_GDN_KERNELS=torch (the stand-in asked for by name),
    tilelang, a Triton outside the range or a GPU other than Hopper pass. A model without Gated
    DeltaNet layers is not asked."""
    monkeypatch.delenv("MTEPO_GDN_KERNELS", raising=False)
    if capability:
        _fake_nvidia_smi(tmp_path, monkeypatch, capability)
    _sglang(tmp_path, monkeypatch)
    py = standin_python(tmp_path / "trainer-venv", **trainer)
    with pytest.raises(FitError) as err:
        check_pythons(_spec("qwen3.5_27b"), str(py))
    msg = str(err.value)
    assert msg.startswith(f"qwen3_5's Gated DeltaNet layers, trained in the trainer's python {py}: ")
    assert needle in msg and "set MTEPO_GDN_KERNELS=torch" in msg and "\n" not in msg
    found = check_pythons(_spec("qwen3_14b"), str(py))  # no Gated DeltaNet: not asked
    assert "fla-core" not in found[0]
    monkeypatch.setenv("MTEPO_GDN_KERNELS", "torch")
    found = check_pythons(_spec("qwen3.5_27b"), str(py))
    assert found[0].startswith(f"trainer python: {py}: torch 2.6.0+cu126 (CUDA 12.6), Transformer Engine installed, "
                               f"fla-core {'not ' if trainer.get('fla') is False else ''}installed, Triton ")
    monkeypatch.delenv("MTEPO_GDN_KERNELS")
    if capability:  # the other ways out of the refused backward
        for kw in (dict(tilelang=True), dict(triton_version="3.7.1"), dict(triton_version="3.3.1")):
            ok = standin_python(tmp_path / f"trainer-{len(kw)}-{sorted(kw.items())[0][1]}", **{**trainer, **kw})
            assert check_pythons(_spec("qwen3.5_27b"), str(ok)), kw
        _fake_nvidia_smi(tmp_path, monkeypatch, "10.0")  # Blackwell: fla computes it right
        assert check_pythons(_spec("qwen3.5_27b"), str(py))


def test_the_hybrid_builder_and_the_launch_read_one_rule(monkeypatch):
    """One source of truth: the actor's build-time refusal (cpu_patches.fla_backward_refusal) and the
    launch's check both answer through megatron_tepo.gdn_kernels."""
    from megatron_tepo import gdn_kernels
    from megatron_tepo.megatron import cpu_patches

    monkeypatch.delenv("MTEPO_GDN_KERNELS", raising=False)
    monkeypatch.setattr(gdn_kernels, "BAD_TRITON", ((3, 0, 0), (3, 1, 0)))
    assert cpu_patches.fla_backward_refusal((9, 0), "3.0.5", False) and not cpu_patches.fla_backward_refusal(
        (9, 0), "3.6.0", False)
    assert gdn_kernels.kernels_problem(fla=True, triton_version="3.0.5", tilelang=False, capabilities=[(9, 0)])


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_an_sglang_older_than_qwen3_5_is_refused_before_any_server_starts(tmp_path, monkeypatch, device):
    """Issue #56 row 6: SGLang's qwen3_5 models came in 0.5.9; an older SGLang's servers die on an
    unknown architecture after the allocation. The fit check refuses it for a Qwen3.5 model (dense or
    MoE), one line naming the model, the minimum and the variable; 0.5.9 serves it; other models are
    not bound by it."""
    monkeypatch.setenv("MTEPO_GDN_KERNELS", "torch")
    py = _sglang(tmp_path, monkeypatch, sglang_version="0.5.8.post1")
    trainer = str(standin_python(tmp_path / "trainer-venv"))
    for name in ("qwen3.5_27b", "qwen3.5_35b_a3b"):
        spec = _spec(name, f"launch.device={device}", "actor.routing_replay=off")
        with pytest.raises(FitError) as err:
            check_pythons(spec, trainer)
        msg = str(err.value)
        assert ("a Qwen3.5 model needs SGLang >= 0.5.9 (its qwen3_5 models, Qwen3_5ForConditionalGeneration and "
                "Qwen3_5MoeForConditionalGeneration)") in msg, msg
        assert f"found 0.5.8.post1 in the SGLang python {py} (MTEPO_SGLANG_PYTHON)" in msg and "\n" not in msg
    if device == "cuda":
        assert check_pythons(_spec("qwen3_14b"), trainer)  # not a Qwen3.5: the declared floor is enough
        _sglang(tmp_path, monkeypatch, sglang_version="0.5.9")
        assert check_pythons(_spec("qwen3.5_27b"), trainer)[-1].endswith("sglang 0.5.9")


@pytest.mark.sglang
def test_the_real_sglang_venv_serves_routing_replay(tmp_path, monkeypatch):
    """The CPU SGLang the tests run (0.5.23) passes the same check, read from its own metadata."""
    from tests.rollout.conftest import require_sglang

    monkeypatch.setenv("MTEPO_SGLANG_PYTHON", require_sglang())
    found = check_pythons(_spec("qwen3_30b_a3b", "launch.device=cpu"), str(tmp_path / "unused"))
    assert found == [f"SGLang python: {require_sglang()} (MTEPO_SGLANG_PYTHON): torch 2.13.0+cpu (CPU build), "
                     f"sglang 0.5.23"], found


def test_a_python_that_does_not_run_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MTEPO_SGLANG_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(FitError) as err:
        check_pythons(_spec(), str(tmp_path / "missing" / "python"))
    msg = str(err.value)
    assert f"the trainer's python {tmp_path}/missing/python does not run here" in msg and "set TEPO_PYTHON" in msg
    assert (f"the SGLang python (MTEPO_SGLANG_PYTHON) {tmp_path}/nowhere/python does not run here" in msg
            and "set MTEPO_SGLANG_PYTHON" in msg)


def test_what_is_not_checked(tmp_path, monkeypatch):
    """No servers (rollout.engine: embedded): no SGLang python. launch.device: cpu: nothing."""
    monkeypatch.setenv("MTEPO_SGLANG_PYTHON", str(tmp_path / "nowhere" / "python"))
    found = check_pythons(_spec("qwen3_14b", "rollout.engine=embedded"), str(standin_python(tmp_path / "t")))
    assert len(found) == 1 and found[0].startswith("trainer python:")
    assert check_pythons(_spec("tiny_cpu"), str(tmp_path / "missing" / "python")) == []


def test_a_cuda_server_refuses_the_cpu_build(tmp_path):
    """The serve command and the fleet's launch_server build every server's command line with
    server_command: a cuda server with a python of the marked venv is refused there too."""
    venv = tmp_path / ".venv-sglang"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / CPU_BUILD_MARKERS[0]).write_text("x\n")
    py = str(venv / "bin" / "python")
    refused = r"device cuda: the SGLang python .* is the CPU build .*set MTEPO_SGLANG_PYTHON"
    with pytest.raises(ValueError, match=refused):
        server_command(ServerConfig(model_path="/m", python=py, device="cuda"), 30000, base_env={})
    argv, _ = server_command(ServerConfig(model_path="/m", python=py, device="cpu"), 30000, base_env={})
    assert argv[0] == py  # what it was built for
    assert cpu_build_marker(py) == venv / CPU_BUILD_MARKERS[0]
    assert cpu_build_marker("python-that-is-on-no-path-7c1") is None


def test_the_cpu_install_marks_its_venv_before_installing_anything():
    text = (ROOT / "tools" / "install_sglang_cpu.sh").read_text()
    mark = text.index(f'> "$venv/{CPU_BUILD_MARKERS[0]}"')
    assert mark < text.index('"$py" -m pip install') and mark < text.index('echo "$py"; exit 0')
    assert f'stamp="$venv/{CPU_BUILD_MARKERS[1]}"' in text


# ---- rows 7 and 9: each step's environment ------------------------------------------------------
# Each server writes its environment whole (a temporary file, then a rename); the trainer waits
# (up to 60 s) for every server's before it writes its own and the job ends: the job stops its
# servers when the trainer exits, which cut a late server's report short once (CI, a quiet run).
RECORD = """    *megatron_tepo.rollout.sglang.server*) env > "$TEPO_REPORT_DIR/.sglang.$$.tmp" && mv "$TEPO_REPORT_DIR/.sglang.$$.tmp" "$TEPO_REPORT_DIR/sglang.$$.env"; exit 0 ;;
    *torch.distributed.run*) n=$(grep -o "http://" <<<"${TEPO_SGLANG_URLS:-}" | wc -l); for _ in $(seq 600); do [ "$(ls "$TEPO_REPORT_DIR" | grep -c '^sglang\..*\.env$')" -ge "$n" ] && break; sleep 0.1; done; env > "$TEPO_REPORT_DIR/trainer.env"; exit 0 ;;
"""
FAKE_SRUN = """#!/bin/bash
# stand-in srun: drop the options, run the command here in this environment (srun's --export=ALL)
while [[ "$1" == -* ]]; do shift; done
exec "$@"
"""


def _read_env(path):
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def _run_job(tmp_path, script, device="cuda", **user_env):
    """tepo_main of ``script`` for real, with stand-in srun / curl and recording pythons; returns
    (the trainer's environment, [each server's environment])."""
    bin_dir, reports = tmp_path / "bin", tmp_path / "reports"
    bin_dir.mkdir()
    reports.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "curl").write_text("#!/bin/bash\nexit 0\n")  # every /health answers
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    pythons = {"TEPO_PYTHON": str(standin_python(tmp_path / "trainer-venv", cases=RECORD)),
               "MTEPO_SGLANG_PYTHON": str(standin_python(tmp_path / "sglang-venv", te=False, sglang=True))}
    if device == "cpu":
        pythons.pop("MTEPO_SGLANG_PYTHON")
    env = _clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", TEPO_ROOT=str(ROOT), TEPO_REPORT_DIR=str(reports),
                     TEPO_RUN_DIR=str(tmp_path / "run"), OUTPUT_DIR=str(tmp_path / "out"), TEPO_SERVER_RESTARTS="0",
                     MODEL_PATH=str(tmp_path / "model"), **pythons, **user_env)
    env["TEPO_NODELIST"] = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip() \
        if device == "cpu" else "n1 n2 n3 n4"
    res = subprocess.run(["bash", str(ROOT / "slurm" / script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    servers = [_read_env(p) for p in sorted(reports.glob("sglang.*.env"))]
    return _read_env(reports / "trainer.env"), servers


def test_the_trainers_settings_reach_the_trainer_step_only(tmp_path):
    """Row 7, cuda (the 14B job: 2 rollout nodes x 4 servers): the trainer's settings are in no
    server's environment and in the trainer's; the job's NCCL network settings are in both."""
    trainer, servers = _run_job(tmp_path, "qwen3_14b_tepo.sh")
    assert len(servers) == 8
    for env in servers:
        assert {k: env[k] for k in TRAINER_VARS if k in env} == {}
        assert env["NCCL_IB_TIMEOUT"] == "22" and env["CUDA_VISIBLE_DEVICES"] in ("0,1", "2,3", "4,5", "6,7")
    assert (trainer["CUDA_DEVICE_MAX_CONNECTIONS"], trainer["OMP_NUM_THREADS"]) == ("1", "8")
    assert trainer["NCCL_ASYNC_ERROR_HANDLING"] == trainer["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "MKL_NUM_THREADS" not in trainer
    assert trainer["NCCL_IB_TIMEOUT"] == "22" and trainer["TEPO_SGLANG_URLS"].count("http://") == 8


@pytest.mark.parametrize("user,want", [
    (None, "expandable_segments:True"),
    ("max_split_size_mb:256,garbage_collection_threshold:0.6",) * 2,
    ("", ""),  # set, though empty: torch's own defaults, the user's choice
], ids=["unset", "users-value", "users-empty-value"])
def test_the_trainer_gets_expandable_segments_unless_the_user_set_it(tmp_path, user, want):
    """Row 9: packed micro-batches change size every step; the trainer step's allocator grows
    segments instead of fragmenting, unless the user's PYTORCH_CUDA_ALLOC_CONF says otherwise."""
    extra = {} if user is None else {"PYTORCH_CUDA_ALLOC_CONF": user}
    trainer, servers = _run_job(tmp_path, "qwen3_14b_tepo.sh", OMP_NUM_THREADS="4", **extra)
    assert trainer["PYTORCH_CUDA_ALLOC_CONF"] == want
    assert trainer["OMP_NUM_THREADS"] == "4"  # the user's value wins over the trainer's default 8 too
    # what the job adds stays out of the servers; the user's own environment is the whole job's
    assert all("CUDA_DEVICE_MAX_CONNECTIONS" not in env and env["OMP_NUM_THREADS"] == "4" for env in servers)
    assert all(env.get("PYTORCH_CUDA_ALLOC_CONF") == user for env in servers)


def test_the_cpu_job_gives_its_trainer_one_thread_and_the_servers_theirs(tmp_path):
    """launch.device cpu (slurm/local_cpu_tepo.sh): one OMP/MKL thread in the trainer step, none set
    in the server step (the serve command gives each CPU server launch.sglang.threads), no GPU in
    either, no allocator setting."""
    trainer, servers = _run_job(tmp_path, "local_cpu_tepo.sh", device="cpu")
    assert len(servers) == 1
    assert (trainer["OMP_NUM_THREADS"], trainer["MKL_NUM_THREADS"], trainer["CUDA_VISIBLE_DEVICES"]) == ("1", "1", "")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in trainer and "CUDA_DEVICE_MAX_CONNECTIONS" not in trainer
    assert {k: servers[0][k] for k in TRAINER_VARS if k in servers[0]} == {}
    assert servers[0]["CUDA_VISIBLE_DEVICES"] == ""


def test_the_dry_run_shows_the_trainers_settings_on_its_srun_line(tmp_path):
    env = gpu_pythons(tmp_path)
    res = _dry_run_14b(tmp_path, **env)
    assert res.returncode == 0, res.stderr
    logs = next((tmp_path / "out" / "logs").iterdir())
    trainer = (logs / "trainer.log").read_text()
    assert ("--kill-on-bad-exit=1 env NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 "
            "CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=8 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            f"{env['TEPO_PYTHON']} -m torch.distributed.run") in trainer
    sglang = (logs / "sglang.n3.srun.log").read_text()
    assert not any(v in sglang for v in TRAINER_VARS)
