"""generate(): plain decoding is exactly transformers' decoding, batched or not; inputs, stops, seeds and errors."""
from __future__ import annotations

import contextlib
import copy
import importlib
import io

import pytest
import torch
from scipy import stats

import specdec
from specdec.errors import InputError
from specdec.kv_cache import CacheFullError
from specdec.models.llama import UnsupportedModelError
from specdec.testing import TINY_VARIANTS, build_tiny_model, build_tiny_tokenizer, ragged_prompts


def hf_greedy(model, prompt, n):
    x = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0].tolist()


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [10, 20, 30, 40, 50, 60, 70, 80, 90, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                                           21, 22], [5, 5]]


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "llama-mha-untied", "qwen3-qknorm", "llama3-rope", "qwen2-bias"])
def test_greedy_matches_transformers_single_and_batched(variant, device):
    model = build_tiny_model(variant).to(device)
    refs = [hf_greedy(model, p, 40) for p in PROMPTS]
    batched = specdec.generate(model, PROMPTS, max_new_tokens=40)
    assert batched == refs
    for p, ref in zip(PROMPTS, refs, strict=True):
        assert specdec.generate(model, [p], max_new_tokens=40, block_size=3)[0] == ref


TIE = 1e-5  # float32 logits of two tokens this close: which one wins depends on the summation order


def same_greedy_or_tie(model, got: list[int], ref: list[int]) -> bool:
    """True if identical; False if they part where transformers' own logits have a float32 tie between the two
    tokens (a batched matmul may legitimately break it the other way); fails on any real divergence."""
    if got == ref:
        return True
    assert len(got) == len(ref)
    d = next(i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([ref[:d]])).logits[0, -1]
    gap = float((logits[ref[d]] - logits[got[d]]).abs())
    assert gap < TIE, f"diverges at position {d}: token {got[d]} instead of {ref[d]}, logit gap {gap:.3g}"
    return False


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_greedy_matches_transformers_24_prompts_x_128_tokens(variant):
    model = build_tiny_model(variant)
    prompts = ragged_prompts(24, seed=2)
    refs = [hf_greedy(model, p, 128) for p in prompts]
    batched = specdec.generate(model, prompts, max_new_tokens=128)
    single = [specdec.generate(model, [p], max_new_tokens=128, block_size=5)[0] for p in prompts]
    ties = [not same_greedy_or_tie(model, got, ref) for got, ref in zip(batched + single, refs + refs, strict=True)]
    assert sum(ties) <= 2, f"{sum(ties)} of {len(ties)} sequences part at a float32 tie: too many to be chance"


def test_batch_of_8_ragged_prompts_equals_one_by_one(device):
    model = build_tiny_model("llama-mha-untied").to(device)
    prompts = ragged_prompts(8, seed=3)
    assert len({len(p) for p in prompts}) >= 6  # ragged lengths
    singles = [specdec.generate(model, [p], max_new_tokens=48)[0] for p in prompts]
    assert specdec.generate(model, prompts, max_new_tokens=48, block_size=5) == singles
    # and when the sequences finish at different steps: an EOS id that only some of them emit
    news = [s[len(p):] for s, p in zip(singles, prompts, strict=True)]
    eos = next(t for t in range(model.config.vocab_size) if 2 <= sum(t in n[:40] for n in news) <= 6)
    singles = [specdec.generate(model, [p], max_new_tokens=48, eos_token_id=eos)[0] for p in prompts]
    out = specdec.generate(model, prompts, max_new_tokens=48, eos_token_id=eos, block_size=5, return_dict=True)
    assert out.sequences == singles
    assert {s.finish_reason for s in out.stats} == {"eos", "length"}


def test_tensor_input_with_left_padding():
    model = build_tiny_model()
    ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=6)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 11)
    # laid out as transformers lays it out: the padded rows as given, then the new tokens
    with torch.no_grad():
        assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    assert out[0, 5:].tolist() == hf_greedy(model, [3, 4, 5], 6)[3:]
    assert out[1].tolist() == hf_greedy(model, [6, 7, 8, 9, 10], 6)


