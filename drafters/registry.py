"""Drafter lookup by name: built-ins first, then the ``specdec.drafters`` entry points. Options a drafter does not
take are refused by name with the list of those it does (a class forwarding ``**options`` to a config dataclass
names it as ``options_config``). On the command line that list leaves out the options only Python can give (a
drafter names them as ``python_only_options``: a config object, a module, a callable). Drafters nested in the
options (a combined drafter's children) are checked the same way; the nesting drafter names where each sits."""
from __future__ import annotations

import dataclasses
import inspect
from importlib.metadata import entry_points
from typing import Any

from specdec.drafters.base import Drafter, as_drafter

from specdec.errors import InputError, InputTypeError, closest

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
    view of it (:func:`~specdec.drafters.base.as_drafter`); a name -> a new drafter (a registered class that is no
    Drafter subclass, seen through that view too)."""
    if isinstance(spec, type):  # its propose() would be called unbound, once the model has loaded
        raise InputTypeError(f"drafter must be an instance, got the class {spec.__name__}: pass {spec.__name__}(...)")
    if spec is None or isinstance(spec, Drafter) or callable(getattr(spec, "propose", None)):
        if options:  # None: they would be dropped; an instance: it is built already
            raise InputError(f"drafter options ({', '.join(sorted(options))}) can only be given with a drafter name, "
                             f"got {'None' if spec is None else type(spec).__name__}")
        return as_drafter(spec)
    if not isinstance(spec, str):
        raise InputTypeError(f"drafter must be None, a name or a Drafter instance, got {type(spec).__name__}")
    check_options(spec, options)
    return as_drafter(drafter_class(spec)(**options))


def drafter_class(spec: str) -> type:
    """The class the drafter name ``spec`` builds; InputError for an unknown name."""
    if spec in BUILTIN:
        return _load(BUILTIN[spec])
    eps = [ep for ep in entry_points(group="specdec.drafters") if ep.name == spec]
    if not eps:
        raise InputError(f"unknown drafter {spec!r}{_meant(spec)}; available: {', '.join(available())}")
    return eps[0].load()


def _meant(spec: str) -> str:
    """The drafter name ``spec`` likely meant, as the unknown name's hint: names are lower case with hyphens
    ("NGram", "draft_model", "eagle3" are misspellings of "ngram", "draft-model", "eagle"); "" for none."""
    if spec.strip().lower() == "none":
        return " (leave the drafter out, drafter=None, to decode plainly)"
    names = available()
    folded = spec.strip().lower().replace("_", "-").replace(" ", "-")
    meant = folded if folded in names else closest(folded, names)
    return f" (did you mean {meant!r}?)" if meant else ""


def check_options(spec: str, options: Any, *, command_line: bool = False, nested: bool = False) -> None:
    """Refuse the options the drafter named ``spec`` does not take, naming those it does: as ``get_drafter`` takes
    them, or (``command_line``) as ``--drafter-option KEY=VALUE`` gives them, without ``python_only_options``;
    then those of the drafters nested in them (``Drafter.check_nested_options``). ``nested``: the drafter sits in
    another's options (a combined drafter's child), which names where it sits in the refusal."""
    cls = drafter_class(spec)
    known = option_names(cls)
    subject = f"drafter {spec!r}"
    if known is not None and not command_line:
        unknown = sorted(set(options) - known)
        if unknown:
            named = ", ".join(map(repr, unknown)) + _meant_options(unknown, known)
            raise InputTypeError(f"{subject} has no option {named}; its options: {', '.join(sorted(known))}")
    elif known is not None:
        python_only = set(getattr(cls, "python_only_options", ()))  # a class that is no Drafter may lack it
        unknown = sorted(set(options) - (known - python_only))
        if unknown:
            named = ", ".join(f"{k!r} (Python only)" if k in python_only else repr(k) for k in unknown)
            named += _meant_options([k for k in unknown if k not in python_only], known - python_only)
            flag, keys = ("option", "its command-line keys") if nested else ("--drafter-option", "its KEY=VALUE keys")
            raise InputTypeError(f"{subject} has no {flag} {named}; {keys}: {', '.join(sorted(known - python_only))}")
    check_nested = getattr(cls, "check_nested_options", None)  # a class that is no Drafter may lack it
    if check_nested is not None:
        check_nested(options, command_line=command_line)


def _meant_options(unknown: list[str], known: set[str]) -> str:
    """The options the ``unknown`` ones likely meant (``max_node`` -> ``max_nodes``), as a hint; "" for none."""
    meant = [m for name in unknown if (m := closest(name, known))]
    return f" (did you mean {', '.join(map(repr, meant))}?)" if meant else ""


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
