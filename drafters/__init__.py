"""Drafters: everything that proposes draft trees for the target to verify.

``get_drafter("ngram")`` builds a drafter by name; third-party drafters register under
the ``specdec.drafters`` entry-point group. The names below load (with torch) on first use, so that
``specdec.drafters.cli`` builds the CLI's parsers without torch.
"""

if __name__ != "specdec.drafters":  # imported as a bare 'drafters' (repo root on sys.path): run nothing
    from specdec.layout_guard import stand_in

    stand_in(__name__)
else:
    __all__ = ["Drafter", "SequenceView", "get_drafter"]

    def __getattr__(name: str):
        if name in ("Drafter", "SequenceView"):
            from specdec.drafters import base

            return getattr(base, name)
        if name == "get_drafter":
            from specdec.drafters.registry import get_drafter

            return get_drafter
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