def test_eos_and_stop_sequences_end_generation():
    model = build_tiny_model()
    free = specdec.generate(model, [PROMPTS[0]], max_new_tokens=30)[0][len(PROMPTS[0]):]
    eos = free[5]
    first = free.index(eos)
    out = specdec.generate(model, [PROMPTS[0]], max_new_tokens=30, eos_token_id=eos, return_dict=True)
    assert out.new_tokens[0] == free[: first + 1] and out.stats[0].finish_reason == "eos"
    assert out["sequences"] is out.sequences and out["new_tokens"] is out.new_tokens  # as transformers' outputs
    with pytest.raises(KeyError, match="no field 'scores'; its fields: sequences, new_tokens"):
        out["scores"]
    # transformers' fields that specdec has not say what to read instead, one line, as attributes too
    with pytest.raises(AttributeError, match=r"no 'scores' \(transformers' field\): pass output_logprobs=True"):
        _ = out.scores
    with pytest.raises(AttributeError, match="object has no attribute 'nope'"):
        _ = out.nope
    assert not hasattr(out, "__deepcopy__") and copy.deepcopy(out).new_tokens == out.new_tokens
    # read as transformers' outputs are read by name: its fields that hold something, never an index
    assert "sequences" in out and "scores" not in out and "logprobs" not in out and 0 not in out
    assert list(out)[:2] == ["sequences", "new_tokens"] and dict(out)["stats"] is out.stats
    stop_seq = free[7:9]
    out = specdec.generate(model, [PROMPTS[0]], max_new_tokens=30, stop=[stop_seq], return_dict=True)
    end = next(i for i in range(1, 30) if free[i - 1 : i + 1] == stop_seq) + 1
    assert out.new_tokens[0] == free[:end] and out.stats[0].finish_reason == "stop"


def _first_match(tok, tokens, stop):
    """Number of tokens up to and including the one that completes the first occurrence of `stop`."""
    return next(k for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k]))


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_stop_strings_with_a_real_tokenizer(drafter):
    tok = build_tiny_tokenizer()  # one token per character: a stop string spans several tokens
    model = build_tiny_model("qwen3-qknorm", vocab_size=len(tok), seed=1)  # one that does not repeat one character
    prompts = [tok(t)["input_ids"] for t in ("the cat sat on the mat", "0123 4567 0123 4567 01")]
    free = specdec.generate(model, prompts, max_new_tokens=48, tokenizer=tok, return_dict=True).new_tokens
    texts = [tok.decode(t) for t in free]
    stops = [texts[0][20:23], texts[1][25:27]]
    expected = [free[i][: min(_first_match(tok, free[i], s) for s in stops if s in texts[i])] for i in range(2)]
    assert all(5 <= len(e) < 48 for e in expected), expected
    out = specdec.generate(model, prompts, max_new_tokens=48, tokenizer=tok, stop=stops, drafter=drafter,
                           return_dict=True)
    assert out.new_tokens == expected
    assert [s.finish_reason for s in out.stats] == ["stop", "stop"]
    assert any(s in tok.decode(out.new_tokens[0]) for s in stops)  # the stop string itself is kept


