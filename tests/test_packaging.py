"""Layout: the four repo folders install as specdec.* and never import as top-level packages."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["drafters", "kernels", "train", "eval"]


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_subpackage_installs_under_specdec(name):
    mod = importlib.import_module(f"specdec.{name}")
    assert Path(mod.__file__).resolve() == REPO / name / "__init__.py"


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_bare_import_never_resolves_into_repo(name):
    # run from the repo root, where '' (the cwd) is first on sys.path: the worst case
    code = f"import {name}; print(getattr({name}, '__file__', None)); {name}.anything"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if proc.returncode == 0:  # something else named `name` may exist, but never our folder
        assert not Path(proc.stdout.strip()).resolve().is_relative_to(REPO), proc.stdout
    else:  # our folder answered with the inert stand-in: no file, every attribute names the real package
        assert proc.stdout.strip() == "None", proc.stdout
        assert f"import specdec.{name} instead" in proc.stderr, proc.stderr


def test_transformers_imports_from_the_repo_root():
    # transformers probes for a top-level `kernels` (the HF kernels hub) and imports what it finds
    code = "from transformers import LlamaConfig, LlamaForCausalLM; import specdec; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_console_script_declared():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["specdec"] == "specdec.cli:main"
    assert set(meta["tool"]["setuptools"]["package-dir"]) == {f"specdec.{n}" for n in SUBPACKAGES}


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_bare_name_not_on_test_path(name):
    import importlib.util

    spec = importlib.util.find_spec(name)
    assert spec is None or not Path(spec.origin or "").resolve().is_relative_to(REPO), spec
