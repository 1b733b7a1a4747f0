"""Drafters: everything that proposes draft trees for the target to verify.

``get_drafter("ngram")`` builds a drafter by name; third-party drafters register under
the ``specdec.drafters`` entry-point group.
"""

if __name__ != "specdec.drafters":  # imported as a bare 'drafters' (repo root on sys.path): run nothing
    from specdec.layout_guard import stand_in

    stand_in(__name__)
else:
    from specdec.drafters.base import Drafter, SequenceView
    from specdec.drafters.registry import get_drafter

    __all__ = ["Drafter", "SequenceView", "get_drafter"]