def test_a_tokenizer_passed_with_a_loaded_model_serves_the_call():
    """generate(load_model(model), tokenizer=tok, stop=[...]) stops by tok, as with the model itself (the tokenizer
    was dropped: "stop strings need a tokenizer"); the loaded model is left as it was."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(vocab_size=len(tok))
    loaded = specdec.load_model(model)
    free = tok.decode(specdec.generate(model, [[5, 6, 7]], max_new_tokens=12)[0][3:])
    kw = dict(max_new_tokens=12, stop=[free[4:6]], tokenizer=tok, return_dict=True)
    out = specdec.generate(loaded, [[5, 6, 7]], **kw)
    assert out.new_tokens == specdec.generate(model, [[5, 6, 7]], **kw).new_tokens
    assert out.stats[0].finish_reason == "stop" and loaded.tokenizer is None


def test_generator_argument_drives_sampling(device):
    model = build_tiny_model().to(device)
    kwargs = dict(max_new_tokens=10, do_sample=True, top_k=20)
    by_seed = specdec.generate(model, PROMPTS, seed=7, **kwargs)
    gen = torch.Generator(device=device).manual_seed(7)
    first = specdec.generate(model, PROMPTS, generator=gen, **kwargs)
    second = specdec.generate(model, PROMPTS, generator=gen, **kwargs)
    assert first == by_seed  # a generator seeded like `seed` gives the same draws
    assert second != first  # the caller's generator is consumed, not re-seeded
    again = specdec.generate(model, PROMPTS, generator=torch.Generator(device=device).manual_seed(7), **kwargs)
    assert again == first
    # speculative sampling draws from the same generator: reproducible too
    spec = [specdec.generate(model, PROMPTS, generator=torch.Generator(device=device).manual_seed(3),
                             drafter="ngram", **kwargs) for _ in range(2)]
    assert spec[0] == spec[1]


def test_generator_on_another_device_than_the_model_is_a_clear_error():
    model = build_tiny_model().to("meta")  # any device other than the generator's, also without a GPU
    with pytest.raises(ValueError, match="generator is on cpu but the model is on meta"):
        specdec.generate(model, PROMPTS, max_new_tokens=2, do_sample=True, generator=torch.Generator())


def test_streamer_sees_every_token_in_order():
    model = build_tiny_model()
    seen: dict[int, list[int]] = {0: [], 1: []}
    out = specdec.generate(model, PROMPTS[:2], max_new_tokens=12, streamer=lambda i, t: seen[i].extend(t),
                           return_dict=True)
    assert seen[0] == out.new_tokens[0] and seen[1] == out.new_tokens[1]
    assert out.stats[0].steps == 12 and out.stats[0].tau == 1.0


def test_progress_redraws_its_bar_at_tqdms_pace_not_once_per_step(monkeypatch):
    """progress=True: the tau shown by the bar forced a redraw at every step, past tqdm's mininterval, so a stderr
    piped to a file or a CI log took one line (a carriage return) per step. The bar now redraws at tqdm's pace: with
    a mininterval no run reaches, only its first and last lines are written."""
    generate_module = importlib.import_module("specdec.generate")  # the attribute specdec.generate is the function
    sink = io.StringIO()
    bar = generate_module.tqdm

    def slow_bar(*args, **kwargs):
        return bar(*args, **kwargs, file=sink, mininterval=1e9, miniters=1)

    monkeypatch.setattr(generate_module, "tqdm", slow_bar)
    specdec.generate(build_tiny_model(), PROMPTS[:1], max_new_tokens=30, progress=True)
    assert "30/30" in sink.getvalue() and sink.getvalue().count("\r") <= 2, sink.getvalue()


def test_sampling_first_token_follows_target_distribution(device):
    model = build_tiny_model(vocab_size=16).to(device)
    prompt = [1, 2, 3]
    n = 4000
    out = specdec.generate(model, [prompt] * n, max_new_tokens=1, do_sample=True, temperature=1.3, seed=0)
    counts = torch.bincount(torch.tensor([o[-1] for o in out]), minlength=16).double()
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device=device)).logits[0, -1].double().cpu()
    probs = torch.softmax(logits / 1.3, -1)
    _, p = stats.chisquare(counts.numpy(), (probs * n).numpy())
    assert p > 1e-3, p
    # a wrong temperature must be detected by the same test (the test can fail)
    wrong = torch.softmax(logits, -1)
    _, p_wrong = stats.chisquare(counts.numpy(), (wrong * n).numpy())
    assert p_wrong < 1e-6


def test_seed_makes_sampling_reproducible(device):
    model = build_tiny_model().to(device)
    a = specdec.generate(model, PROMPTS, max_new_tokens=10, do_sample=True, top_k=5, top_p=0.9, seed=7)
    b = specdec.generate(model, PROMPTS, max_new_tokens=10, do_sample=True, top_k=5, top_p=0.9, seed=7)
    c = specdec.generate(model, PROMPTS, max_new_tokens=10, do_sample=True, top_k=5, top_p=0.9, seed=8)
    assert a == b and a != c


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=[[]]), "empty"),
        (dict(input_ids=[[1, 2, 500]]), "outside the vocabulary"),
        (dict(input_ids=[[1] * 500], max_new_tokens=100), "context"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(top_p=-0.1), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(drafter="no-such-drafter"), "unknown drafter"),
        (dict(stop=["ab"]), "stop strings need a tokenizer"),
        (dict(do_sample=True, seed=1, generator=torch.Generator().manual_seed(1)), "not both"),
        (dict(drafter_options={"num_draft_tokens": 3}), "without a drafter"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
    model = build_tiny_model()
    kwargs = {"input_ids": [[1, 2, 3]], **kwargs}
    with pytest.raises(ValueError, match=match):
        specdec.generate(model, kwargs.pop("input_ids"), **kwargs)


def test_eos_token_id_in_every_form_transformers_takes():
    """int, list, 0-D / 1-D integer tensors (also inside a list) and numpy ints all stop generation; a set of
    0-D tensors used to be silently ignored. Floats, bools, strings and ids outside the vocabulary are refused."""
    import numpy as np

    model = build_tiny_model()
    plain = specdec.generate(model, [PROMPTS[0]], max_new_tokens=24)[0][len(PROMPTS[0]):]
    eos = plain[5]
    want = plain[: plain.index(eos) + 1]
    for form in (eos, [eos, 95], torch.tensor(eos), torch.tensor([eos]), [torch.tensor(eos)], np.int64(eos)):
        out = specdec.generate(model, [PROMPTS[0]], max_new_tokens=24, eos_token_id=form, return_dict=True)
        assert out.new_tokens[0] == want and out.stats[0].finish_reason == "eos", form
    for bad, error in ((1.0, TypeError), (True, TypeError), ("x", TypeError), (torch.tensor([[eos]]), TypeError),
                       (torch.tensor(1.0), TypeError), (96, ValueError), ([eos, -1], ValueError)):
        with pytest.raises(error, match="eos_token_id"):
            specdec.generate(model, [PROMPTS[0]], max_new_tokens=2, eos_token_id=bad)


def test_unknown_model_and_architecture():
    with pytest.raises(FileNotFoundError, match="unknown model"):
        specdec.generate("/no/such/model", [[1]])
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="supported"):
        specdec.generate(gpt2, [[1]])


def test_activation_and_rope_names_as_transformers_reads_them():
    """hidden_act 'swish' is transformers' other name of SiLU (it was refused); a RoPE type specdec does not run is
    refused by name, said to change with the length only where it does."""
    model = build_tiny_model(hidden_act="swish")
    ids = torch.tensor([PROMPTS[0]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                          pad_token_id=0)[0].tolist()
    assert specdec.generate(model, [PROMPTS[0]], max_new_tokens=6)[0] == want
    for kind, why in (("longrope", "changes with the sequence length"), ("su", "not supported; supported")):
        model.config.rope_parameters = {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0}
        with pytest.raises(UnsupportedModelError, match=f"RoPE type {kind!r} is not supported.*") as err:
            specdec.generate(model, [PROMPTS[0]], max_new_tokens=2)
        assert why in str(err.value) and (kind == "longrope") == ("sequence length" in str(err.value))


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "qwen3-qknorm", "mistral"])
@pytest.mark.parametrize("rope", [
    {"rope_type": "proportional", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
], ids=["proportional", "dynamic"])
def test_proportional_and_dynamic_rope_run_as_transformers(variant, rope):
    """Proportional RoPE (rotating part of each head, the rest at frequency 0) has fixed frequencies, and dynamic NTK
    RoPE keeps the ones it was built with until a sequence passes max_position_embeddings, which specdec never does:
    both were refused. Greedy tokens up to the context equal transformers', plainly and speculating; a request past
    the context is refused in one line naming max_new_tokens (and, for dynamic, why)."""
    context = 40
    model = build_tiny_model(variant, rope_parameters=rope, max_position_embeddings=context)
    for prompt in PROMPTS[:2]:
        want = hf_greedy(model, prompt, context - len(prompt))
        assert specdec.generate(model, [prompt], max_new_tokens=context - len(prompt))[0] == want
        assert specdec.generate(model, [prompt], max_new_tokens=context - len(prompt), drafter="ngram",
                                speculation="always")[0] == want
    dynamic = rope["rope_type"] == "dynamic"
    with pytest.raises(InputError, match=rf"^prompt \(8 tokens\) \+ max_new_tokens \(33\) exceeds the model's "
                                         rf"context of {context} tokens"
                                         + (": past it transformers rescales the model's dynamic RoPE" if dynamic
                                            else "; shorten")):
        specdec.generate(model, [PROMPTS[0]], max_new_tokens=context - 7)
    if dynamic:  # a forward past the context grew transformers' frequencies: refused until it restores them
        with torch.no_grad():
            model(torch.tensor([[1] * (context + 4)]))
        with pytest.raises(UnsupportedModelError, match=rf"^the model's dynamic RoPE was rescaled by an earlier "
                                                        rf"forward of {context + 4} tokens, past its context of "
                                                        rf"{context}"):
            specdec.generate(model, [PROMPTS[0]], max_new_tokens=2)
        with torch.no_grad():
            model(torch.tensor([[1] * 4]))
        assert specdec.generate(model, [PROMPTS[0]], max_new_tokens=6)[0] == hf_greedy(model, PROMPTS[0], 6)


def test_a_rope_type_transformers_cannot_build_and_partial_rotary_are_one_line(tmp_path):
    """A checkpoint naming a RoPE type transformers does not know ('su', an old name; a typo) failed in transformers'
    rotary init with a bare KeyError; one rotating part of each head (partial_rotary_factor with linear RoPE)
    loaded, then crashed in the first forward with a shape error. Both are refused in one line at load."""
    import json

    model = build_tiny_model()
    model.save_pretrained(tmp_path / "su")
    config = json.loads((tmp_path / "su" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "su", "rope_theta": 10000.0}
    (tmp_path / "su" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"^RoPE type 'su' \(config.json rope_parameters\) is not "
                                                    "supported; supported: default, linear, llama3, yarn, "
                                                    "proportional, and dynamic within the context$"):
        specdec.generate(str(tmp_path / "su"), [PROMPTS[0]], max_new_tokens=2)
    # beside a typed rope_parameters, a rope_scaling is what transformers builds (it replaces rope_parameters)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config["rope_scaling"] = {"rope_type": "su", "factor": 2.0}
    (tmp_path / "su" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"^RoPE type 'su' \(config.json rope_scaling\) is not supported"):
        specdec.generate(str(tmp_path / "su"), [PROMPTS[0]], max_new_tokens=2)
    partial = build_tiny_model(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5})
    head_dim = partial.config.hidden_size // partial.config.num_attention_heads
    with pytest.raises(UnsupportedModelError, match=rf"^partial rotary embeddings \(RoPE on {head_dim // 2} of the "
                                                    rf"{head_dim} dimensions of each head"):
        specdec.generate(partial, [PROMPTS[0]], max_new_tokens=2)


def test_cache_out_of_blocks_is_clear():
    model = build_tiny_model()
    with pytest.raises(CacheFullError, match="num_blocks"):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=40, block_size=4, num_blocks=2)


def test_checkpoint_directory_roundtrip(tmp_path):
    model = build_tiny_model("llama-mha-untied")
    model.save_pretrained(tmp_path)
    ref = specdec.generate(model, [PROMPTS[0]], max_new_tokens=8)
    assert specdec.generate(str(tmp_path), [PROMPTS[0]], max_new_tokens=8) == ref


def test_a_model_on_another_gpu_generates_with_that_gpu_current(monkeypatch):
    """Triton launches kernels, and torch makes streams, events and graph captures, on the current CUDA device: a
    model on cuda:1 would get cuda:0's. generate() makes the model's device current while it runs (on the CPU,
    nothing)."""
    import importlib

    gen = importlib.import_module("specdec.generate")  # the module (specdec.generate is also the function)
    entered = []
    monkeypatch.setattr(gen, "on_device", lambda device: entered.append(device) or contextlib.nullcontext())
    model = build_tiny_model()
    gen.generate(model, [[1, 2, 3]], max_new_tokens=2)
    assert entered == [torch.device("cpu")]
    monkeypatch.undo()
    on_cuda = gen.on_device(torch.device("cuda", 1))  # built without touching CUDA
    assert isinstance(on_cuda, torch.cuda.device) and on_cuda.idx == 1
    assert isinstance(gen.on_device(torch.device("cpu")), contextlib.nullcontext)


def test_a_ragged_calls_stats_add_up():
    """tau of a call is its tokens over its steps (not a mean of per-row tau), each row's tokens per second are its
    tokens over its own seconds, and a row that stopped on an EOS reports its own time, not the call's."""
    model = build_tiny_model(vocab_size=32)
    rep, other = [1, 2, 3, 4] * 6, [5, 9, 7]
    out = specdec.generate(model, [rep, other], drafter="ngram", speculation="always", max_new_tokens=24,
                           return_dict=True)
    assert len({round(s.tau, 6) for s in out.stats}) == 2  # ragged: a mean of per-row tau differs
    assert out.tau == pytest.approx(sum(s.new_tokens for s in out.stats) / sum(s.steps for s in out.stats))
    for s in out.stats:
        assert s.tokens_per_second == pytest.approx(s.new_tokens / s.seconds)
    eos = specdec.generate(model, [other], max_new_tokens=20)[0][len(other) + 2]
    out = specdec.generate(model, [other, rep], max_new_tokens=20, eos_token_id=eos, return_dict=True)
    early, full = out.stats
    assert early.finish_reason == "eos" and full.finish_reason == "length"
    assert early.seconds < 0.5 * full.seconds  # one token of twenty (the call's time was ~7x it)


