"""Logits processors (specdec.logits_processing) and log-probabilities (specdec.logprobs) on tiny models.

Greedy decoding with each processor (repetition penalty, no_repeat_ngram_size, bad_words_ids, min_new_tokens, a
caller's prefix-only processors) gives transformers' ``model.generate()`` tokens, plain and with drafters (n-gram,
the target as its own draft model, random trees), batched and single; so do transformers' other processors
(sequence_bias, min_length, forced BOS / EOS, remove_invalid_values, exponential decay, suppress_tokens,
begin_suppress_tokens) in a left-padded batch, where the length-dependent ones count as transformers counts (and
min_length / forced_bos_token_id depend on the batch's width, as there); coupled sampling with a penalty gives the
same text with and without a drafter; the sampled law of the first tokens with a penalty is plain sampling's (and a
variant processing every node with the root's prefix fails); each node's rows get exactly their own prefix;
log-probabilities equal transformers' processed scores and do not depend on the drafter."""
from __future__ import annotations

import logging
import sys

import pytest
import torch
import transformers
from specdec.eval.negative_controls import generate_with_control
from specdec.eval.two_sample import two_sample_chi2
from transformers import (
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import specdec
from specdec.engine import Engine
from specdec.engine_setup import EngineFault, build_engine
from specdec.errors import InputError, InputTypeError
from specdec.generate import prepare
from specdec.generation_config import GenerationConfig
from specdec.logits_processing import LogitsProcessing, node_suffixes
from specdec.rejection import EXACT
from specdec.testing import RandomTreeDrafter, build_tiny_model
from specdec.tree import DraftTree

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 8], [10, 20, 30, 10, 20, 30, 10, 20], [5, 5, 5, 5]]
NEW = 24


class PenaliseLastToken:
    """A caller's prefix-only processor: the row's last token loses 4 logits."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.scatter_add(1, input_ids[:, -1:], torch.full_like(scores[:, :1], -4.0))


@pytest.fixture(scope="module")
def model():
    return build_tiny_model()


def hf_greedy(model, prompt, max_new_tokens=NEW, **kwargs) -> list[int]:
    """transformers' model.generate() on one prompt alone."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         **kwargs)
    return out[0].tolist()


def hf_kwargs(kwargs: dict) -> dict:
    """specdec's arguments in transformers' words: the caller's processors as a LogitsProcessorList."""
    out = {k: v for k, v in kwargs.items() if k != "logits_processor_prefix_only"}
    if "logits_processor" in out:
        out["logits_processor"] = LogitsProcessorList(out["logits_processor"])
    return out


def _bad_words(model) -> list[list[int]]:
    """Words the unconstrained greedy output contains: the first new token of prompt 0, and a bigram of prompt 2's."""
    base0, base2 = hf_greedy(model, PROMPTS[0]), hf_greedy(model, PROMPTS[2])
    new0, new2 = base0[len(PROMPTS[0]):], base2[len(PROMPTS[2]):]
    return [[new0[0]], new2[3:5]]


CASES = {
    "repetition_penalty": lambda m: dict(repetition_penalty=1.3),
    "repetition_reward": lambda m: dict(repetition_penalty=0.7),
    "no_repeat_ngram_size": lambda m: dict(no_repeat_ngram_size=2),
    "bad_words_ids": lambda m: dict(bad_words_ids=_bad_words(m)),
    "caller_processors": lambda m: dict(logits_processor=[PenaliseLastToken(), NoRepeatNGramLogitsProcessor(3)],
                                        logits_processor_prefix_only=True),
    # a caller's processor of a built-in's class takes its place, as in transformers 5
    "caller_replaces_builtin": lambda m: dict(repetition_penalty=1.3, logits_processor=[
        RepetitionPenaltyLogitsProcessor(2.0)], logits_processor_prefix_only=True),
    "all_together": lambda m: dict(repetition_penalty=1.2, no_repeat_ngram_size=3, bad_words_ids=_bad_words(m),
                                   logits_processor=[PenaliseLastToken()], logits_processor_prefix_only=True),
}


def drafters(model):
    """(name, drafter, options) of every drafter the identity checks run: drafts are really accepted."""
    vocab = model.config.vocab_size
    return [
        ("ngram", "ngram", {"min_ngram": 1}),
        ("target-as-draft", "draft-model", {"model": model, "num_draft_tokens": 4}),
        # seed 3: its trees get drafts accepted under every case (a random tree's acceptance is chance; seed 1's
        # got none under caller_processors, a token of the sequence being what the processors penalise)
        ("random-deterministic", RandomTreeDrafter(vocab, max_nodes=12, seed=3), None),
        ("random-independent", RandomTreeDrafter(vocab, max_nodes=12, mode="independent", seed=2,
                                                 history_bias=0.5), None),
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_processor_equals_transformers_plain_and_speculative(model, case):
    kwargs = CASES[case](model)
    ref = [hf_greedy(model, p, **hf_kwargs(kwargs)) for p in PROMPTS]
    assert ref != specdec.generate(model, PROMPTS, max_new_tokens=NEW), "the processor must change the output"
    assert specdec.generate(model, PROMPTS, max_new_tokens=NEW, **kwargs) == ref
    assert specdec.generate(model, [PROMPTS[1]], max_new_tokens=NEW, **kwargs) == [ref[1]]
    taus = {}
    for i, (name, drafter, options) in enumerate(drafters(model)):
        out = specdec.generate(model, PROMPTS, max_new_tokens=NEW, drafter=drafter, drafter_options=options,
                               speculation="always", return_dict=True, **kwargs)
        assert out.sequences == ref, name
        taus[name] = out.tau
        if i % 2 == list(CASES).index(case) % 2:  # one sequence alone: half the drafters per case, in turn
            single = specdec.generate(model, [PROMPTS[i]], max_new_tokens=NEW, drafter=drafter,
                                      drafter_options=options, speculation="always", **kwargs)
            assert single == [ref[i]], name
    # drafts were accepted, so node rows' processed logits chose tokens; the draft model processes its own logits
    # as the target does, so the target as its own draft model has every draft accepted (n-gram finds nothing to
    # propose when no_repeat_ngram_size forbids the repeats it looks for)
    assert taus["target-as-draft"] > 4.0, taus
    assert all(t > 1.0 for n, t in taus.items() if (n, case) != ("ngram", "no_repeat_ngram_size")), taus


def test_min_new_tokens_equals_transformers(model):
    base = hf_greedy(model, PROMPTS[0])
    new = base[len(PROMPTS[0]):]
    k = next(i for i in range(2, len(new)) if new[i] not in new[:i])  # greedy's first new token at k >= 2
    eos = new[k]
    stopped = specdec.generate(model, [PROMPTS[0]], max_new_tokens=NEW, eos_token_id=eos, return_dict=True)
    assert len(stopped.new_tokens[0]) == k + 1 and stopped.stats[0].finish_reason == "eos"
    for n in (k + 1, k + 4):
        ref = [hf_greedy(model, p, eos_token_id=eos, min_new_tokens=n) for p in PROMPTS]
        assert len(ref[0]) - len(PROMPTS[0]) > k + 1  # the EOS at new token k was suppressed
        assert specdec.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos, min_new_tokens=n) == ref, n
        for name, drafter, options in drafters(model):
            got = specdec.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos, min_new_tokens=n,
                                   drafter=drafter, drafter_options=options, speculation="always")
            assert got == ref, (n, name)
    # min_new_tokens=k lets the EOS at new token k through
    assert specdec.generate(model, [PROMPTS[0]], max_new_tokens=NEW, eos_token_id=eos, min_new_tokens=k,
                            drafter="ngram") == [base[: len(PROMPTS[0]) + k + 1]]


