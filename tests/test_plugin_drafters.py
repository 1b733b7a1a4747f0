"""Drafters from outside specdec, and drafters that break the contract, refused in one line naming them.

- A class registered under the ``specdec.drafters`` entry points need not subclass Drafter (any object with
  ``propose`` is a drafter): named, alone or as a combined drafter's child, it is seen through ``as_drafter``, as
  an instance of it passed to generate() is. Unwrapped, the build died on the missing ``load_for_target`` and then
  again on ``unload_for_target`` in build_engine's cleanup, whose AttributeError hid the first one.
- build_engine's cleanup (``unload_for_target``) never raises over the error that failed the build.
- A combined drafter's child whose propose() gives no list of DraftTrees (None, a generator, lists) is refused as
  the engine refuses such a drafter alone: a DraftError naming it, not a TypeError from ``len`` or ``.tokens``.
- A drafter's ``feature_layers`` must be layer ids of the target (0 to num_layers, the last one's output): any other
  failed with a bare KeyError in the prefill forward; legal ids keep working.
"""
from __future__ import annotations

import pytest
from specdec.drafters import registry
from specdec.drafters.base import Drafter

from specdec.errors import InputError
from specdec.generate import generate
from specdec.models.loader import load_model
from specdec.testing import build_tiny_model
from specdec.tree import DraftError, DraftTree

VOCAB = 96
PROMPTS = [[1, 5, 9, 11, 3], [2, 7, 7, 4]]


@pytest.fixture(scope="module")
def model():
    return load_model(build_tiny_model(vocab_size=VOCAB, seed=0))  # 2 layers


@pytest.fixture(scope="module")
def plain(model):
    return run(model, None)


def run(model, drafter, **kw):
    return generate(model, PROMPTS, drafter=drafter, max_new_tokens=8, speculation="always", **kw)


class PlainRepeat:
    """No Drafter base class: only ``name`` and ``propose``."""

    name = "plainrepeat"

    def __init__(self, k: int = 2) -> None:
        self.k = k

    def propose(self, seqs):
        return [DraftTree.chain([s.token_ids[-1]] * self.k) for s in seqs]


class _EntryPoint:
    def __init__(self, name: str, cls: type) -> None:
        self.name, self.cls = name, cls

    def load(self) -> type:
        return self.cls


def test_a_registered_drafter_that_is_no_drafter_subclass_runs_by_name(model, plain, monkeypatch):
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: [_EntryPoint("plainrepeat", PlainRepeat)] if group == "specdec.drafters" else [])
    assert isinstance(registry.get_drafter("plainrepeat", k=3), Drafter)
    assert run(model, "plainrepeat") == plain
    assert run(model, "combined", drafter_options={"drafters": ["ngram", {"name": "plainrepeat", "k": 1}]}) == plain


class FailingLoad(Drafter):
    """Refuses the target, then fails to clean up too."""

    name = "failing-load"

    def load_for_target(self, runner, tokenizer=None, name=None) -> None:
        raise InputError("failing-load: made for another target")

    def unload_for_target(self) -> None:
        raise AttributeError("no checkpoint attribute")

    def propose(self, seqs):
        return [DraftTree.empty() for _ in seqs]


def test_a_failing_cleanup_does_not_hide_the_error_that_failed_the_build(model):
    with pytest.raises(InputError, match="made for another target"):
        run(model, FailingLoad())


class BadChild:
    name = "badchild"

    def __init__(self, propose) -> None:
        self.propose = propose


@pytest.mark.parametrize("propose, got", [
    (lambda seqs: None, r"one DraftTree per sequence \(2\), got NoneType"),
    (lambda seqs: (DraftTree.chain([1]) for _ in seqs), r"one DraftTree per sequence \(2\), got generator"),
    (lambda seqs: [[1, 2] for _ in seqs], r"returned list, expected DraftTree"),
    (lambda seqs: [DraftTree.chain([1])], r"one DraftTree per sequence \(2\), got 1 trees"),
], ids=["none", "generator", "lists", "too-few"])
def test_a_combined_child_proposing_no_trees_is_refused_naming_it(model, propose, got):
    with pytest.raises(DraftError, match=r"^combined\(ngram\+badchild\): badchild: propose\(\) .*" + got) as err:
        run(model, "combined", drafter_options={"drafters": ["ngram", BadChild(propose)]})
    assert "\n" not in str(err.value)


class Features(Drafter):
    """Reads the input streams of ``feature_layers``; proposes nothing."""

    name = "features"
    needs_hidden_states = True

    def __init__(self, layers) -> None:
        self.feature_layers = layers
        self.widths: set[int] = set()

    def propose(self, seqs):
        self.widths.update(v.new_hidden.shape[-1] for v in seqs if v.new_hidden is not None)
        return [DraftTree.empty() for _ in seqs]


@pytest.mark.parametrize("layers", [(7,), (99,), (-1,), ("a",), (0, 3)])
def test_feature_layers_the_target_lacks_are_refused_before_the_prefill(model, layers):
    with pytest.raises(InputError, match=r"^drafter 'features': feature_layers .* holds .* it has 2 layers") as err:
        run(model, Features(layers))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layers", [(0,), (1,), (2,), (0, 1, 2)])
def test_feature_layers_of_the_target_keep_working(model, plain, layers):
    drafter = Features(layers)
    assert run(model, drafter) == plain
    assert drafter.widths == {len(layers) * model.runner.shape.hidden_size}
