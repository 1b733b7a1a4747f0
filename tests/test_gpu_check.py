"""benchmarks/gpu_check.py runs the CUDA cases of every test file that has them: a device-parametrised test, or one
skipped without CUDA, left out of its lists never runs on a GPU (seven files were, 2026-11-26, and the first GPU run
after them failed; tests/test_host_sync.py was, until 2026-11-28)."""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files_with_device_tests() -> set[str]:
    """Files with a ``device``-parametrised test, or a test that runs only where CUDA is (skipped without it)."""
    found = set()
    for path in sorted((REPO / "tests").glob("test_*.py")):
        if re.search(r"skipif\(\s*not torch\.cuda\.is_available\(\)", path.read_text()):
            found.add(f"tests/{path.name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                if "device" in [a.arg for a in node.args.args]:
                    found.add(f"tests/{path.name}")
                    break
    return found


def test_every_device_parametrised_test_file_is_run_by_gpu_check():
    check = _gpu_check()
    listed = set(check.KERNEL_FILES) | set(check.DEVICE_FILES)
    wanted = _files_with_device_tests()
    assert "tests/test_generate.py" in wanted  # the scan sees the fixture
    assert "tests/test_host_sync.py" in wanted  # and a test skipped without CUDA
    assert wanted <= listed, f"add to benchmarks/gpu_check.py DEVICE_FILES: {sorted(wanted - listed)}"
    assert all((REPO / f).is_file() for f in listed), "gpu_check lists a test file that does not exist"


def test_speed_step_is_opt_in_and_rehearses_alone():
    check = _gpu_check()
    assert "speed" not in check.parse_args([]).steps.split(",")  # the default run keeps its length
    assert check.parse_args(["--steps", "speed", "--rehearse"]).rehearse
    with pytest.raises(SystemExit):
        check.parse_args(["--steps", "env,speed", "--rehearse"])  # the CPU rehearsal has no GPU steps