def test_left_padded_batch_with_repetition_penalty_equals_transformers(model):
    """transformers skips left padding for the penalty (prompt_ignore_length); specdec drops it."""
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, repetition_penalty=1.3)
    got = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, repetition_penalty=1.3,
                           drafter="ngram", speculation="always")
    assert torch.equal(got, ref)


def test_processors_from_the_models_generation_config(model):
    import copy

    configured = copy.deepcopy(model)
    configured.generation_config.repetition_penalty = 1.3
    configured.generation_config.no_repeat_ngram_size = 2
    ref = [hf_greedy(configured, p) for p in PROMPTS]
    assert specdec.generate(configured, PROMPTS, max_new_tokens=NEW, drafter="ngram", speculation="always") == ref
    assert specdec.generate(configured, PROMPTS, max_new_tokens=NEW, repetition_penalty=1.0,
                            no_repeat_ngram_size=0) == [hf_greedy(model, p) for p in PROMPTS]  # kwargs win


# ---- transformers' other processors, in a left-padded batch ---------------------------------------------------
WIDTH = max(len(p) for p in PROMPTS)  # input_ids.shape[-1] of the left-padded batch


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    return (torch.tensor([[0] * (width - len(p)) + p for p in prompts]),
            torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]))


def hf_batch(model, prompts, max_new_tokens=NEW, **kwargs) -> torch.Tensor:
    """transformers' model.generate() on the left-padded batch of ``prompts``."""
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


def _greedy_new(model) -> list[list[int]]:
    """The unprocessed greedy new tokens of each prompt of the left-padded batch."""
    return hf_batch(model, PROMPTS)[:, WIDTH:].tolist()


def _first_and_last(model) -> tuple[list[int], list[int]]:
    new = _greedy_new(model)
    return [r[0] for r in new], [r[-1] for r in new]


# Tokens the unprocessed greedy output contains (each row's first and last new token), so each processor changes it.
# The length-dependent ones act after a number of new tokens that transformers counts from input_ids.shape[-1]
MORE = {
    # rows 0-2 would end at once; EOS is masked until WIDTH + 3 tokens: 3 new ones, also for the 2-token row
    "min_length": lambda f, last: dict(eos_token_id=f[:3], min_length=WIDTH + 3),
    "begin_suppress_tokens": lambda f, last: dict(begin_suppress_tokens=f),
    "forced_eos_token_id": lambda f, last: dict(forced_eos_token_id=[7, 9], eos_token_id=last[0]),
    "exponential_decay_length_penalty": lambda f, last: dict(exponential_decay_length_penalty=(5, 1.5),
                                                             eos_token_id=[last[0], last[1], last[3]]),
    "sequence_bias": lambda f, last: dict(sequence_bias={(f[0],): -10.0, (f[1], f[1]): -10.0,
                                                         (f[2], f[2], f[2]): -20.0}),
    "suppress_tokens": lambda f, last: dict(suppress_tokens=[f[0], f[2], last[0]]),
    # remove_invalid_values turns the -inf of the others into finite values, before the decay penalty reads them
    "all_together": lambda f, last: dict(suppress_tokens=f[:1], remove_invalid_values=True, sequence_bias=[
        [[f[1], f[1]], -10.0]], begin_suppress_tokens=f[3:], forced_eos_token_id=7, min_length=WIDTH + 4,
        eos_token_id=[last[0], last[1]], exponential_decay_length_penalty=(8, 1.3), repetition_penalty=1.2),
}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("case", list(MORE))
def test_more_processors_equal_transformers_in_a_left_padded_batch_plain_and_speculative(model, case):
    kwargs = MORE[case](*_first_and_last(model))
    ids, mask = left_padded(PROMPTS)
    ref = hf_batch(model, PROMPTS, **kwargs)
    assert not _equal(ref, hf_batch(model, PROMPTS)), "the processor must change the output"
    assert _equal(specdec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs), ref)
    for name, drafter, options in [*drafters(model), ("self-draft", "self-draft", {"num_layers": 1})]:
        out = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, drafter=drafter,
                               drafter_options=options, speculation="always", return_dict=True, **kwargs)
        assert _equal(out.sequences, ref), name
        assert out.tau > 1.0, (name, out.tau)  # drafts were accepted, so node rows' processed logits chose tokens


