"""Copies of a prompt catch the model drafters up once (drafters/prompt_copies.py): EAGLE's layer and a draft model run
each distinct prompt's catch-up once, the copies get the first's K/V bit for bit in storage of their own, and every
text is what each copy's own catch-up gave (greedy: plain decoding's; seeded sampling: the same draws)."""
from __future__ import annotations

import pytest
import torch
from specdec.drafters import eagle as eagle_module
from specdec.drafters.base import SequenceView
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.model_drafter import ModelDrafter
from specdec.drafters.prompt_copies import leaders, prompt_copies

import specdec
from specdec.engine import Engine
from specdec.kv_cache import PagedKVCache
from specdec.models.llama import LlamaRunner
from specdec.sampling import SamplingConfig
from specdec.speculation_policy import SpeculationPolicy
from specdec.stopping import StopCriteria
from specdec.testing import build_tiny_model

A = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6]
B = [10, 20, 30, 10, 20, 30, 10, 20, 40, 50]
ALWAYS = dict(speculation="always")  # every tree verified: the drafter is asked at every step


@pytest.fixture(scope="module")
def model():
    return build_tiny_model()


@pytest.fixture(scope="module")
def draft():
    return build_tiny_model(seed=7, num_hidden_layers=1)


def eagle(model, _draft=None):
    torch.manual_seed(0)
    head = EagleModel(EagleConfig.for_target(model.config, depth=3, top_k=2, max_nodes=6))
    head.init_from_target(model)
    return EagleDrafter(model=head)


def draft_model(_model, draft):
    return DraftModelDrafter(draft, num_draft_tokens=3)


DRAFTERS = pytest.mark.parametrize("make", [eagle, draft_model], ids=["eagle", "draft-model"])


@pytest.fixture
def catch_up_rows(monkeypatch):
    """The rows of each call's catch-up: EAGLE's layer (real rows, padding left out) or the draft model's first
    forward of a propose call and any second one before its growth (the copies' own tokens after their prompt)."""
    rows: list[int] = []
    catch_up = eagle_module.catch_up

    def eagle_counting(model, embed, x, *args, **kwargs):
        rows.append(int(x.counts.sum()))
        return catch_up(model, embed, x, *args, **kwargs)

    forward = ModelDrafter._forward

    def model_counting(self, builder, token_ids=None, **kwargs):
        if token_ids is None and all(s.ancestor_bits is None for s in builder._seqs):  # causal: a catch-up
            rows.append(len(builder._tokens))
        return forward(self, builder, token_ids, **kwargs)

    monkeypatch.setattr(eagle_module, "catch_up", eagle_counting)
    monkeypatch.setattr(ModelDrafter, "_forward", model_counting)
    return rows


def skip_first_steps(monkeypatch, steps: int) -> None:
    """The drafter is first asked after ``steps`` plain steps: sampled copies part before their first catch-up."""
    who_drafts = SpeculationPolicy.who_drafts
    monkeypatch.setattr(SpeculationPolicy, "who_drafts",
                        lambda self, live: [] if live[0].steps < steps else who_drafts(self, live))


def rows(make, prompt: list[int]) -> int:
    """A prompt's catch-up rows: EAGLE's, a (feature, next token) pair per position but the last; a draft model's,
    every token."""
    return len(prompt) - (make is eagle)


@DRAFTERS
def test_copies_catch_up_once(model, draft, make, catch_up_rows):
    kw = dict(max_new_tokens=2, do_sample=True, seed=0, **ALWAYS)
    specdec.generate(model, [A], drafter=make(model, draft), num_return_sequences=8, **kw)
    assert catch_up_rows[0] == rows(make, A)  # was 8 x: every copy caught up on the prompt again
    catch_up_rows.clear()
    specdec.generate(model, [A, B], drafter=make(model, draft), num_return_sequences=3, **kw)
    assert catch_up_rows[0] == rows(make, A) + rows(make, B)


@DRAFTERS
def test_copies_that_parted_before_their_first_draft_share_the_prompt_only(model, draft, make, catch_up_rows,
                                                                           monkeypatch):
    skip_first_steps(monkeypatch, 3)
    out = specdec.generate(model, [A], drafter=make(model, draft), num_return_sequences=4, max_new_tokens=6,
                           do_sample=True, seed=0, **ALWAYS)
    assert len({tuple(row) for row in out}) > 1  # the copies parted
    # the first catches up on the prompt and its 3 tokens, each copy on its own 3 over the first's prompt keys
    assert catch_up_rows[:2] == [rows(make, A) + 3, 3 * 3]


@DRAFTERS
@pytest.mark.parametrize("skip", [0, 3], ids=["first-step", "after-plain-steps"])
def test_greedy_copies_give_plain_decoding(model, draft, make, skip, monkeypatch):
    skip_first_steps(monkeypatch, skip)
    plain = specdec.generate(model, [A, A, B, A], max_new_tokens=12)
    out = specdec.generate(model, [A, A, B, A], drafter=make(model, draft), max_new_tokens=12, return_dict=True,
                           **ALWAYS)
    assert out.sequences == plain
    assert sum(s.steps for s in out.stats) < sum(s.new_tokens for s in out.stats)  # drafts were accepted


