"""Keeps the repo folders ``drafters/ kernels/ train/ eval/`` from acting as top-level packages.

They install as ``specdec.drafters`` etc. From the repo root Python puts the working
directory first on ``sys.path``, so a bare ``import kernels`` would find the folder. Each
folder's ``__init__`` calls :func:`stand_in` when imported under its bare name: the module
is replaced by an inert stand-in with no file and no attributes, so no specdec code runs
under the wrong name, and probes such as transformers' ``is_kernels_available()`` (which
imports a ``kernels`` it cannot find metadata for) see a shadowing folder, not a package.
"""
from __future__ import annotations

import sys
import types


class _StandIn(types.ModuleType):
    def __getattr__(self, attr: str):
        # AttributeError (not ImportError) so that getattr(module, name, default) probes keep working
        raise AttributeError(
            f"'{self.__name__}' resolved to specdec's repo folder, which is the package 'specdec.{self.__name__}': "
            f"import specdec.{self.__name__} instead (attribute {attr!r} requested)"
        )


def stand_in(name: str) -> None:
    """Replace the module being imported as ``name`` by an inert stand-in."""
    sys.modules[name] = _StandIn(name, f"stand-in: the repo folder {name}/ is specdec.{name}, not {name!r}")