def test_a_repeated_sequence_bias_key_takes_its_later_bias_as_transformers(model):
    """[[[t], 50.0], [[t], -inf]]: the later -inf wins, so t (the first greedy token) is banned, not forced."""
    prompt = PROMPTS[1]
    t = hf_greedy(model, prompt, max_new_tokens=1)[-1]
    bias = [[[t], 50.0], [[t], float("-inf")]]
    ref = hf_greedy(model, prompt, max_new_tokens=4, sequence_bias=bias)
    assert t not in ref[len(prompt):]
    assert specdec.generate(model, [prompt], max_new_tokens=4, sequence_bias=bias)[0] == ref


def test_min_length_counts_the_padded_width_as_transformers_and_max_length_do(model):
    """Documented: min_length counts the prompt as input_ids.shape[-1], so in a left-padded batch the 2-token row
    must generate WIDTH + 3 - WIDTH = 3 new tokens, where alone it must generate WIDTH + 1: its text depends on the
    batch, in transformers and in specdec (every other processor gives each row what it gives alone)."""
    eos = list(range(2, model.config.vocab_size, 2))  # half the vocabulary: a row ends soon after its minimum
    kwargs = dict(eos_token_id=eos, min_length=WIDTH + 3)
    ref = hf_batch(model, PROMPTS, **kwargs)
    ids, mask = left_padded(PROMPTS)
    assert _equal(specdec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs), ref)
    batch = specdec.generate(model, PROMPTS, max_new_tokens=NEW, drafter="ngram", **kwargs)  # lists: the longest
    new_batch = batch[1][2:]  # row is the width, as for max_length
    assert new_batch == ref[1, WIDTH:WIDTH + len(new_batch)].tolist()
    alone = specdec.generate(model, [PROMPTS[1]], max_new_tokens=NEW, drafter="ngram", **kwargs)[0]
    assert alone == hf_greedy(model, PROMPTS[1], **kwargs)
    new_alone = alone[2:]
    assert new_batch[-1] in eos and 3 < len(new_batch) < WIDTH + 1 <= len(new_alone), (new_batch, new_alone)
    # min_new_tokens, where a layer sets it, replaces min_length (transformers: min_length = min_new_tokens + width)
    assert specdec.generate(model, PROMPTS, max_new_tokens=NEW, min_new_tokens=0, **kwargs) == \
        specdec.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos)
    assert _equal(hf_batch(model, PROMPTS, min_new_tokens=0, **kwargs), hf_batch(model, PROMPTS, eos_token_id=eos))


def test_forced_bos_token_id_acts_where_the_input_is_one_token_wide_as_transformers(model):
    """transformers forces it where input_ids.shape[-1] is 1 (an encoder-decoder's decoder start): on a batch of
    one-token prompts, the first new token, and begin_suppress_tokens then acts on the second; never in a wider
    batch, not even on its one-token rows."""
    ones = [[7], [5]]
    forced = hf_batch(model, ones, forced_bos_token_id=9)
    # suppressing what each row gives after the forced BOS: acting on the first new token instead changed nothing
    second = sorted(set(forced[:, 2].tolist()))
    kwargs = dict(forced_bos_token_id=9, begin_suppress_tokens=second)
    ref = hf_batch(model, ones, **kwargs)
    assert ref[:, 1].tolist() == [9, 9] and not set(ref[:, 2].tolist()) & set(second)
    ids, mask = left_padded(ones)
    for drafter, options in ((None, None), ("draft-model", {"model": model, "num_draft_tokens": 4})):
        assert _equal(specdec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, drafter=drafter,
                                       drafter_options=options, **kwargs), ref), drafter
    wide = [[7], [5, 5, 5]]
    ref = hf_batch(model, wide, forced_bos_token_id=9)
    assert ref[0, 3] != 9 and _equal(ref, hf_batch(model, wide))  # not forced
    ids, mask = left_padded(wide)
    assert _equal(specdec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, forced_bos_token_id=9,
                                   drafter="ngram"), ref)


def test_more_processors_from_transformers_configs_and_the_models_generation_config(model):
    import copy

    first, last = _first_and_last(model)
    configured = copy.deepcopy(model)
    configured.generation_config.suppress_tokens = [first[0]]
    configured.generation_config.forced_eos_token_id = 7
    configured.generation_config.eos_token_id = [last[0], first[1]]
    configured.generation_config.min_length = WIDTH + 4
    passed = transformers.GenerationConfig(sequence_bias=[[[first[2]], -10.0]], begin_suppress_tokens=[first[3]],
                                           exponential_decay_length_penalty=[6, 1.4], remove_invalid_values=True)
    ids, mask = left_padded(PROMPTS)
    for kwargs in ({}, dict(min_new_tokens=1), dict(suppress_tokens=None, forced_eos_token_id=None)):
        ref = hf_batch(configured, PROMPTS, generation_config=passed, **kwargs)
        got = specdec.generate(configured, ids, attention_mask=mask, max_new_tokens=NEW, generation_config=passed,
                               drafter="ngram", speculation="always", **kwargs)
        assert _equal(got, ref), kwargs
    assert not _equal(got, hf_batch(configured, PROMPTS, generation_config=passed))  # the kwargs' None cleared them


def test_coupled_sampling_with_more_processors_is_the_same_text_with_any_drafter(model):
    kwargs = dict(MORE["all_together"](*_first_and_last(model)), do_sample=True, seed=3, sampler="coupled",
                  temperature=0.7)
    ids, mask = left_padded(PROMPTS)
    plain = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    unprocessed = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, seed=3,
                                   sampler="coupled", temperature=0.7)
    assert not _equal(plain, unprocessed)
    for name, drafter, options in drafters(model):
        out = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, drafter=drafter,
                               drafter_options=options, speculation="always", **kwargs)
        assert _equal(out, plain), name


