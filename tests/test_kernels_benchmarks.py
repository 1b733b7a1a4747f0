"""The GPU benchmark scripts parse their arguments, refuse cleanly without CUDA, and the kernel sweep's
plumbing (paged setup, gathered SDPA baseline, error column) works in the Triton interpreter."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["bench_kernels_gpu.py", "bench_e2e_gpu.py", "bench_distill_gpu.py"]


def run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # -P: the repo root (cwd) must not shadow specdec.kernels with a top-level `kernels`
    return subprocess.run([sys.executable, "-P", str(REPO / "benchmarks" / script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env={"OMP_NUM_THREADS": "1",
                                                                                **_env()})


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPECDEC_ATTENTION")}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_parses(script):
    proc = run(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_refuses_cleanly_without_cuda(script):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = run(script)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_json_naming_an_earlier_result_is_refused_without_overwrite(script, tmp_path):
    """--json replaced an earlier result without a word, where the CPU scripts refuse: refused in one line (before
    the CUDA check, so on any machine); --overwrite lets the run on to it."""
    earlier = tmp_path / "earlier.json"
    earlier.write_text("{}")
    proc = run(script, "--json", str(earlier))
    assert proc.returncode == 2 and proc.stderr.strip().endswith(f"{earlier} exists; pass --overwrite to replace it")
    assert earlier.read_text() == "{}"
    import torch

    if not torch.cuda.is_available():
        proc = run(script, "--json", str(earlier), "--overwrite")
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_kernel_bench_rejects_bad_tree_size():
    proc = run("bench_kernels_gpu.py", "--tree", "65")
    assert proc.returncode == 2 and "1..64" in proc.stderr


def test_kernel_bench_cpu_smoke(tmp_path):
    import torch

    if torch.cuda.is_available():  # failed there on an H200 (the native sweep is gpu_check's kernels step)
        pytest.skip("a GPU is present: the interpreter smoke run is for machines without one")
    out = tmp_path / "points.json"
    proc = run("bench_kernels_gpu.py", "--cpu-smoke", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    points = json.loads(out.read_text())["points"]
    assert [p["tree"] for p in points] == [1, 5]
    for p in points:  # the kernel and the gathered-cache SDPA baseline agree (fp32)
        assert p["max_abs_err"] < 1e-4
