"""One seed, one text, whatever the cost cache holds: seeded standard sampling reads no measurement of this machine
(its trees are verified whole), so deleting the cache, a recalibration that measures another curve, a first call
and a new process all give the same text; no timing run draws from a drafter's own random numbers. A drafter that
can never pay by its shapes alone is not asked under a seed either."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_model import EagleConfig, EagleModel

from specdec import engine_setup
from specdec.cost_model import CostModel
from specdec.generate import generate
from specdec.testing import build_tiny_model
from specdec.tree import DraftMode, DraftTree

PROMPT = [5, 9, 11, 2, 5, 9, 11, 2, 5, 9]
KW = dict(max_new_tokens=24, do_sample=True, temperature=0.7, seed=13, return_dict=True)
CURVES = {"flat": {n: 1.0 for n in (1, 2, 4, 8, 16, 32, 65)},
          "steep": {n: 1.0 + (n - 1) / 4 for n in (1, 2, 4, 8, 16, 32, 65)}}


def drafters(model) -> dict:
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config, depth=3, top_k=2, max_nodes=6))
    eagle.init_from_target(model)
    return {"ngram": lambda: ("ngram", None),
            # a layer fewer than the target: one of its size would never be asked (it can never pay)
            "draft-model": lambda: ("draft-model", {"model": build_tiny_model(seed=4, num_hidden_layers=1),
                                                    "num_draft_tokens": 3}),
            "eagle": lambda: (EagleDrafter(model=eagle), None)}


def with_fresh_cache(tmp_path, monkeypatch, curve: str):
    """A fresh cost directory whose calibration measures ``curve`` (as a recalibration on a busy machine might)."""
    folder = tmp_path / curve
    folder.mkdir()
    monkeypatch.setenv("SPECDEC_COST_DIR", str(folder))
    costs = CostModel({"curve": curve}, {1: {n: 0.01 * c for n, c in CURVES[curve].items()}},
                      file=folder / f"verify-{curve}.json")
    monkeypatch.setattr(engine_setup, "load_cost_model", lambda runner, config=None, **kw: costs)


@pytest.mark.parametrize("name", ["ngram", "draft-model", "eagle"])
def test_one_seed_gives_one_text_across_fresh_cost_caches(tmp_path, monkeypatch, name):
    model = build_tiny_model()
    make = drafters(model)[name]
    texts = []
    for curve in ("flat", "steep", "flat"):
        folder = tmp_path / f"{len(texts)}"
        folder.mkdir()
        with_fresh_cache(folder, monkeypatch, curve)
        drafter, options = make()
        texts.append(generate(model, [PROMPT], drafter=drafter, drafter_options=options, **KW).sequences)
    assert texts[0] == texts[1] == texts[2]


def test_a_seeded_standard_sampling_call_with_a_drafter_says_its_price_once(caplog):
    """No guard holds a drafter off under seeded standard sampling (one text per seed), so one that does not pay
    decodes slower than no drafter (Medusa's 64-node trees at 0.3x on the embedded model): a warning, once a
    process, names the coupled sampler; nothing is said without a drafter or a seed."""
    import logging

    engine_setup._warn_seeded_standard_sampling.cache_clear()
    model = build_tiny_model()
    with caplog.at_level(logging.WARNING, logger="specdec.engine_setup"):
        generate(model, [PROMPT], **KW)
        generate(model, [PROMPT], drafter="ngram", **{**KW, "seed": None})
        assert "seeded standard sampling" not in caplog.text
        for _ in range(2):
            generate(model, [PROMPT], drafter="ngram", **KW)
    warned = [r.getMessage() for r in caplog.records if "seeded standard sampling" in r.getMessage()]
    assert len(warned) == 1 and "slower than no drafter" in warned[0] and "sampler='coupled'" in warned[0]


class OwnRandom:
    """A custom drafter that samples from its own generator, made anew for every call."""

    name = "own-random"

    def __init__(self, vocab: int) -> None:
        self.g = torch.Generator().manual_seed(99)
        self.vocab = vocab

    def propose(self, seqs):
        q = torch.full((self.vocab,), 1.0 / self.vocab)
        trees = []
        for _ in seqs:
            x = torch.multinomial(q, 2, generator=self.g)
            trees.append(DraftTree(x, [-1, 0], q.expand(2, -1), DraftMode.INDEPENDENT))
        return trees


def test_a_drafters_own_randomness_is_not_consumed_before_its_first_call(tmp_path, monkeypatch):
    model = build_tiny_model()
    vocab = model.config.vocab_size
    with_fresh_cache(tmp_path, monkeypatch, "flat")
    first, second = (generate(model, [PROMPT], drafter=OwnRandom(vocab), **KW).sequences for _ in range(2))
    assert first == second


def counted(model, **options) -> DraftModelDrafter:
    """A draft-model drafter that counts its propose calls (``calls``)."""
    drafter = DraftModelDrafter(model, **options)
    drafter.calls, propose = 0, drafter.propose

    def counting(seqs):
        drafter.calls += 1
        return propose(seqs)

    drafter.propose = counting
    return drafter


def test_a_seeded_call_never_asks_a_draft_model_as_costly_as_the_target():
    """The target itself, or a model of its size, drafting: no draft can pay, and the shapes say so before the first
    token, so a seeded call decodes plainly and never asks it: with seed= the text is plain decoding's, with
    generator= one text per generator state. A smaller draft model is still asked under a seed."""
    model = build_tiny_model()
    plain = generate(model, [PROMPT], **KW)
    for draft in (model, build_tiny_model(seed=4)):
        drafter = counted(draft, num_draft_tokens=3)
        out = generate(model, [PROMPT], drafter=drafter, **KW)
        assert drafter.calls == 0 and drafter.cache is None and out.sequences == plain.sequences
        assert out.stats[0].steps == KW["max_new_tokens"]
    unseeded = {k: v for k, v in KW.items() if k != "seed"}
    texts = []
    for _ in range(2):
        drafter = counted(model, num_draft_tokens=3)
        texts.append(generate(model, [PROMPT], drafter=drafter, generator=torch.Generator().manual_seed(13),
                              **unseeded).sequences)
        assert drafter.calls == 0
    assert texts[0] == texts[1]
    smaller = counted(build_tiny_model(seed=4, num_hidden_layers=1), num_draft_tokens=3)
    out = generate(model, [PROMPT], drafter=smaller, **KW)
    assert smaller.calls > 0 and out.stats[0].steps < KW["max_new_tokens"]


@pytest.mark.slow
def test_one_seed_gives_one_text_in_another_process(tmp_path):
    """A new process with an empty cost directory gives this process's text."""
    here = generate(build_tiny_model(), [PROMPT], drafter="ngram", **KW).sequences
    code = ("import json, sys; from specdec.generate import generate; from specdec.testing import build_tiny_model; "
            f"kw = {KW!r}; print(json.dumps(generate(build_tiny_model(), [{PROMPT!r}], drafter='ngram', **kw)"
            ".sequences))")
    env = dict(os.environ, SPECDEC_COST_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_a_generator_seeds_standard_sampling_as_seed_does_reading_no_measured_costs(monkeypatch):
    """generator= fixes the text as seed= does, so seeded standard sampling with one reads no measurement either:
    its trees are verified whole (no sizer), and the cost model is never loaded."""
    from specdec.generate import prepare

    monkeypatch.setattr(engine_setup, "load_cost_model", lambda *a, **k: pytest.fail("the cost model was read"))
    request = prepare(build_tiny_model(), [PROMPT], drafter="ngram", max_new_tokens=4, do_sample=True,
                      generator=torch.Generator().manual_seed(0))
    engine = engine_setup.build_engine(request)
    assert engine.policy.auto and engine.policy.sizer is None


def test_seeded_coupled_sampling_sizes_its_trees_from_the_measured_costs(tmp_path, monkeypatch):
    """Coupled sampling's text does not depend on the trees, so a seed leaves its speculation policy whole: the tree
    sizer runs on the measured costs, unlike seeded standard sampling."""
    from specdec.generate import prepare

    with_fresh_cache(tmp_path, monkeypatch, "flat")
    request = prepare(build_tiny_model(), [PROMPT], drafter="ngram", max_new_tokens=4, do_sample=True,
                      sampler="coupled", seed=13)
    assert engine_setup.build_engine(request).policy.sizer is not None


def test_greedy_decoding_with_a_drafter_draws_nothing_from_the_generator():
    """Greedy decoding draws no random number, with a drafter or without: the caller's generator comes back in the
    state it went in, so a later sampled call on it gives the text it would have given."""
    model = build_tiny_model()
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state().clone()
    generate(model, [PROMPT], drafter="ngram", max_new_tokens=6, speculation="always", generator=generator)
    assert torch.equal(generator.get_state(), state)