# ---- each node's own prefix ---------------------------------------------------------------------------------
class Recorder:
    """Prefix-only: adds to each row a number that identifies its input_ids, and records every call."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.calls.append(input_ids.clone())
        weights = torch.arange(1, input_ids.shape[1] + 1, dtype=torch.float64)
        return scores + (input_ids.double() * weights).sum(1, keepdim=True).float() / 1000


def _signature(ids: list[int]) -> float:
    return sum((i + 1) * t for i, t in enumerate(ids)) / 1000


def test_every_row_gets_its_own_prefix_in_equal_length_calls():
    trees = [DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 2, 1]), DraftTree.empty(), DraftTree.chain([4, 4, 4])]
    seqs = [([1, 2, 3], 2), ([9, 8, 7, 6], 4), ([1, 2], 1)]
    recorder = Recorder()
    processing = LogitsProcessing((recorder,))
    logits = torch.randn(3, 6, 11)
    out = processing.apply(seqs, trees, logits)
    expected = {}
    for b, ((ids, _), tree) in enumerate(zip(seqs, trees, strict=True)):
        for row, suffix in enumerate(node_suffixes(tree)):
            expected[(b, row)] = ids + suffix
    assert node_suffixes(trees[0]) == [[], [5], [6], [5, 7], [5, 7, 8], [6, 9]]  # ancestors, then the node
    # every call holds rows of one length (no padding), and every row's prefix is processed exactly once
    rows_seen = sorted(tuple(r) for call in recorder.calls for r in call.tolist())
    assert rows_seen == sorted(tuple(p) for p in expected.values())
    assert len({len(p) for p in expected.values()}) == len(recorder.calls)  # one call per length, across sequences
    for (b, row), prefix in expected.items():
        assert torch.allclose(out[b, row], logits[b, row] + _signature(prefix), atol=1e-4), (b, row)
    assert torch.equal(out[1, 1:], logits[1, 1:])  # padding rows past a tree's nodes are left alone
    # with min_new_tokens, rows are grouped by prompt length too: MinNewTokens counts from input_ids.shape[-1]
    eos_processing = LogitsProcessing((processing.processors[0], *_min_new(3, eos=10).processors))
    recorder.calls.clear()
    out = eos_processing.apply(seqs, trees, logits)
    for (b, row), prefix in expected.items():
        suppressed = len(prefix) - seqs[b][1] < 3
        assert (out[b, row, 10] == float("-inf")) == suppressed, (b, row)
    assert all(len({len(r) for r in call.tolist()}) == 1 for call in recorder.calls)


def _min_new(n: int, eos: int) -> LogitsProcessing:
    return LogitsProcessing.from_config(GenerationConfig(min_new_tokens=n), [eos], 11)


class RootPrefixEngine(Engine):
    """Deliberately WRONG: processes every tree row with the root's prefix instead of its own."""

    def process(self, live, trees, target_logits):
        if self.processing is None:
            return target_logits
        out = target_logits.float().clone()
        for b, s in enumerate(live):
            ids = torch.tensor([s.token_ids] * out.shape[1], device=out.device)
            out[b] = self.processing.process_rows(ids, out[b], s.num_prompt_tokens)
        return out


ROOT_PREFIX = EngineFault("processors_with_the_roots_prefix", engine_cls=RootPrefixEngine)


class PositionTable:
    """Prefix-only: a bias on token 5 read from a table as long as the longest row plain decoding processes
    (the prompt, then max_new_tokens - 1 new tokens); a longer row is an IndexError."""

    def __init__(self, length: int) -> None:
        self.table = torch.linspace(-2.0, 2.0, length)

    def __call__(self, input_ids, scores):
        return scores + torch.nn.functional.one_hot(torch.tensor(5), scores.shape[-1]) * self.table[input_ids.shape[-1]]


@pytest.mark.parametrize("case", ["table", "decay"])
def test_no_row_past_the_token_budget_is_processed(model, case):
    """A model drafter drafts num_draft_tokens deep also near the end, and the engine cuts the nodes past the
    budget; the processors ran on those rows too, so a processor that fails past the budget failed with a drafter
    where plain decoding and transformers run: a position table (IndexError), a decay penalty whose factor ** n
    overflows a float just past it (1e30 ** 11; OverflowError, found by fuzzing against transformers)."""
    prompts = [PROMPTS[0], PROMPTS[0][::-1]]  # unpadded: the table reads the row's length, as transformers' does
    ids, mask = left_padded(prompts)
    n = 11
    if case == "table":
        kwargs = dict(logits_processor=[PositionTable(ids.shape[-1] + n)], logits_processor_prefix_only=True)
    else:  # the EOS is suppressed, so the penalty adds nothing, but transformers still computes 1e30 ** (new - 0)
        kwargs = dict(exponential_decay_length_penalty=(0, 1e30), eos_token_id=3, suppress_tokens=[3])
    ref = hf_batch(model, prompts, max_new_tokens=n, **hf_kwargs(kwargs))
    assert case == "decay" or not _equal(ref, hf_batch(model, prompts, max_new_tokens=n)), "the table must matter"
    for drafter, options in (("draft-model", {"model": model, "num_draft_tokens": 4}),
                             ("self-draft", {"num_layers": 1, "num_draft_tokens": 4})):
        out = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=n, drafter=drafter,
                               drafter_options=options, speculation="always", **kwargs)
        assert _equal(out, ref), drafter


def test_processing_every_node_with_the_roots_prefix_breaks_greedy_identity(model):
    ref = [hf_greedy(model, p, repetition_penalty=1.3) for p in PROMPTS]
    broken = generate_with_control(model, PROMPTS, EXACT, ROOT_PREFIX, max_new_tokens=NEW, drafter="draft-model",
                                   drafter_options={"model": model, "num_draft_tokens": 4}, repetition_penalty=1.3)
    assert broken != ref


