"""Keeps the repo folders ``drafters/ kernels/ train/ eval/`` from acting as top-level packages.

They install as ``specdec.drafters`` etc. From the repo root Python puts the working
directory first on ``sys.path``, so a bare ``import kernels`` would find the folder. Each
folder's ``__init__`` calls :func:`stand_in` when imported under its bare name: where a
package of that name is installed elsewhere on ``sys.path`` (the Hugging Face ``kernels``
hub, which transformers requires from 5.25 and imports at its own import), that package is
loaded in the folder's place; else the module is an inert stand-in with no file and no
attributes. Either way no specdec code runs under the wrong name.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class _StandIn(types.ModuleType):
    def __getattr__(self, attr: str):
        # AttributeError (not ImportError) so that getattr(module, name, default) probes keep working
        raise AttributeError(
            f"'{self.__name__}' resolved to specdec's repo folder, which is the package 'specdec.{self.__name__}': "
            f"import specdec.{self.__name__} instead (attribute {attr!r} requested)"
        )


def _elsewhere(name: str):
    """The spec of a top-level package ``name`` on ``sys.path`` outside the repo root, or None."""
    path = []
    for entry in sys.path:
        try:
            if Path(entry or ".").resolve() != REPO:
                path.append(entry)
        except (OSError, RuntimeError):  # an entry that cannot be resolved: searched as it is
            path.append(entry)
    return importlib.machinery.PathFinder.find_spec(name, path)


def stand_in(name: str) -> None:
    """Replace the module being imported as ``name`` by the installed package of that name, else an inert
    stand-in."""
    spec = _elsewhere(name)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs, as the import system does: its own submodules find it
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return
    sys.modules[name] = _StandIn(name, f"stand-in: the repo folder {name}/ is specdec.{name}, not {name!r}")
