"""A script of the repo that is no package module (benchmarks/, docs/) loaded as a module of its own, for the tests
of its logic."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_file(path: Path, name: str | None = None, register: bool = False) -> ModuleType:
    """The Python file ``path`` as the module ``name`` (default: its stem); ``register``: in sys.modules first (a
    script's dataclasses look their module up by name)."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_script(name: str, suffix: str = "_under_test") -> ModuleType:
    """benchmarks/<name>.py as the module ``<name><suffix>``, registered in sys.modules."""
    return load_file(BENCHMARKS / f"{name}.py", name + suffix, register=True)