# ---- sampling ----------------------------------------------------------------------------------------------
COUPLED = dict(do_sample=True, seed=11, sampler="coupled", temperature=0.5, repetition_penalty=2.0)


def test_coupled_sampling_with_processors_is_the_same_text_with_any_drafter(model):
    plain = specdec.generate(model, PROMPTS, max_new_tokens=NEW, **COUPLED)
    unprocessed = dict(COUPLED, repetition_penalty=1.0)
    assert plain != specdec.generate(model, PROMPTS, max_new_tokens=NEW, **unprocessed)
    for name, drafter, options in drafters(model):
        out = specdec.generate(model, PROMPTS, max_new_tokens=NEW, drafter=drafter, drafter_options=options,
                               speculation="always", return_dict=True, **COUPLED)
        assert out.sequences == plain, name
        # the draft model ranks its candidates by the same noise over its own processed logits: all accepted
        assert out.tau > 4.0 or name != "target-as-draft", out.tau
    for p, ref in zip(PROMPTS, plain, strict=True):
        assert specdec.generate(model, [p], max_new_tokens=NEW, drafter="ngram", **COUPLED) == [ref]


@pytest.mark.parametrize("drafter,mode", [("self-draft", "auto"), ("self-draft", "without_replacement"),
                                          ("draft-model", "auto")])
def test_a_sampled_draft_path_the_processors_leave_no_token_ends_there(drafter, mode):
    """14 distinct prompt ids of 16, no_repeat_ngram_size=1: two tokens remain, so a draft node below depth 2 has no
    token left to draw from. Such a node gets no children, while the other sequence's tree grows on (the call raised
    DraftError on the node's NaN draft_probs, or stacked an empty frontier, where plain decoding finishes)."""
    tiny = build_tiny_model(vocab_size=16, num_hidden_layers=2)
    options = {"num_draft_tokens": 4, "mode": mode}
    options |= {"num_layers": 1} if drafter == "self-draft" else {"model": tiny}
    for seed in range(2):
        kw = dict(max_new_tokens=2, no_repeat_ngram_size=1, do_sample=True, seed=seed, return_dict=True)
        out = specdec.generate(tiny, [list(range(1, 15)), [1]], drafter=drafter, drafter_options=options,
                               speculation="always", **kw)
        assert sorted(out.new_tokens[0]) == [0, 15], out.new_tokens  # each remaining token once, as plain's
        assert len(set(out.new_tokens[1]) | {1}) == 3, out.new_tokens
        assert out.stats[0].step_nodes[0] == 1, out.stats[0].step_nodes  # its tree, cut to the 2 tokens: drafted


@pytest.mark.parametrize("eos", [0, 15])
def test_a_row_with_no_token_left_after_a_drafted_eos_is_no_error(eos):
    """14 distinct prompt ids of 16, no_repeat_ngram_size=1, the EOS one of the two ids left: plain decoding ends at
    the EOS, but a model drafter drafts past it, where the row after both ids has no token left. The walk then
    chose no token there, which raised InvalidLogitsError although commit drops everything after the EOS (found
    by fuzzing against transformers); now only a row the committed tokens reach is an error."""
    tiny = build_tiny_model(vocab_size=16, num_hidden_layers=2)
    prompt, kw = list(range(1, 15)), dict(max_new_tokens=4, no_repeat_ngram_size=1, eos_token_id=eos)
    want = hf_greedy(tiny, prompt, **kw)
    for drafter, options in (("draft-model", {"model": tiny, "num_draft_tokens": 4}),
                             ("self-draft", {"num_layers": 1, "num_draft_tokens": 4})):
        assert specdec.generate(tiny, [prompt], drafter=drafter, drafter_options=options, speculation="always",
                                **kw) == [want], drafter
        coupled = dict(kw, do_sample=True, seed=0, sampler="coupled")
        assert specdec.generate(tiny, [prompt], drafter=drafter, drafter_options=options, speculation="always",
                                **coupled) == specdec.generate(tiny, [prompt], **coupled), drafter


class InfinityAfter:
    """A caller's prefix-only processor: the row after ``token`` gets +inf at one id (no law to sample from), and
    ``token`` gains 6 logits everywhere else, so it is drawn often."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        after = (input_ids[:, -1] == self.token)[:, None]
        boosted = scores.index_add(1, torch.tensor([self.token]), torch.full_like(scores[:, :1], 6.0))
        return torch.where(after, boosted.index_fill(1, torch.tensor([0]), float("inf")), boosted)


@pytest.mark.parametrize("drafter", ["draft-model", "self-draft"])
def test_a_sampled_draft_row_the_processors_make_infinite_after_a_drafted_eos_gets_no_children(drafter):
    """Plain decoding ends at the EOS, so it never samples the row after it; a model drafter drafts past the EOS,
    where the processors left +inf. That row's draft_probs were NaN and the call raised DraftError (found by fuzzing:
    an overflowing decay penalty); now the processors' lawless row gets no children, as a row they mask whole."""
    tiny = build_tiny_model(vocab_size=16, num_hidden_layers=2)
    options = {"num_draft_tokens": 4} | ({"num_layers": 1} if drafter == "self-draft" else {"model": tiny})
    kw = dict(max_new_tokens=6, eos_token_id=5, logits_processor=[InfinityAfter(5)],
              logits_processor_prefix_only=True, do_sample=True, return_dict=True)
    prompts = [[1, 2, 3], [4, 6, 7, 8]]
    for seed in range(3):
        out = specdec.generate(tiny, prompts, drafter=drafter, drafter_options=options, speculation="always",
                               seed=seed, **kw)
        assert all(toks[-1] == 5 or len(toks) == 6 for toks in out.new_tokens), out.new_tokens
        assert 5 in [t for toks in out.new_tokens for t in toks], out.new_tokens  # the EOS was drawn