@DRAFTERS
@pytest.mark.parametrize("skip", [0, 3], ids=["first-step", "after-plain-steps"])
def test_seeded_copies_draw_what_their_own_catch_up_drew(model, draft, make, skip, monkeypatch):
    """The same seed gives the same texts as each copy's own catch-up (drafters/prompt_copies.py switched off):
    standard sampling (sampled drafts for the draft model) and coupled sampling."""
    skip_first_steps(monkeypatch, skip)
    kw = dict(max_new_tokens=8, num_return_sequences=4, do_sample=True, **ALWAYS)

    def texts():
        return [specdec.generate(model, [A, B], drafter=make(model, draft), seed=5, **kw),
                specdec.generate(model, [A], drafter=make(model, draft), seed=6, sampler="coupled", **kw)]

    shared = texts()
    monkeypatch.setattr(eagle_module, "prompt_copies", lambda views, fresh: {})
    monkeypatch.setattr("specdec.drafters.model_drafter.prompt_copies", lambda views, fresh: {})
    assert shared == texts()


@DRAFTERS
@pytest.mark.parametrize("skip", [0, 3], ids=["first-step", "after-plain-steps"])
def test_copies_hold_the_first_keys_in_storage_of_their_own(model, draft, make, skip, monkeypatch):
    skip_first_steps(monkeypatch, skip)
    runner = LlamaRunner(model)
    s = runner.shape
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 64, 4, runner.dtype, runner.device,
                         runner.backend)
    drafter = make(model, draft)
    engine = Engine(runner, cache, sampling=SamplingConfig(do_sample=True), stop=StopCriteria(16), drafter=drafter,
                    generator=torch.Generator().manual_seed(0), draft_seed=0)
    first, _, *copies = engine.add([A, B, A, A, A])
    for _ in range(skip + 1):  # plain steps, where the copies part, then the first draft
        engine.step()
    if make is eagle:
        n = rows(make, A)
        keys = [(drafter.kv.k[drafter.kv.row[q.seq_id], :, :n], drafter.kv.v[drafter.kv.row[q.seq_id], :, :n])
                for q in (first, *copies)]
        assert len({drafter.kv.row[q.seq_id] for q in (first, *copies)}) == 4  # a row each
    else:
        n, own = rows(make, A), drafter.cache
        keys = [own.kv[:, :, own.slots(q.seq_id, 0, n)] for q in (first, *copies)]
        tables = [set(own.block_tables[q.seq_id]) for q in (first, *copies)]
        assert sum(map(len, tables)) == len(set().union(*tables))  # no block is shared
    for held in keys[1:]:
        assert all(torch.equal(a, b) for a, b in zip(held, keys[0], strict=True))
    if skip:
        assert len({tuple(q.token_ids) for q in (first, *copies)}) > 1  # they had parted


def test_a_draft_models_catch_up_runs_its_lm_head_on_each_root_only(model, draft, monkeypatch):
    """Only a root's logits are read after a catch-up: the LM head runs on one row per sequence caught up, not on every
    prompt token (a fifth of a small model's work per row)."""
    heads: list[int] = []
    logits = LlamaRunner.logits

    def counting(self, hidden):
        if self.hf_model is draft:
            heads.append(hidden.shape[0])
        return logits(self, hidden)

    monkeypatch.setattr(LlamaRunner, "logits", counting)
    out = specdec.generate(model, [A, B, A], drafter=draft_model(model, draft), max_new_tokens=6, return_dict=True,
                           **ALWAYS)
    assert out.sequences == specdec.generate(model, [A, B, A], max_new_tokens=6)
    assert heads[0] == 2  # A (its copy shares it) and B; was len(A) + len(B) rows


def test_a_copy_shares_its_firsts_prompt_and_number_of_tokens_and_is_fresh():
    """Which sequences copy which: the same prompt (tokens and num_prompt_tokens) and the same number of tokens as an
    earlier fresh sequence; the earliest of them is the first of its group."""
    prompt = [7, 8, 9]
    views = [
        SequenceView(10, prompt + [1], 3),
        SequenceView(11, prompt + [2], 3),  # a copy of 0: same prompt, same length, its own token after it
        SequenceView(12, prompt + [1, 2], 3),  # one token longer: not a copy
        SequenceView(13, prompt + [1], 4),  # the same tokens, but a 4-token prompt: not a copy
        SequenceView(14, prompt + [3], 3),  # another copy of 0, but not fresh (indexed before): skipped
        SequenceView(15, prompt + [5, 6], 3),  # a copy of 2
    ]
    copies = prompt_copies(views, lambda v: v.seq_id != 14)
    assert copies == {1: 0, 5: 2}
    assert leaders(copies) == {0: [1], 2: [5]}
