"""Drafters: everything that proposes draft trees for the target to verify.

``get_drafter("ngram")`` builds a drafter by name; third-party drafters register under
the ``specdec.drafters`` entry-point group.
"""
from specdec.drafters.base import Drafter, SequenceView
from specdec.drafters.registry import get_drafter

__all__ = ["Drafter", "SequenceView", "get_drafter"]