N = 6000  # per side: the test asserts its power to detect TV 0.08
LAW_PROMPT = [2, 2, 2, 2]  # vocab 4: tokens 0, 1, 3 are new, so the penalty of a node depends on its ancestors
LAW = dict(max_new_tokens=3, do_sample=True, repetition_penalty=10.0, return_dict=True, speculation="always")


def _first_tokens(law_model, drafter, seed, fault=None):
    out = generate_with_control(law_model, [LAW_PROMPT] * N, EXACT, fault, drafter=drafter, seed=seed, **LAW)
    return [tuple(t) for t in out.new_tokens], out


@pytest.mark.slow
def test_sampling_law_with_repetition_penalty_matches_plain_and_the_root_prefix_variant_fails():
    law_model = build_tiny_model(vocab_size=4, seed=3)
    plain, _ = _first_tokens(law_model, None, seed=1)
    spec, out = _first_tokens(law_model, RandomTreeDrafter(4, max_nodes=10, mode="independent", seed=5), seed=2)
    assert out.tau > 1.3  # drafts were accepted, so node rows chose tokens
    p, power = two_sample_chi2(plain, spec, tv=0.08)
    assert power >= 0.9, f"only {power:.2f} power to detect TV 0.08"
    assert p > 1e-3, p
    broken, _ = _first_tokens(law_model, RandomTreeDrafter(4, max_nodes=10, mode="independent", seed=5), seed=2,
                              fault=ROOT_PREFIX)
    assert two_sample_chi2(plain, broken).p_value < 1e-6


# ---- log-probabilities -------------------------------------------------------------------------------------
def test_greedy_logprobs_equal_transformers_processed_scores_with_and_without_drafter(model):
    kwargs = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    plain = specdec.generate(model, PROMPTS, max_new_tokens=NEW, output_logprobs=True, return_dict=True, **kwargs)
    assert [len(lp) for lp in plain.logprobs] == [len(t) for t in plain.new_tokens]
    for p, new, lp in zip(PROMPTS, plain.new_tokens, plain.logprobs, strict=True):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, **kwargs)
        assert ref.sequences[0, len(p):].tolist() == new
        want = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(ref.scores, new, strict=True)]
        assert torch.allclose(torch.tensor(lp), torch.tensor(want), atol=1e-5)
    for name, drafter, options in drafters(model):
        out = specdec.generate(model, PROMPTS, max_new_tokens=NEW, drafter=drafter, drafter_options=options,
                               speculation="always", output_logprobs=True, return_dict=True, **kwargs)
        assert out.new_tokens == plain.new_tokens and out.tau > 1.0, name
        for a, b in zip(out.logprobs, plain.logprobs, strict=True):
            assert torch.allclose(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                                  atol=1e-5), name
    # an EOS inside an accepted run cuts the run: only the committed tokens have log-probabilities
    eos = plain.new_tokens[0][5]
    cut = specdec.generate(model, [PROMPTS[0]], max_new_tokens=NEW, eos_token_id=eos, drafter="draft-model",
                           drafter_options={"model": model, "num_draft_tokens": 4}, speculation="always",
                           output_logprobs=True, return_dict=True, **kwargs)
    n = len(cut.new_tokens[0])
    assert cut.new_tokens[0] == plain.new_tokens[0][:n] and cut.stats[0].finish_reason == "eos"
    assert len(cut.logprobs[0]) == n and any(length > 1 for length in cut.stats[0].step_lengths)
    assert torch.allclose(torch.tensor(cut.logprobs[0]), torch.tensor(plain.logprobs[0][:n]), atol=1e-5)
    # transformers' names map onto them; not asked: None, and nothing is computed
    mapped = specdec.generate(model, PROMPTS, max_new_tokens=NEW, output_scores=True, return_dict_in_generate=True,
                              **kwargs)
    assert mapped.logprobs == plain.logprobs
    assert specdec.generate(model, PROMPTS, max_new_tokens=4, return_dict=True).logprobs is None


def test_greedy_logprobs_ignore_the_sampling_options_greedy_decoding_ignores(model, caplog):
    """A greedy call that carries temperature / top-k (many hub models' generation configs do) is told they are
    ignored; its log-probabilities must ignore them too, as transformers' scores do."""
    with caplog.at_level(logging.WARNING, logger="specdec.generate"):
        out = specdec.generate(model, PROMPTS[:1], max_new_tokens=NEW, do_sample=False, temperature=0.5, top_k=3,
                               output_logprobs=True, return_dict=True)
    assert "these sampling options are ignored" in caplog.text
    plain = specdec.generate(model, PROMPTS[:1], max_new_tokens=NEW, output_logprobs=True, return_dict=True)
    assert out.new_tokens == plain.new_tokens
    assert torch.allclose(torch.tensor(out.logprobs[0]), torch.tensor(plain.logprobs[0]), atol=1e-6)


def test_sampled_logprobs_are_after_the_processors_and_the_sampling_transform(model):
    sample = dict(do_sample=True, seed=11, sampler="coupled", repetition_penalty=1.3, no_repeat_ngram_size=3,
                  temperature=0.7, top_k=20)
    plain = specdec.generate(model, PROMPTS, max_new_tokens=NEW, output_logprobs=True, return_dict=True, **sample)
    spec = specdec.generate(model, PROMPTS, max_new_tokens=NEW, drafter="ngram", speculation="always",
                            output_logprobs=True, return_dict=True, **sample)
    assert spec.new_tokens == plain.new_tokens
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), NoRepeatNGramLogitsProcessor(3),
                                      TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)])
    for p, new, lp, lp_spec in zip(PROMPTS, plain.new_tokens, plain.logprobs, spec.logprobs, strict=True):
        seq = torch.tensor([p + new])
        with torch.no_grad():
            logits = model(seq).logits[0].float()
        want = []
        for t, tok in enumerate(new):
            length = len(p) + t
            scores = processors(seq[:, :length], logits[length - 1 : length])
            want.append(torch.log_softmax(scores[0], -1)[tok].item())
        assert torch.allclose(torch.tensor(lp), torch.tensor(want), atol=1e-5)
        assert torch.allclose(torch.tensor(lp_spec), torch.tensor(lp), atol=1e-5)
        assert all(v <= 0 for v in lp) and min(lp) > float("-inf")