def test_rows_that_stopped_early_are_padded_with_the_pad_token_id():
    """Row 0 got one new token, row 1 two: row 0 is right-padded with pad_token_id (9), not 0."""
    from specdec.output import OutputLayout

    layout = OutputLayout(rows=((1, 2), (3, 4)), tensor=True, pad_token_id=9)
    assert layout.pack([[5], [6, 7]]).tolist() == [[1, 2, 5, 9], [3, 4, 6, 7]]


def test_a_bad_prompt_is_named_by_its_row_of_input_ids_not_among_num_return_sequences_copies():
    """Rows were checked after num_return_sequences repeated them: with 3 copies each, input row 1 was named
    "sequence 3" (or "prompt 3", of a batch of two rows)."""
    model = build_tiny_model()
    with pytest.raises(InputError, match=r"^input_ids: sequence 1 has token ids outside the vocabulary \[0, 96\): "
                                         r"\[999\]$"):
        specdec.generate(model, [[1, 2], [3, 999]], max_new_tokens=2, do_sample=True, num_return_sequences=3)
    with pytest.raises(InputError, match=r"^prompt 1 is all padding \(pad_token_id 0, no attention_mask\)"):
        specdec.generate(model, torch.tensor([[1, 2], [0, 0]]), max_new_tokens=2, do_sample=True,
                         num_return_sequences=3)


