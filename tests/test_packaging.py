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


def test_core_imports_need_only_core_dependencies():
    """`import specdec` and the CLI must not need an optional extra (the README's first command installs only the
    gguf extra): every module-level import of the specdec modules they load is stdlib, specdec, or a package in
    the closure of the core dependencies."""
    import ast
    import re
    from importlib import metadata

    import tomllib

    code = ("import sys, specdec, specdec.cli, specdec.drafters.medusa, specdec.drafters.draft_model; "
            "print(' '.join(m.__file__ for n, m in sys.modules.items() if n.startswith('specdec') and m.__file__))")
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=REPO.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {}  # top-level module -> a specdec file importing it at module level
    for path in proc.stdout.split():
        for node in ast.parse(Path(path).read_text()).body:  # module level only: lazy imports are allowed
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for n in names:
                imported.setdefault(n.split(".")[0], Path(path).name)
    third_party = {m: f for m, f in imported.items() if m not in sys.stdlib_module_names and m != "specdec"}

    def name(req: str) -> str:
        return re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")

    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    allowed, todo = set(), [name(r) for r in core]
    while todo:  # the closure of the core dependencies, without their extras
        dist = todo.pop()
        if dist not in allowed:
            allowed.add(dist)
            try:
                todo += [name(r) for r in metadata.requires(dist) or [] if "extra ==" not in r]
            except metadata.PackageNotFoundError:
                pass
    owners = metadata.packages_distributions()
    outside = {m: f for m, f in third_party.items()
               if not {d.lower().replace("_", "-") for d in owners.get(m, [m])} & allowed}
    assert third_party and not outside, f"module-level imports of non-core packages (module: file): {outside}"