# ---- the cost when off, and refusals -----------------------------------------------------------------------
def test_nothing_is_processed_or_kept_when_not_asked(model):
    engine = build_engine(prepare(model, PROMPTS, max_new_tokens=4, repetition_penalty=1.0, no_repeat_ngram_size=0,
                                  return_dict=True))
    assert engine.processing is None and not engine.output_logprobs
    engine = build_engine(prepare(model, PROMPTS, max_new_tokens=4, output_scores=True))  # no return_dict: a no-op
    assert not engine.output_logprobs


def test_output_scores_without_return_dict_warns_it_is_ignored(model, caplog):
    """It returned the sequences alone without a word, where transformers warns that the scores are ignored."""
    with caplog.at_level(logging.WARNING, logger="specdec"):
        specdec.generate(model, PROMPTS, max_new_tokens=2, output_scores=True)
    assert "output_scores=True is ignored without return_dict=True" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec"):
        specdec.generate(model, PROMPTS, max_new_tokens=2, output_scores=True, return_dict_in_generate=True)
    assert "output_scores" not in caplog.text


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(logits_processor=[PenaliseLastToken()]), InputError, "logits_processor_prefix_only=True"),
    (dict(logits_processor=[3], logits_processor_prefix_only=True), InputTypeError, r"logits_processor\[0\]"),
    (dict(bad_words_ids=[[5], [400]]), InputError, r"bad_words_ids has token ids outside the vocabulary"),
    (dict(bad_words_ids="no"), InputTypeError, "bad_words_ids must be"),
    (dict(bad_words_ids=[[]]), InputTypeError, r"bad_words_ids\[0\]"),
    (dict(repetition_penalty=0.0), InputError, "repetition_penalty must be > 0"),
    (dict(no_repeat_ngram_size=-1), InputError, "no_repeat_ngram_size must be >= 0"),
    (dict(min_new_tokens=1.5), InputTypeError, "min_new_tokens must be an int"),
    (dict(output_logprobs=True), InputError, "output_logprobs=True needs return_dict=True"),
    (dict(logits_processor=lambda ids, s: s[:, :3], logits_processor_prefix_only=True), InputTypeError,
     r"logits processor 0 \(function\) returned"),
    (dict(min_length=-1), InputError, "min_length must be >= 0"),
    (dict(min_length=2.5), InputTypeError, "min_length must be an int"),
    (dict(suppress_tokens=5), InputTypeError, "suppress_tokens must be a list of token ids"),
    (dict(suppress_tokens=[5, -1]), InputTypeError, r"suppress_tokens must hold token ids \(ints >= 0\)"),
    (dict(suppress_tokens=[5, 96]), InputError, r"suppress_tokens has token ids outside the vocabulary \[0, 96\)"),
    (dict(begin_suppress_tokens="ab"), InputTypeError, "begin_suppress_tokens must be a list"),
    (dict(begin_suppress_tokens=[1.0]), InputTypeError, "begin_suppress_tokens must hold token ids"),
    (dict(sequence_bias=5), InputTypeError, "sequence_bias must be a dict"),
    (dict(sequence_bias={(): 1.0}), InputTypeError, "sequence_bias keys must be non-empty"),
    (dict(sequence_bias={(3, -2): 1.0}), InputTypeError, "sequence_bias keys"),
    (dict(sequence_bias={(3,): "x"}), InputTypeError, r"sequence_bias values must be finite numbers.*for \[3\]"),
    (dict(sequence_bias=[[[3], float("nan")]]), InputTypeError, r"or -inf \(which bans\), got float nan"),
    (dict(sequence_bias=[[[3, 400], 1.0]]), InputError, "sequence_bias has token ids outside the vocabulary"),
    (dict(forced_bos_token_id=-1), InputError, "forced_bos_token_id must be >= 0"),
    (dict(forced_bos_token_id=96), InputError, "forced_bos_token_id has token ids outside"),
    (dict(forced_eos_token_id="2"), InputTypeError, "forced_eos_token_id must be a token id or a list"),
    (dict(forced_eos_token_id=[2, -1]), InputTypeError, "forced_eos_token_id must hold token ids"),
    (dict(forced_eos_token_id=[2, 200]), InputError, "forced_eos_token_id has token ids outside"),
    (dict(forced_eos_token_id=[2, 3], suppress_tokens=[3, 2]), InputError,
     r"every token of forced_eos_token_id \(\[2, 3\]\) is also in suppress_tokens"),
    (dict(remove_invalid_values="yes"), InputTypeError, "remove_invalid_values must be True or False"),
    (dict(exponential_decay_length_penalty=2), InputTypeError, r"exponential_decay_length_penalty must be a pair"),
    (dict(exponential_decay_length_penalty=(-1, 1.5), eos_token_id=2), InputError, "start_index must be >= 0"),
    (dict(exponential_decay_length_penalty=(1, float("inf")), eos_token_id=2), InputError,
     "decay_factor must be finite"),
    (dict(exponential_decay_length_penalty=(1, 1.5)), InputError, "exponential_decay_length_penalty raises the EOS"),
    (dict(encoder_repetition_penalty=1.5), InputError, "encoder_repetition_penalty=1.5: an encoder-decoder processor"),
])
def test_bad_processor_arguments_are_one_line_errors(model, kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        specdec.generate(model, PROMPTS[:2], max_new_tokens=4, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("make", [lambda: transformers.SequenceBiasLogitsProcessor([[[5], 9.0], [[3, 4], -5.0]]),
                                  lambda: transformers.NoBadWordsLogitsProcessor([[5], [3, 4]])])
def test_a_callers_sequence_bias_processor_reused_with_another_vocabulary(make):
    """transformers' SequenceBiasLogitsProcessor (NoBadWords is one) prepares its bias for the vocabulary and device of
    the first logits it sees and keeps it: reused in a call with a model of another vocabulary size it failed with a
    raw shape error. It now prepares again for that call, and decodes as a new processor does."""
    reused = make()
    for vocab in (96, 64):
        model = build_tiny_model(vocab_size=vocab, seed=vocab)
        outs = [specdec.generate(model, PROMPTS[:2], max_new_tokens=6, logits_processor=[processor],
                                 logits_processor_prefix_only=True) for processor in (reused, make())]
        assert outs[0] == outs[1]


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_processors_run_without_gradients_as_in_transformers(drafter):
    """transformers' generate() calls its processors under no_grad; specdec called them in the caller's grad mode
    (on, in a plain script), so a processor holding a parameter built an autograd graph at every call."""
    from specdec.testing import build_tiny_model

    seen = []

    def processor(input_ids, scores):
        seen.append(torch.is_grad_enabled())
        return scores

    assert torch.is_grad_enabled()
    specdec.generate(build_tiny_model(), [[1, 2, 3, 1, 2, 3]], max_new_tokens=6, drafter=drafter,
                     logits_processor=[processor], logits_processor_prefix_only=True)
    assert seen and not any(seen)


def test_a_processor_failing_reaches_the_caller_as_itself(model):
    """A caller's processor holding per-batch-row state (a tensor of one value per row, as transformers builds
    internally) fails on the verify's groups of other sizes; a processor may also raise on purpose (a budget) or
    run out of memory. The caller gets the processor's own exception, as from transformers' generate(), with a note
    (Python 3.11+) naming the processor, the rows and why grouped rows break per-batch-row state."""

    class PerBatchRow:
        def __init__(self, rows: int) -> None:
            self.rows = rows

        def __call__(self, input_ids, scores):
            if input_ids.shape[0] != self.rows:
                raise ValueError("Incompatible batch size\nsecond line")
            return scores

    with pytest.raises(ValueError, match="Incompatible batch size\nsecond line") as err:
        specdec.generate(model, [PROMPTS[0]], max_new_tokens=4, logits_processor=[PerBatchRow(2)],
                         logits_processor_prefix_only=True)
    assert not isinstance(err.value, InputError)
    if sys.version_info >= (3, 11):
        (note,) = err.value.__notes__
        assert note.startswith("specdec: logits processor 0 (PerBatchRow) failed on 1 rows of 11 token ids")
        assert note.endswith("not prefix-only")

    class BudgetExceeded(Exception):
        pass

    def budget(input_ids, scores):
        if input_ids.shape[-1] >= len(PROMPTS[0]) + 2:
            raise BudgetExceeded("token budget used up")
        return scores

    for drafter in (None, "ngram"):
        with pytest.raises(BudgetExceeded, match="^token budget used up($|\n)"):
            specdec.generate(model, [PROMPTS[0]], max_new_tokens=6, drafter=drafter, logits_processor=[budget],
                             logits_processor_prefix_only=True)


def test_a_callers_processor_on_prompts_of_other_lengths_is_warned_once(model, caplog):
    """transformers gives a caller's processors the padded rows, specdec each row as if decoded alone: a processor
    counting from the padded width acts later on shorter rows, which is said once a process."""
    from specdec.engine_setup import _warn_unpadded_rows

    _warn_unpadded_rows.cache_clear()
    kwargs = dict(max_new_tokens=2, logits_processor=[PenaliseLastToken()], logits_processor_prefix_only=True)
    with caplog.at_level("WARNING", logger="specdec.engine_setup"):
        specdec.generate(model, [PROMPTS[1], [9, 9]], **kwargs)  # equal lengths: nothing to say
        assert "without its left padding" not in caplog.text
        for _ in range(2):
            specdec.generate(model, PROMPTS[:2], **kwargs)
    assert caplog.text.count("without its left padding") == 1


def test_a_bad_word_that_is_an_eos_id_is_not_banned_as_transformers(model):
    """transformers' NoBadWordsLogitsProcessor drops a one-token bad word equal to an EOS id (the EOS stays
    allowed): with the first greedy token t as both EOS and bad word, the call stops at t after one new token."""
    t = hf_greedy(model, PROMPTS[0])[len(PROMPTS[0])]
    want = hf_greedy(model, PROMPTS[0], max_new_tokens=6, eos_token_id=t, bad_words_ids=[[t]])
    assert want == PROMPTS[0] + [t]  # t is the argmax, not banned, and ends the call at once
    assert specdec.generate(model, [PROMPTS[0]], max_new_tokens=6, eos_token_id=t, bad_words_ids=[[t]]) == [want]


def test_a_callers_subclass_of_a_builtin_processor_runs_beside_it_as_transformers():
    """transformers replaces a built-in processor only by a caller's of exactly its class (``type(c) is``): a
    subclass of RepetitionPenaltyLogitsProcessor runs after the built-in one and does not take its place."""

    class NoPenalty(RepetitionPenaltyLogitsProcessor):
        pass

    config = GenerationConfig(repetition_penalty=1.5, logits_processor=[NoPenalty(1.0)],
                              logits_processor_prefix_only=True)
    processing = LogitsProcessing.from_config(config, eos_token_ids=[], vocab_size=4)
    scores = processing.process_rows(torch.tensor([[2]]), torch.tensor([[0.0, 0.0, 3.0, 0.0]]), prompt_length=1)
    # token 2 is in the prefix: the built-in penalty gives 3.0 / 1.5 = 2.0, then NoPenalty divides by 1.0
    assert scores.tolist() == [[0.0, 0.0, 2.0, 0.0]]