def test_a_batch_past_the_context_names_its_longest_prompt_and_how_many_do_not_fit():
    """A batch refused for a prompt past the context said "prompt (60 tokens) + ...", not which of its prompts."""
    model = build_tiny_model(max_position_embeddings=64)
    with pytest.raises(InputError, match=r"^prompt 1 \(60 tokens, the longest\) \+ max_new_tokens \(10\) exceeds the "
                                         r"model's context of 64 tokens; shorten the prompt or lower max_new_tokens$"):
        specdec.generate(model, [[1] * 10, [2] * 60, [3]], max_new_tokens=10)
    with pytest.raises(InputError, match=r"^prompt 2 \(70 tokens, the longest; 2 of the 3 prompts do not fit\) \+ "):
        specdec.generate(model, [[1] * 10, [4] * 60, [2] * 70], max_new_tokens=10, do_sample=True,
                         num_return_sequences=2)  # rows of input_ids, not of the copies
    with pytest.raises(InputError, match=r"^prompt \(60 tokens\) \+ max_new_tokens"):  # alone: no row to name
        specdec.generate(model, [[2] * 60], max_new_tokens=10)


def test_a_returned_dict_carries_the_engines_timings_and_each_sequences_depth_counts():
    """pack_output reads draft and verify seconds, forward passes and each sequence's depth counts into their own
    fields: 4 new tokens in 2.0 s are 2.0 tokens per second; depths tried (4, 2), accepted (2, 1): rates 2/4, 1/2."""
    from types import SimpleNamespace

    from specdec.engine import SequenceState
    from specdec.output import OutputLayout, pack_output

    engine = SimpleNamespace(seconds={"draft": 1.0, "verify": 3.0}, forward_passes=5, output_logprobs=False)
    s = SequenceState(0, [1, 2, 3, 4, 5, 6], 2, finish_reason="length", steps=2, depth_tried=[4, 2],
                      depth_accepted=[2, 1], finished_at=12.0)
    out = pack_output(engine, [s], OutputLayout(rows=((1, 2),), tensor=False), True, start=10.0, prefill_seconds=0.5)
    assert (out.draft_seconds, out.verify_seconds, out.forward_passes, out.prefill_seconds) == (1.0, 3.0, 5, 0.5)
    assert out.sequences == [[1, 2, 3, 4, 5, 6]] and out.new_tokens == [[3, 4, 5, 6]] and out.logprobs is None
    st = out.stats[0]
    assert (st.new_tokens, st.steps, st.tau, st.seconds, st.tokens_per_second) == (4, 2, 2.0, 2.0, 2.0)
    assert (st.depth_tried, st.depth_accepted, st.acceptance_per_depth) == ((4, 2), (2, 1), (0.5, 0.5))
