"""The draft audit catches draft_probs that are not what the drafter sampled from."""
from __future__ import annotations

import pytest
import torch
from specdec.drafters.base import Drafter

import specdec
from specdec.audit import DraftAudit
from specdec.testing import build_tiny_model
from specdec.tree import DraftError, DraftMode, DraftTree

VOCAB = 16


def _tree(gen, mode, sample_probs, reported_probs, width=3):
    """Root children drawn from sample_probs (with or without replacement); claims reported_probs."""
    replacement = mode is DraftMode.INDEPENDENT
    tokens = torch.multinomial(sample_probs, width, replacement=replacement, generator=gen)
    child = torch.multinomial(sample_probs, 1, generator=gen)  # one grandchild under node 0
    tokens = torch.cat([tokens, child])
    parents = torch.tensor([-1] * width + [0])
    return DraftTree(tokens, parents, reported_probs.expand(width + 1, VOCAB).clone(), mode)


@pytest.mark.parametrize("mode", [DraftMode.INDEPENDENT, DraftMode.WITHOUT_REPLACEMENT])
def test_honest_drafts_pass_many_windows(mode):
    gen = torch.Generator().manual_seed(0)
    audit = DraftAudit(window=500)
    probs = torch.softmax(torch.randn(VOCAB, generator=gen) * 2, -1)
    for _ in range(1000):
        audit.observe(_tree(gen, mode, probs, probs), "honest")
    assert audit.tests >= 7 and audit.last_p_value > 1e-8


@pytest.mark.parametrize("mode", [DraftMode.INDEPENDENT, DraftMode.WITHOUT_REPLACEMENT])
def test_lying_drafts_are_caught_with_the_drafter_name(mode):
    gen = torch.Generator().manual_seed(1)
    audit = DraftAudit(window=500)
    truth = torch.softmax(torch.randn(VOCAB, generator=gen) * 2, -1)
    claim = torch.full((VOCAB,), 1.0 / VOCAB)  # e.g. forgot the temperature: claims a flatter law
    with pytest.raises(DraftError, match="liar: .*not drawn from the draft_probs"):
        for _ in range(1000):
            audit.observe(_tree(gen, mode, truth, claim), "liar")


class TemperatureLiar(Drafter):
    """Samples its children at temperature 0.3 but reports the temperature-1 distribution."""

    name = "temperature-liar"

    def __init__(self):
        self.gen = torch.Generator().manual_seed(3)
        self.logits = torch.randn(96, generator=self.gen) * 2

    def propose(self, seqs):
        reported = torch.softmax(self.logits, -1)
        sampled = torch.softmax(self.logits / 0.3, -1)
        trees = []
        for _ in seqs:
            tokens = torch.multinomial(sampled, 2, replacement=True, generator=self.gen)
            trees.append(DraftTree(tokens, [-1, -1], reported.expand(2, 96).clone(), DraftMode.INDEPENDENT))
        return trees


def test_generate_refuses_a_lying_drafter_and_can_be_told_not_to_audit():
    model = build_tiny_model()
    prompts = [[1, 2, 3]] * 64
    with pytest.raises(DraftError, match="temperature-liar"):
        specdec.generate(model, prompts, max_new_tokens=48, drafter=TemperatureLiar(), do_sample=True, seed=0)
    out = specdec.generate(model, prompts[:2], max_new_tokens=8, drafter=TemperatureLiar(), do_sample=True, seed=0,
                           audit_drafts=False)
    assert len(out) == 2
