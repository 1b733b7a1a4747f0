"""Drafter lookup by name: built-ins first, then the ``specdec.drafters`` entry points. Options a drafter does not
take are refused by name with the list of those it does (a class forwarding ``**options`` to a config dataclass
names it as ``options_config``)."""
from __future__ import annotations

import dataclasses
import inspect
from importlib.metadata import entry_points
from typing import Any

from specdec.drafters.base import Drafter, as_drafter

from specdec.errors import InputError, InputTypeError

BUILTIN = {
    "ngram": "specdec.drafters.ngram:NGramDrafter",
    "draft-model": "specdec.drafters.draft_model:DraftModelDrafter",
    "self-draft": "specdec.drafters.self_draft:SelfDraftDrafter",
    "medusa": "specdec.drafters.medusa:MedusaDrafter",
    "eagle": "specdec.drafters.eagle:EagleDrafter",
    "mtp": "specdec.drafters.mtp:MtpDrafter",
    "combined": "specdec.drafters.combined:CombinedDrafter",
}


def _load(target: str) -> type:
    module, _, attr = target.partition(":")
    mod = __import__(module, fromlist=[attr])
    return getattr(mod, attr)


def available() -> list[str]:
    names = set(BUILTIN)
    names.update(ep.name for ep in entry_points(group="specdec.drafters"))
    return sorted(names)


def get_drafter(spec: Any, **options: Any) -> Drafter | None:
    """``None`` -> None (plain decoding); a Drafter -> itself; another object with ``propose`` -> a Drafter
    view of it (:func:`~specdec.drafters.base.as_drafter`); a name -> a new drafter."""
    if isinstance(spec, type):  # its propose() would be called unbound, once the model has loaded
        raise InputTypeError(f"drafter must be an instance, got the class {spec.__name__}: pass {spec.__name__}(...)")
    if spec is None or isinstance(spec, Drafter) or callable(getattr(spec, "propose", None)):
        if options:  # None: they would be dropped; an instance: it is built already
            raise InputError(f"drafter options ({', '.join(sorted(options))}) can only be given with a drafter name, "
                             f"got {'None' if spec is None else type(spec).__name__}")
        return as_drafter(spec)
    if not isinstance(spec, str):
        raise InputTypeError(f"drafter must be None, a name or a Drafter instance, got {type(spec).__name__}")
    if spec in BUILTIN:
        cls = _load(BUILTIN[spec])
    else:
        eps = [ep for ep in entry_points(group="specdec.drafters") if ep.name == spec]
        if not eps:
            raise InputError(f"unknown drafter {spec!r}; available: {', '.join(available())}")
        cls = eps[0].load()
    known = option_names(cls)
    unknown = sorted(set(options) - known) if known is not None else []
    if unknown:
        raise InputTypeError(f"drafter {spec!r} has no option {', '.join(map(repr, unknown))}; its options: "
                             f"{', '.join(sorted(known))}")
    return cls(**options)


def option_names(cls: type) -> set[str] | None:
    """The options ``cls(**options)`` takes: its constructor's named parameters and, where it forwards the rest, the
    fields of its ``options_config``; None when that cannot be told (a third party's ``**kwargs``)."""
    names, rest = set(), False
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind is p.VAR_KEYWORD:
            rest = True
        elif p.kind is not p.VAR_POSITIONAL:
            names.add(p.name)
    if not rest:
        return names
    config = getattr(cls, "options_config", None)
    if config is None:
        return None
    return names | {f.name for f in dataclasses.fields(config) if f.init}
