"""Identical prompts of one Engine.add are prefilled once (Engine.add, PagedKVCache.copy_prefix): one forward over
each distinct prompt, the copies get its K/V and hidden rows bit for bit, and every copy decodes as its prompt alone
would."""
from __future__ import annotations

import pytest
import torch
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads

import specdec
from specdec.engine import Engine
from specdec.kv_cache import PagedKVCache
from specdec.models.llama import LlamaRunner
from specdec.sampling import SamplingConfig
from specdec.stopping import StopCriteria
from specdec.testing import build_tiny_model

A = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6]
B = [10, 20, 30, 10, 20, 30, 10, 20, 40, 50]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model()


@pytest.fixture
def prefill_rows(monkeypatch):
    """The rows of every prefill forward (the one without logits) the target runs."""
    rows = []
    forward = LlamaRunner.forward

    def counting(self, token_ids, *args, with_logits=True, **kwargs):
        if not with_logits:
            rows.append(token_ids.numel())
        return forward(self, token_ids, *args, with_logits=with_logits, **kwargs)

    monkeypatch.setattr(LlamaRunner, "forward", counting)
    return rows


def medusa(model):
    """Heads whose LM heads copy the target's (as test_medusa_drafter's): they guess right often enough."""
    heads = MedusaHeads(MedusaConfig(3, 1, model.config.hidden_size, model.config.vocab_size))
    heads.init_lm_heads_from(model.get_output_embeddings().weight.detach())
    return MedusaDrafter(heads=heads)


def eagle(model):
    torch.manual_seed(0)
    head = EagleModel(EagleConfig.for_target(model.config, depth=3, top_k=2, max_nodes=6))
    head.init_from_target(model)
    return EagleDrafter(model=head)


def test_the_prefill_runs_each_distinct_prompt_once(model, prefill_rows):
    specdec.generate(model, [A] * 4, max_new_tokens=2)
    assert prefill_rows == [len(A) - 1]  # was 4 x: every copy ran again
    prefill_rows.clear()
    specdec.generate(model, [A, B, A, A], max_new_tokens=2)
    assert prefill_rows == [len(A) - 1 + len(B) - 1]
    prefill_rows.clear()
    specdec.generate(model, [A], max_new_tokens=2, do_sample=True, seed=0, num_return_sequences=8)
    assert prefill_rows == [len(A) - 1]


@pytest.mark.parametrize("drafter", [None, "ngram", medusa, eagle], ids=["plain", "ngram", "medusa", "eagle"])
def test_greedy_copies_give_what_their_prompt_gives_alone(model, drafter):
    def make():
        return drafter(model) if callable(drafter) else drafter

    # speculation="always": every tree verified, so the copies' hidden rows and K/V reach the drafter and the verify
    kw = dict(max_new_tokens=24, speculation="always") if drafter else dict(max_new_tokens=24)
    alone = {tuple(p): specdec.generate(model, [p], drafter=make(), **kw)[0] for p in (A, B)}
    batch = specdec.generate(model, [A, A, B, A], drafter=make(), return_dict=True, **kw)
    assert batch.sequences == [alone[tuple(p)] for p in (A, A, B, A)]
    if drafter is not None:
        assert sum(s.steps for s in batch.stats) < sum(s.new_tokens for s in batch.stats)  # drafts were accepted


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "bit-exact"])
def test_copies_hold_the_kv_and_hidden_rows_of_their_first(model, invariant):
    runner = LlamaRunner(model).invariant_mode(invariant)
    s = runner.shape

    def prefilled(prompts):
        cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 32, 4, runner.dtype, runner.device,
                             runner.backend)
        engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(4), drafter=medusa(model))
        seqs = engine.add(prompts)
        return [(cache.kv[:, :, cache.slots(q.seq_id, 0, len(q.token_ids) - 1)], q.hidden_chunks[0]) for q in seqs]

    seqs = prefilled([A, A, B, A])
    for copy in (1, 3):
        assert torch.equal(seqs[copy][0], seqs[0][0]) and torch.equal(seqs[copy][1], seqs[0][1])
    assert seqs[1][1] is not seqs[0][1]  # each sequence owns its rows, as before
    if invariant:  # a row's result is independent of the forward's other rows: the copies hold A's prefill alone
        (kv, hidden), = prefilled([A])
        assert torch.equal(seqs[3][0], kv) and torch.equal(seqs[3][1], hidden)


def test_sampled_copies_are_continuations_of_their_prompt(model):
    """Each of num_return_sequences=4 rows samples (top_k=3) only among the target's 3 most likely tokens given
    its own prefix: a copy whose K/V were not its prompt's would leave them."""
    out = specdec.generate(model, [A, B], max_new_tokens=16, do_sample=True, top_k=3, seed=5, num_return_sequences=4)
    assert len(out) == 8
    with torch.no_grad():
        for row, prompt in zip(out, [A] * 4 + [B] * 4, strict=True):
            assert row[:len(prompt)] == prompt and len(row) == len(prompt) + 16
            top = model(torch.tensor([row])).logits[0, len(prompt) - 1:-1].topk(3).indices
            assert all(t in allowed for t, allowed in zip(row[len(prompt):], top.tolist(), strict=True))


def test_coupled_copies_draw_their_own_noise(model):
    """Coupled sampling keys each copy by its occurrence (specdec.coupling.sequence_keys): the copies share the
    prefill and still sample their own texts, the first as its prompt alone, speculation as plain."""
    kw = dict(max_new_tokens=16, do_sample=True, sampler="coupled", seed=3)
    plain = specdec.generate(model, [A], num_return_sequences=4, **kw)
    assert len({tuple(r) for r in plain}) == 4
    assert plain[0] == specdec.generate(model, [A], **kw)[0]
    assert specdec.generate(model, [A], num_return_sequences=4, drafter="ngram", speculation="always", **kw) == plain


def test_prefill_groups_key_on_every_prompt_token_but_the_last():
    """[1, 2, 3] and [1, 2, 4] run the same prefill ([1, 2]) and form one group; [1, 5, 3] differs before its last
    token (its own prefill [1, 5]), a group alone; the groups come in order of first occurrence."""
    from specdec.engine import SequenceState, prefill_groups

    seqs = [SequenceState(i, p, len(p)) for i, p in enumerate([[1, 2, 3], [1, 5, 3], [1, 2, 4]])]
    assert [[s.seq_id for s in g] for g in prefill_groups(seqs)] == [[0, 2], [1]]
