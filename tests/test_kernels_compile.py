"""The kernels compile for sm_90 (H100) with Triton's bundled ptxas -- no GPU needed.

The interpreter tests check semantics; this catches what only the GPU compiler rejects. Runs
`python -m specdec.kernels.compile_check` in a subprocess with TRITON_INTERPRET unset.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="needs triton with its NVIDIA backend",
)


def run_check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-P", "-m", "specdec.kernels.compile_check", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_kernels_compile_for_h100_quick():
    """... and attention does not spill registers: float32 tree tiles of 64 rows spilled up to 9 KB of stack per
    thread on sm_90 (912 bytes in the 8B shape's config here), a slow local-memory round trip in every tile."""
    proc = run_check("--quick", "--max-stack", "64")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "9/9 kernels compiled for sm_90" in proc.stdout and "attn fp32 llama8b new=65" in proc.stdout


@pytest.mark.slow
def test_every_launch_config_compiles_for_h100():
    proc = run_check()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout
