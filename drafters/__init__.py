"""Drafters: everything that proposes draft trees for the target to verify.

``get_drafter("ngram")`` builds a drafter by name; third-party drafters register under
the ``specdec.drafters`` entry-point group.
"""

if __name__ != "specdec.drafters":  # the repo folder must never be imported as a top-level package
    raise ImportError(
        f"{__file__} is the package specdec.drafters, not a top-level 'drafters': import specdec.drafters, and keep the "
        "repo root off sys.path (use the pytest command, or python -P, or run from another directory)"
    )

from specdec.drafters.base import Drafter, SequenceView
from specdec.drafters.registry import get_drafter

__all__ = ["Drafter", "SequenceView", "get_drafter"]
