"""generate() called as transformers' ``model.generate()`` is called gives what it gives (issue 22, items 1, 2, 4
and 6 but min_new_tokens), on tiny random models with the tiny character tokenizer, against transformers' own
``generate()``: left / right padding, lists with masks, a BatchEncoding or dict passed positionally or as
``**enc``, GenerationConfig precedence (keyword arguments > generation_config= > the model's), unsupported
fields refused, streamers (``TextStreamer``, ``TextIteratorStreamer``, a recording put/end object, the
callable), ``num_return_sequences`` and ``max_length``. Greedy results are compared as whole tensors
(``torch.equal``: same shape, same padding, same tokens).
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch
import transformers

import specdec
from specdec.errors import InputError, SpecdecError
from specdec.generate import prepare
from specdec.sampling import InvalidLogitsError
from specdec.testing import build_tiny_model, build_tiny_tokenizer

TEXTS = ["hello world", "ab", "the quick brown fox"]


@functools.lru_cache(maxsize=1)
def _tok():
    tok = build_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def _model(**generation):
    """A fresh tiny model (vocabulary = the tiny tokenizer's) with ``generation`` set on its generation_config."""
    model = build_tiny_model(vocab_size=len(_tok()), seed=1)
    for name, value in generation.items():
        setattr(model.generation_config, name, value)
    return model


@functools.lru_cache(maxsize=1)
def _shared_model():
    return _model()


def _enc(side: str = "left", texts=TEXTS, **kwargs):
    tok = _tok()
    tok.padding_side = side
    return tok(texts, padding=True, return_tensors="pt", **kwargs)


def hf(model, *args, **kwargs):
    with torch.no_grad():
        return model.generate(*args, **kwargs)


def _eos_ending_rows_apart(model, enc, n: int) -> int:
    """A token that ends the rows of ``enc`` at different steps in greedy decoding (so some get padded)."""
    new = hf(model, **enc, max_new_tokens=n, do_sample=False)[:, enc["input_ids"].shape[1]:].tolist()
    for t in dict.fromkeys(new[0][1:]):
        firsts = {row.index(t) if t in row else n for row in new}
        if len(firsts) > 1 and t != model.generation_config.pad_token_id:
            return t
    raise AssertionError("no token ends the rows at different steps")


def _up_to_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


# ---- inputs and outputs ------------------------------------------------------------------------
def test_left_padded_batch_is_transformers_tensor_with_eos_padding(device):
    model = _shared_model() if device == "cpu" else _model().to(device)
    enc = _enc("left").to(device)
    eos = _eos_ending_rows_apart(model, enc, 12)
    want = hf(model, **enc, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    out = specdec.generate(model, **enc, max_new_tokens=12, eos_token_id=eos)
    assert torch.equal(out, want) and out.dtype == torch.long and out.device == want.device
    assert (want == 0).sum() > (enc["attention_mask"] == 0).sum()  # some rows really were padded after EOS
    width = enc["input_ids"].shape[1]
    res = specdec.generate(model, **enc, max_new_tokens=12, eos_token_id=eos, return_dict=True)
    assert [_up_to_eos(r, eos) for r in out[:, width:].tolist()] == res.new_tokens  # out[:, L:] = the new tokens


def test_a_padded_tensor_without_mask_is_unpadded_by_the_pad_id_as_transformers():
    """transformers infers the mask of a tensor without attention_mask from the pad id, where it occurs in the
    tensor and is no EOS id; specdec prefilled the pads as prompt tokens and decoded something else. Where the pad
    id is an EOS id (or absent) every position is a token, in both."""
    model = _shared_model()
    enc = _enc("left")
    pad = model.generation_config.pad_token_id
    assert pad is not None and (enc["input_ids"] == pad).any()
    want = hf(model, enc["input_ids"], max_new_tokens=8, do_sample=False)
    out = specdec.generate(model, enc["input_ids"], max_new_tokens=8)
    assert torch.equal(out, want)
    assert torch.equal(out, specdec.generate(model, **enc, max_new_tokens=8))  # the mask it would have been given
    kept = hf(model, enc["input_ids"], max_new_tokens=8, do_sample=False, eos_token_id=pad)
    assert torch.equal(specdec.generate(model, enc["input_ids"], max_new_tokens=8, eos_token_id=pad), kept)
    with pytest.raises(InputError, match="prompt 0 is all padding"):
        specdec.generate(model, torch.full((1, 3), pad), max_new_tokens=2)


def test_right_padded_batch_keeps_its_layout_and_decodes_the_unpadded_prompts():
    """transformers decodes a right-padded batch from the pad tokens (it warns); specdec honours the mask. The
    layout is transformers': the rows as given, then the new tokens, which are those of the left-padded batch."""
    model = _shared_model()
    right, left = _enc("right"), _enc("left")
    want_new = hf(model, **left, max_new_tokens=8, do_sample=False)[:, left["input_ids"].shape[1]:]
    out = specdec.generate(model, **right, max_new_tokens=8)
    width = right["input_ids"].shape[1]
    assert torch.equal(out[:, :width], right["input_ids"]) and torch.equal(out[:, width:], want_new)


def test_lists_with_masks_keep_each_row_and_add_transformers_new_tokens():
    model = _shared_model()
    left = _enc("left")
    eos = _eos_ending_rows_apart(model, left, 10)
    want = hf(model, **left, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    want_new = [_up_to_eos(r, eos) for r in want[:, left["input_ids"].shape[1]:].tolist()]
    for side in ("left", "right"):
        lists = _enc(side).data
        lists = {k: v.tolist() for k, v in lists.items()}
        for out in (specdec.generate(model, lists["input_ids"], attention_mask=lists["attention_mask"],
                                     max_new_tokens=10, eos_token_id=eos),
                    specdec.generate(model, _tok()(TEXTS, padding=True), max_new_tokens=10, eos_token_id=eos)
                    if side == _tok().padding_side else None):
            if out is None:
                continue
            assert isinstance(out, list)
            assert out == [row + new for row, new in zip(lists["input_ids"], want_new, strict=True)]
    # a ragged list: each row's own padding
    ragged = [[0, 0] + [8, 5, 12], [1, 2, 3, 0]]
    mask = [[0, 0, 1, 1, 1], [1, 1, 1, 0]]
    new = [hf(model, torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=4,
              do_sample=False)[0, len(p):].tolist() for p in ([8, 5, 12], [1, 2, 3])]
    assert specdec.generate(model, ragged, attention_mask=mask, max_new_tokens=4) == [
        r + n for r, n in zip(ragged, new, strict=True)]


@pytest.mark.parametrize("form", ["batch_encoding", "dict", "kwargs", "chat_template"])
def test_batch_encoding_or_dict_positional_or_unpacked(form):
    model = _shared_model()
    if form == "chat_template":
        _tok().padding_side = "left"
        enc = _tok().apply_chat_template([[{"role": "user", "content": t}] for t in TEXTS], return_tensors="pt",
                                         return_dict=True, padding=True)
        assert isinstance(enc, transformers.BatchEncoding)
    else:
        enc = _enc("left", return_token_type_ids=True)  # token_type_ids: accepted and ignored
        assert "token_type_ids" in enc
    want = hf(model, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=6,
              do_sample=False)
    if form == "kwargs":
        out = specdec.generate(model, **enc, max_new_tokens=6)
    else:
        out = specdec.generate(model, dict(enc) if form == "dict" else enc, max_new_tokens=6)
    assert torch.equal(out, want)


def test_transformers_refuses_token_type_ids_on_llama_and_specdec_ignores_them():
    """Documented difference: transformers' generate() refuses ``**tokenizer(..., return_token_type_ids=True)``
    for Llama ("model_kwargs are not used"); specdec ignores them (Llama has no token-type embedding)."""
    model = _shared_model()
    enc = _enc("left", return_token_type_ids=True)
    with pytest.raises(ValueError, match="token_type_ids"):
        hf(model, **enc, max_new_tokens=2)
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=2),
                       specdec.generate(model, enc["input_ids"], attention_mask=enc["attention_mask"],
                                        max_new_tokens=2))


def test_a_row_its_stop_string_ended_is_padded_also_where_transformers_without_eos_keeps_generating_it():
    """Documented difference: transformers pads a row its stop string ended only when an EOS id is set (without
    one it keeps generating that row while the others run); specdec pads it either way. With an EOS id (one that
    never comes) the two agree tensor for tensor."""
    model, tok = _shared_model(), _tok()
    enc = _enc("left")
    width = enc["input_ids"].shape[1]
    kwargs = dict(max_new_tokens=12, stop_strings="?", tokenizer=tok)
    assert model.generation_config.eos_token_id is None
    want = hf(model, **enc, do_sample=False, **kwargs)
    out = specdec.generate(model, **enc, **kwargs)
    end = next(i for i in range(width, want.shape[1]) if tok.decode(want[1, i:i + 1]) == "?") + 1
    assert end < want.shape[1] and "?" not in tok.decode(want[[0, 2], width:].flatten())  # only row 1 stops
    assert torch.equal(out[:, :end], want[:, :end]) and torch.equal(out[[0, 2]], want[[0, 2]])
    assert out[1, end:].eq(0).all() and not want[1, end:].eq(0).any()  # padded / generated on
    never = next(t for t in range(1, len(tok)) if t not in want)
    assert torch.equal(specdec.generate(model, **enc, eos_token_id=never, **kwargs),
                       hf(model, **enc, do_sample=False, eos_token_id=never, **kwargs))


def test_a_masked_position_inside_a_prompt_is_no_token_where_transformers_processors_read_it():
    """Documented difference: a masked position that is no left padding (a 0 inside an attention_mask row, or the
    pad id inside a tensor given without one) is dropped from the prompt, so every processor sees the prompt
    alone; transformers' repetition_penalty reads it as a token (it skips left padding only). Without a processor
    the two agree."""
    model = build_tiny_model("llama-mha-untied", vocab_size=len(_tok()), seed=0)
    ids, alone = torch.tensor([[64, 0, 41, 21]]), torch.tensor([[64, 41, 21]])
    assert model.generation_config.pad_token_id == 0
    kwargs = dict(max_new_tokens=6, repetition_penalty=0.8)
    want = hf(model, alone, do_sample=False, **kwargs)[:, 3:]
    for mask in (dict(attention_mask=torch.tensor([[1, 0, 1, 1]])), dict()):
        assert torch.equal(specdec.generate(model, ids, **mask, **kwargs)[:, 4:], want), mask
        assert not torch.equal(hf(model, ids, **mask, do_sample=False, **kwargs)[:, 4:], want), mask
        assert torch.equal(specdec.generate(model, ids, **mask, max_new_tokens=6),
                           hf(model, ids, **mask, do_sample=False, max_new_tokens=6)), mask


def test_bad_encodings_are_one_line_errors_before_the_model_loads():
    enc = _enc("left")
    cases = [
        (dict(input_ids=enc, attention_mask=enc["attention_mask"]), "attention_mask was given twice"),
        (dict(input_ids={**enc, "position_ids": enc["input_ids"]}), r"keys specdec does not use: \['position_ids'\]"),
        (dict(input_ids={"attention_mask": enc["attention_mask"]}), "without an 'input_ids' key"),
    ]
    for kwargs, match in cases:
        with pytest.raises(InputError, match=match) as info:
            specdec.generate("no/such/model", **kwargs)  # the model would be "not found": checked first
        assert "\n" not in str(info.value)


# ---- GenerationConfig precedence -----------------------------------------------------------------
def test_model_generation_config_then_passed_config_then_kwargs():
    enc = _enc("left")
    model = _model(max_new_tokens=5)
    passed = transformers.GenerationConfig(max_new_tokens=7)
    # the model's own generation_config.json provides the default
    assert torch.equal(specdec.generate(model, **enc), hf(model, **enc))
    assert specdec.generate(model, **enc).shape[1] == enc["input_ids"].shape[1] + 5
    # a passed config beats the model's, keyword arguments beat both
    assert torch.equal(specdec.generate(model, **enc, generation_config=passed),
                       hf(model, **enc, generation_config=passed))
    assert torch.equal(specdec.generate(model, **enc, generation_config=passed, max_new_tokens=3),
                       hf(model, **enc, generation_config=passed, max_new_tokens=3))
    assert specdec.generate(model, **enc, generation_config=passed, max_new_tokens=3).shape[1] == (
        enc["input_ids"].shape[1] + 3)
    # a specdec GenerationConfig counts the fields it was given, not its defaults
    assert specdec.generate(model, **enc, generation_config=specdec.GenerationConfig()).shape[1] == (
        enc["input_ids"].shape[1] + 5)
    assert specdec.generate(model, **enc, generation_config=specdec.GenerationConfig(max_new_tokens=4)).shape[1] == (
        enc["input_ids"].shape[1] + 4)


def test_eos_and_pad_from_each_layer_as_transformers():
    enc = _enc("left")
    base = _shared_model()
    eos_a = _eos_ending_rows_apart(base, enc, 12)
    eos_b = next(t for t in range(3, len(_tok())) if t != eos_a)
    model = _model(eos_token_id=eos_a, pad_token_id=2)
    passed = transformers.GenerationConfig(eos_token_id=[eos_b, eos_a])  # pad from the model's config
    # pad_token_id=None clears the model's 2: rows that stopped early are padded with the first EOS id (eos_b
    # where the passed config lists [eos_b, eos_a], though the rows stop on eos_a)
    for kwargs in (dict(), dict(generation_config=passed), dict(generation_config=passed, pad_token_id=4),
                   dict(pad_token_id=None), dict(generation_config=passed, pad_token_id=None)):
        want = hf(model, **enc, max_new_tokens=12, do_sample=False, **kwargs)
        assert torch.equal(specdec.generate(model, **enc, max_new_tokens=12, **kwargs), want), kwargs
    assert (hf(model, **enc, max_new_tokens=12, do_sample=False)[:, -1] == 2).any()  # padding really shows


def test_do_sample_from_the_model_config_samples_with_transformers_top_k():
    enc = _enc("left")
    greedy = specdec.generate(_shared_model(), **enc, max_new_tokens=6)
    model = _model(do_sample=True, top_k=1)  # top-k 1: sampling that is deterministic, so comparable
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=6), hf(model, **enc, max_new_tokens=6))
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=6), greedy)
    sampling = _model(do_sample=True, temperature=0.7)
    assert prepare(sampling, [[1, 2]]).config.sampling == specdec.SamplingConfig(True, 0.7, 50, 1.0)
    assert prepare(sampling, [[1, 2]], top_k=7).config.sampling == specdec.SamplingConfig(True, 0.7, 7, 1.0)
    # a specdec GenerationConfig that samples without a top_k: transformers' 50 too (top_k=0: the full law)
    for config, top_k in ((specdec.GenerationConfig(do_sample=True), 50),
                          (specdec.GenerationConfig(do_sample=True, top_k=0), 0)):
        assert prepare(_shared_model(), [[1, 2]], generation_config=config).config.top_k == top_k
    # kwargs beat the model's sampling; an explicit specdec GenerationConfig(do_sample=False) beats it too
    assert not prepare(sampling, [[1, 2]], do_sample=False).config.do_sample
    assert not prepare(sampling, [[1, 2]],
                       generation_config=specdec.GenerationConfig(do_sample=False)).config.do_sample
    outs = {tuple(specdec.generate(sampling, [[5, 6, 7]], max_new_tokens=8, seed=s)[0]) for s in range(4)}
    assert len(outs) > 1  # it really samples


@pytest.mark.parametrize("model_sampling", [False, True], ids=["greedy-model", "sampling-model"])
@pytest.mark.parametrize("call", [
    dict(do_sample=True), dict(do_sample=True, top_k=0), dict(do_sample=True, top_k=None),
    dict(do_sample=True, top_k=3),
    dict(generation_config=dict(do_sample=True)), dict(generation_config=dict(do_sample=True, top_k=5)),
    dict(generation_config=dict(do_sample=True), top_k=None), dict(), dict(temperature=0.5),
], ids=str)
def test_top_k_is_the_one_transformers_generate_samples_with(call, model_sampling):
    """However sampling is asked for (a keyword, generation_config=, the model's own config), the top-k specdec
    samples with is the one transformers' generate() resolves for the same call: its 50 where nothing sets one."""
    model = _model(do_sample=True, temperature=0.7) if model_sampling else _shared_model()
    call = dict(call)
    if "generation_config" in call:
        call["generation_config"] = transformers.GenerationConfig(**call["generation_config"])
    theirs, _ = model._prepare_generation_config(call.get("generation_config"),
                                                 **{k: v for k, v in call.items() if k != "generation_config"})
    ours = prepare(model, [[1, 2]], **call).config
    assert ours.do_sample == theirs.do_sample
    if theirs.do_sample:
        assert ours.top_k == (theirs.top_k or 0), (ours.top_k, theirs.top_k)


def test_unsupported_fields_are_refused_from_every_layer():
    enc = _enc("left")
    with pytest.raises(InputError, match=r"generation_config= sets num_beams=2: beam search") as info:
        specdec.generate("no/such/model", **enc, generation_config=transformers.GenerationConfig(num_beams=2))
    assert "\n" not in str(info.value)
    with pytest.raises(InputError, match=r"keyword argument sets output_attentions=True"):
        specdec.generate("no/such/model", **enc, output_attentions=True)
    with pytest.raises(InputError, match=r"keyword argument sets guidance_scale=1.5"):
        specdec.generate("no/such/model", **enc, guidance_scale=1.5)
    model = _model(penalty_alpha=0.6)
    with pytest.raises(InputError, match=r"the model's generation_config sets penalty_alpha=0.6: contrastive "
                                         r"search.*pass penalty_alpha=None to generate\(\)"):
        specdec.generate(model, **enc, max_new_tokens=2)
    # switched off by a higher layer, neutral values everywhere: accepted, and transformers agrees on the tokens
    plain = hf(_shared_model(), **enc, max_new_tokens=3, do_sample=False)
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=3, penalty_alpha=None), plain)
    neutral = dict(num_beams=1, guidance_scale=1.0, output_attentions=False, use_cache=False, length_penalty=1.0)
    assert torch.equal(specdec.generate(_shared_model(), **enc, max_new_tokens=3, **neutral), plain)
    with pytest.raises(InputError, match="guidance_scale=1.5"):
        specdec.generate(_model(guidance_scale=1.5), **enc, max_new_tokens=2)
    assert torch.equal(specdec.generate(_model(guidance_scale=1.5), **enc, max_new_tokens=3, guidance_scale=1.0),
                       plain)
    # a typo is still a typo
    with pytest.raises(specdec.InputTypeError, match=r"argument num_beam \(did you mean num_beams\?\);"):
        specdec.generate("no/such/model", **enc, num_beam=2)


def _first_greedy_token(enc) -> int:
    return int(hf(_shared_model(), **enc, max_new_tokens=1, do_sample=False)[0, -1])


def test_a_keyword_none_clears_the_model_config_value_as_transformers():
    tok = _tok()
    enc = _enc("left", texts=["hello world"])
    t = _first_greedy_token(enc)  # a token that ends (or is banned from) the first step
    for generation, kwargs in ((dict(eos_token_id=t), dict(eos_token_id=None)),
                               (dict(bad_words_ids=[[t]]), dict(bad_words_ids=None)),
                               (dict(stop_strings=[tok.decode([t])]), dict(stop_strings=None)),
                               (dict(max_new_tokens=2, max_length=enc["input_ids"].shape[1] + 5),
                                dict(max_new_tokens=None))):
        model = _model(**generation)
        want = hf(model, **enc, tokenizer=tok, **{"max_new_tokens": 6, **kwargs})
        assert want.shape[1] > enc["input_ids"].shape[1] + 2, generation  # the model's value really is cleared
        assert torch.equal(specdec.generate(model, **enc, tokenizer=tok, **{"max_new_tokens": 6, **kwargs}),
                           want), generation
    # max_new_tokens=None and no max_length anywhere: specdec's default (transformers': 20)
    assert prepare(_model(max_new_tokens=2), [[1, 2]], max_new_tokens=None).config.max_new_tokens == 128


def test_eos_comes_from_the_generation_config_only_as_transformers():
    enc = _enc("left", texts=["hello world"])
    t = _first_greedy_token(enc)
    model = build_tiny_model(vocab_size=len(_tok()), seed=1, eos_token_id=t)  # generation_config: no EOS
    assert model.config.eos_token_id == t and model.generation_config.eos_token_id is None
    want = hf(model, **enc, max_new_tokens=6)
    assert want.shape[1] == enc["input_ids"].shape[1] + 6
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=6), want)
    model.generation_config = None  # a model without a generation config: its config's EOS
    assert prepare(model, [[1, 2]]).stop.eos_token_ids == frozenset({t})


def test_a_keyword_eos_token_id_none_is_no_eos_where_the_model_has_no_generation_config():
    """The model config's EOS (the first greedy token) is the fallback only while no keyword sets eos_token_id:
    None means no EOS, so all 6 new tokens come."""
    enc = _enc("left", texts=["hello world"])
    t = _first_greedy_token(enc)
    model = build_tiny_model(vocab_size=len(_tok()), seed=1, eos_token_id=t)
    model.generation_config = None
    assert prepare(model, [[1, 2]], eos_token_id=None).stop.eos_token_ids == frozenset()
    out = specdec.generate(model, **enc, max_new_tokens=6, eos_token_id=None)
    assert out.shape[1] == enc["input_ids"].shape[1] + 6 and out[0, -6] == t


def test_none_for_a_sampling_field_is_off_as_transformers():
    enc = _enc("left")
    sampling = _model(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    greedy = hf(sampling, **enc, max_new_tokens=4, do_sample=None)
    assert torch.equal(specdec.generate(sampling, **enc, max_new_tokens=4, do_sample=None), greedy)
    assert torch.equal(greedy, hf(_shared_model(), **enc, max_new_tokens=4))
    config = prepare(sampling, [[1, 2]], temperature=None, top_k=None, top_p=None).config
    assert config.sampling == specdec.SamplingConfig(True, 1.0, 0, 1.0)
    one = _model(do_sample=True, top_k=1)  # top-k 1: sampling that is deterministic, so comparable
    for kwargs in (dict(temperature=None), dict(top_p=None)):
        assert torch.equal(specdec.generate(one, **enc, max_new_tokens=4, **kwargs),
                           hf(one, **enc, max_new_tokens=4, **kwargs)), kwargs


def test_top_p_zero_keeps_the_most_likely_token_as_transformers():
    """transformers' TopPLogitsWarper takes top_p=0 and keeps one token (it was refused): sampling gives the greedy
    tensor, in transformers and in specdec, with and without a drafter, standard and coupled."""
    enc = _enc("left")
    torch.manual_seed(0)
    want = hf(_shared_model(), **enc, max_new_tokens=8, do_sample=True, top_p=0.0, temperature=0.7)
    assert torch.equal(want, hf(_shared_model(), **enc, max_new_tokens=8, do_sample=False))
    for sampler, drafter, options in (("standard", None, None), ("standard", "ngram", None),
                                      ("coupled", "self-draft", {"num_layers": 1})):
        got = specdec.generate(_shared_model(), **enc, max_new_tokens=8, do_sample=True, top_p=0.0, temperature=0.7,
                               seed=1, sampler=sampler, drafter=drafter, drafter_options=options,
                               speculation="always")
        assert torch.equal(got, want), (sampler, drafter)


def test_return_dict_in_generate_false_as_a_keyword_beats_true_in_each_config_layer():
    """transformers: a keyword beats generation_config=, which beats the model's config; False wins: a tensor."""
    enc = _enc("left")
    model = _model(return_dict_in_generate=True)
    assert not isinstance(specdec.generate(model, **enc, max_new_tokens=3), torch.Tensor)  # the model's True
    passed = transformers.GenerationConfig(return_dict_in_generate=True)
    for owner, kwargs in ((model, {}), (_shared_model(), dict(generation_config=passed))):
        want = hf(owner, **enc, max_new_tokens=3, do_sample=False, return_dict_in_generate=False, **kwargs)
        out = specdec.generate(owner, **enc, max_new_tokens=3, return_dict_in_generate=False, **kwargs)
        assert isinstance(want, torch.Tensor) and torch.equal(out, want), kwargs


def test_a_specdec_generation_configs_none_leaves_the_models_eos_as_a_transformers_configs_none():
    """A config's None never overrides (only a keyword's does): GenerationConfig(eos_token_id=None) passed as
    generation_config= keeps the model's EOS t, the first greedy token, so the call stops after that one token."""
    enc = _enc("left", texts=["hello world"])
    t = _first_greedy_token(enc)
    model = _model(eos_token_id=t)
    want = hf(model, **enc, max_new_tokens=6, do_sample=False,
              generation_config=transformers.GenerationConfig(eos_token_id=None))
    assert want.shape[1] == enc["input_ids"].shape[1] + 1  # prompt + t
    passed = specdec.GenerationConfig(eos_token_id=None)
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=6, generation_config=passed), want)


def test_return_dict_in_generate_none_as_a_keyword_is_a_tensor_over_the_models_true():
    """transformers 5: a keyword's None overrides the model's return_dict_in_generate=True and reads as off."""
    enc = _enc("left")
    model = _model(return_dict_in_generate=True)
    want = hf(model, **enc, max_new_tokens=3, do_sample=False, return_dict_in_generate=None)
    out = specdec.generate(model, **enc, max_new_tokens=3, return_dict_in_generate=None)
    assert isinstance(want, torch.Tensor) and torch.equal(out, want)


def test_a_transformers_field_specdec_does_not_list_is_refused_not_ignored(monkeypatch):
    """A transformers generation field newer than specdec's lists (here penalty_alpha, taken off them) may change
    the tokens: it is refused by name, not silently ignored as a custom entry is."""
    from specdec import transformers_config

    monkeypatch.delitem(transformers_config.REFUSED, "penalty_alpha")
    layer = transformers_config.config_layer(transformers.GenerationConfig(penalty_alpha=0.6))
    with pytest.raises(InputError, match=r"generation_config= sets penalty_alpha=0.6: a transformers setting specdec "
                                         r"does not know"):
        transformers_config.resolve([layer])



def test_an_argument_of_generate_inside_a_generation_config_is_warned_about(caplog):
    """GenerationConfig(drafter="ngram") (a custom entry to transformers) decoded plainly with no word at warning
    level: the generate() argument it meant is named; a custom entry of another name stays an info line."""
    enc = _enc("left")
    model = _model()
    config = transformers.GenerationConfig(drafter="ngram", my_note="x", max_new_tokens=3, do_sample=False)
    with caplog.at_level(logging.INFO, logger="specdec"):
        out = specdec.generate(model, **enc, generation_config=config)
    assert torch.equal(out, hf(model, **enc, max_new_tokens=3, do_sample=False))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w for w in warned if "drafter='ngram', an argument of generate() itself" in w
            and "pass generate(..., drafter=...)" in w], warned
    assert not [w for w in warned if "my_note" in w], warned

# ---- sampling warpers -----------------------------------------------------------------------------
WARPER_SETTINGS = {
    "min_p": dict(temperature=0.7, min_p=0.05), "min_p-1": dict(min_p=1.0), "typical": dict(typical_p=0.7),
    "typical-sharp": dict(temperature=2.0, typical_p=0.2), "epsilon": dict(temperature=1.3, epsilon_cutoff=3e-3),
    "eta": dict(eta_cutoff=2e-3), "top_h": dict(top_h=0.5), "top_h-1": dict(top_h=1.0),
    "top_k-vocab-1": dict(top_k=299),  # the rows below have 300 tokens: top-k still cuts one
    "all": dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.1, typical_p=0.8, epsilon_cutoff=1e-3,
                eta_cutoff=1e-3, top_h=0.7),
}


@pytest.mark.parametrize("name", list(WARPER_SETTINGS))
def test_sampling_warpers_cut_where_transformers_generate_cuts(name):
    """The sampling transform is the list of warpers transformers' generate(do_sample=True) builds for the same
    settings, in its order: float32 logits give its scores bit for bit, float64 ones its kept tokens."""
    from specdec.sampling import sampling_logits

    kw = WARPER_SETTINGS[name]
    config = transformers.GenerationConfig(do_sample=True, **{"top_k": 0, **kw})
    warpers = _shared_model()._get_logits_processor(generation_config=config, input_ids_seq_length=1,
                                                    logits_processor=transformers.LogitsProcessorList(), device="cpu")
    assert len(warpers) == len(kw)  # each setting is one warper (temperature's included)
    sampling = specdec.SamplingConfig(True, **kw)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(16, 300, generator=g) * torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(4)[:, None]
        logits[::5, :7] = float("-inf")  # a processor's bans
        logits[1::4, 10:20] = logits[1::4, 10:11]  # ties
        if trial % 3 == 0:
            logits = (logits * 4).round() / 4  # many ties
        want = warpers(torch.zeros(16, 1, dtype=torch.long), logits.clone())
        assert torch.equal(sampling_logits(logits, sampling), want), (name, trial)
        kept = sampling_logits(logits.double(), sampling) > float("-inf")
        assert torch.equal(kept, want > float("-inf")), (name, trial)


def test_top_p_cuts_where_transformers_cuts_also_for_float64_logits():
    """The rejection sampler carries the target's float32 logits in float64; top-p's cut used to be computed there
    in float64 arithmetic, which on this row (one of ~40,000 random ones) keeps a token transformers' float32
    top-p removes. The cut is now decided in float32, by transformers' operations."""
    from specdec.sampling import sampling_logits

    g = torch.Generator().manual_seed(0)
    for _ in range(23):
        logits = torch.randn(64, 2000, generator=g) * 3
    row = logits[34:35]
    warpers = [transformers.TemperatureLogitsWarper(1.3), transformers.TopPLogitsWarper(0.95)]
    want = row.clone()
    for w in warpers:
        want = w(None, want)
    x = row.double() / 1.3  # the cut in float64 arithmetic differs: this row is a witness
    ascending, order = torch.sort(x, descending=False)
    removed = (ascending.softmax(-1).cumsum(-1) <= 1 - 0.95).scatter(1, order, ascending.softmax(-1).cumsum(-1)
                                                                   <= 1 - 0.95)
    assert not torch.equal(~removed, want > float("-inf"))
    kept = sampling_logits(row.double(), specdec.SamplingConfig(True, 1.3, 0, 0.95)) > float("-inf")
    assert torch.equal(kept, want > float("-inf"))


def test_the_float64_paths_cut_is_transformers_float32_division_by_the_temperature():
    """Float64 logits are cut where transformers cuts their float32 values, divided by the temperature in float32:
    divided in float64 and then rounded, 3 of these 80 rows at min-p's boundary (ulps apart) kept another set."""
    import math

    from specdec.sampling import sampling_logits

    x = torch.tensor(-0.7 * math.log(2), dtype=torch.float32)
    for _ in range(40):
        x = torch.nextafter(x, torch.tensor(-1.0))
    sampling = specdec.SamplingConfig(True, 0.7, min_p=0.5)
    warpers = [transformers.TemperatureLogitsWarper(0.7), transformers.MinPLogitsWarper(0.5)]
    for _ in range(80):
        row = torch.tensor([[1.0, 1.0 + x.item(), -5.0]], dtype=torch.float32)
        want = row.clone()
        for w in warpers:
            want = w(None, want)
        assert torch.equal(sampling_logits(row.double(), sampling) > float("-inf"), want > float("-inf")), row
        x = torch.nextafter(x, torch.tensor(1.0))


@pytest.mark.parametrize("kw", [dict(min_p=1.0), dict(temperature=0.6, top_h=1e-6), dict(typical_p=1e-6),
                                dict(temperature=1.5, epsilon_cutoff=0.999)], ids=str)
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_sampling_with_a_warper_that_keeps_one_token_is_transformers_output(kw, drafter):
    """Settings under which each warper keeps one token (the argmax, or the most typical one) make sampling
    deterministic, so specdec's output, plain or speculative, must be transformers' token for token (top-k off on
    both sides: transformers' generate() would add its top-k 50, which changes which token is the most typical)."""
    enc = _enc("left")
    kw = dict(kw, top_k=0)
    want = hf(_shared_model(), **enc, max_new_tokens=8, do_sample=True, **kw)
    got = specdec.generate(_shared_model(), **enc, max_new_tokens=8, do_sample=True, drafter=drafter, seed=0, **kw)
    assert torch.equal(got, want)
    if "typical_p" not in kw:  # the argmax: greedy decoding
        assert torch.equal(want, hf(_shared_model(), **enc, max_new_tokens=8, do_sample=False))


def test_warpers_come_from_every_layer_and_a_keyword_none_turns_them_off():
    enc = _enc("left")
    warped = dict(min_p=0.1, typical_p=0.9, epsilon_cutoff=1e-3, eta_cutoff=2e-3, top_h=0.8)
    model = _model(do_sample=True, temperature=0.7, **warped)
    assert prepare(model, [[1, 2]]).config.sampling == specdec.SamplingConfig(True, 0.7, 50, 1.0, **warped)
    config = transformers.GenerationConfig(do_sample=True, min_p=0.2)
    assert prepare(model, [[1, 2]], generation_config=config, typical_p=0.5).config.sampling == \
        specdec.SamplingConfig(True, 0.7, 50, 1.0, **{**warped, "min_p": 0.2, "typical_p": 0.5})
    off = dict.fromkeys(warped)
    assert prepare(model, [[1, 2]], **off).config.sampling == specdec.SamplingConfig(True, 0.7, 50, 1.0)
    # greedy decoding ignores the warpers, as transformers does
    greedy = hf(model, **enc, max_new_tokens=5, do_sample=False)
    assert torch.equal(greedy, hf(_shared_model(), **enc, max_new_tokens=5, do_sample=False))
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=5, do_sample=False), greedy)
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=5, do_sample=False, drafter="ngram"), greedy)


@pytest.mark.parametrize("kw, match", [
    (dict(min_p=1.5), r"min_p must lie in \[0, 1\]"), (dict(min_p=-0.1), "min_p must lie in"),
    (dict(typical_p=0.0), r"typical_p must lie in \(0, 1\]"), (dict(typical_p=1.5), "typical_p must lie in"),
    (dict(epsilon_cutoff=-1e-3), r"epsilon_cutoff must lie in \[0, 1\)"),
    (dict(epsilon_cutoff=1.0), "epsilon_cutoff must lie in"),
    (dict(eta_cutoff=-1e-3), r"eta_cutoff must lie in \[0, 1\)"),
    (dict(eta_cutoff=float("nan")), "eta_cutoff must lie in"),
    (dict(top_h=0.0), r"top_h must lie in \(0, 1\]"), (dict(top_h=1.5), "top_h must lie in"),
    (dict(min_p="0.1"), "min_p must be a number"), (dict(top_h=True), "top_h must be a number or None"),
])
def test_invalid_warper_values_are_one_line_errors(kw, match):
    with pytest.raises(SpecdecError, match=match) as info:
        specdec.generate("no/such/model", [[1, 2]], do_sample=True, **kw)
    assert "\n" not in str(info.value)
    with pytest.raises(SpecdecError, match=match):  # from the model's generation_config too
        specdec.generate(_model(**kw), [[1, 2]], max_new_tokens=2, do_sample=True)


def test_settings_that_change_nothing_are_accepted_as_transformers_runs_them():
    enc = _enc("left")
    plain = hf(_shared_model(), **enc, max_new_tokens=3, do_sample=False)
    for kwargs in (dict(min_p=0.0), dict(suppress_tokens=[]), dict(renormalize_logits=True),
                   dict(early_stopping=True, length_penalty=0.6, num_beams=1)):
        assert torch.equal(hf(_shared_model(), **enc, max_new_tokens=3, **kwargs), plain), kwargs
        assert torch.equal(specdec.generate(_shared_model(), **enc, max_new_tokens=3, **kwargs), plain), kwargs
    model = _model(early_stopping=True, length_penalty=0.6, min_p=0.0, renormalize_logits=True)
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=3), hf(model, **enc, max_new_tokens=3))
    with pytest.raises(InputError, match="num_beams=2"):  # with beams they would matter: still refused
        specdec.generate(model, **enc, max_new_tokens=3, num_beams=2)


def test_transformers_generate_arguments_are_refused_by_name_or_read():
    enc = _enc("left")
    plain = specdec.generate(_shared_model(), **enc, max_new_tokens=3)
    none = dict(stopping_criteria=None, prefix_allowed_tokens_fn=None, assistant_model=None, synced_gpus=False)
    assert torch.equal(specdec.generate(_shared_model(), **enc, max_new_tokens=3, **none), plain)
    assert torch.equal(specdec.generate(_shared_model(), **enc, max_new_tokens=3,
                                        stopping_criteria=transformers.StoppingCriteriaList()), plain)
    for name, value, hint in (("stopping_criteria", [transformers.MaxLengthCriteria(5)], "stop="),
                              ("prefix_allowed_tokens_fn", lambda batch, ids: [1], "logits_processor="),
                              ("assistant_model", _shared_model(), "drafter="),  # a model's repr spans many lines
                              ("assistant_tokenizer", _tok(), "drafter="),
                              ("decoder_input_ids", torch.tensor([[0]]), "encoder-decoder models only")):
        with pytest.raises(InputError, match=rf"keyword argument sets {name}=.*{hint}") as info:
            specdec.generate("no/such/model", **enc, **{name: value})
        assert len(str(info.value)) < 250 and "\n" not in str(info.value)
    # inputs=, transformers' name for the prompt
    assert torch.equal(specdec.generate(_shared_model(), inputs=enc["input_ids"],
                                        attention_mask=enc["attention_mask"], max_new_tokens=3), plain)
    with pytest.raises(InputError, match="input_ids or inputs="):
        specdec.generate(_shared_model(), enc["input_ids"], inputs=enc["input_ids"])
    with pytest.raises(specdec.InputTypeError, match="input_ids must be token ids.*NoneType"):
        specdec.generate(_shared_model(), max_new_tokens=3)


def test_custom_entries_of_the_model_config_are_ignored_as_transformers_ignores_them():
    model = _model()
    model.generation_config.my_custom_flag = 3  # not a transformers generation field
    enc = _enc("left")
    assert torch.equal(specdec.generate(model, **enc, max_new_tokens=3), hf(model, **enc, max_new_tokens=3))


# ---- streamers -----------------------------------------------------------------------------------
class Recorder:
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", tuple(value.shape), value.tolist()))

    def end(self):
        self.calls.append(("end",))


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_put_end_streamer_gets_what_transformers_sends(drafter):
    model = _shared_model()
    enc = _enc("left", texts=["abab abab abab"])
    want, got = Recorder(), Recorder()
    hf(model, **enc, max_new_tokens=10, do_sample=False, streamer=want)
    out = specdec.generate(model, **enc, max_new_tokens=10, streamer=got, drafter=drafter,
                           speculation="always", return_dict=True)
    assert got.calls == want.calls
    if drafter:
        assert out.tau > 1  # several tokens were committed in one step, and still put() one by one


@pytest.mark.parametrize("skip_prompt", [False, True])
def test_text_streamer_prints_what_transformers_prints(skip_prompt, capsys):
    model = _shared_model()
    enc = _enc("left", texts=["hello world"])
    hf(model, **enc, max_new_tokens=12, do_sample=False, streamer=transformers.TextStreamer(_tok(), skip_prompt))
    want = capsys.readouterr().out
    specdec.generate(model, **enc, max_new_tokens=12, streamer=transformers.TextStreamer(_tok(), skip_prompt),
                     drafter="ngram", speculation="always")
    got = capsys.readouterr().out
    assert got == want and got.strip()
    assert got.startswith("hello world") != skip_prompt


def test_text_iterator_streamer_yields_the_new_text():
    model = _shared_model()
    enc = _enc("left", texts=["hello world"])
    streamer = transformers.TextIteratorStreamer(_tok(), skip_prompt=True)
    out = specdec.generate(model, **enc, max_new_tokens=10, streamer=streamer)
    assert "".join(streamer) == _tok().decode(out[0, enc["input_ids"].shape[1]:])


def test_put_end_streamer_ends_even_when_generation_fails():
    class Failing(Recorder):
        def put(self, value):
            super().put(value)
            if len(self.calls) == 3:
                raise RuntimeError("consumer gone")

    streamer = Failing()
    with pytest.raises(RuntimeError, match="consumer gone"):
        specdec.generate(_shared_model(), [[1, 2, 3]], max_new_tokens=8, streamer=streamer)
    assert streamer.calls[-1] == ("end",) and len(streamer.calls) == 4


def test_a_streamer_is_ended_when_the_call_fails_before_it_streams():
    """A refused call (here the engine's build: self-draft deeper than the model) never ended the streamer, so a
    thread iterating a TextIteratorStreamer waited for ever."""
    streamer = transformers.TextIteratorStreamer(_tok(), skip_prompt=True, timeout=5)
    with pytest.raises(InputError, match="self-draft: num_layers"):
        specdec.generate(_shared_model(), [[1, 2, 3]], max_new_tokens=4, streamer=streamer, drafter="self-draft",
                         drafter_options={"num_layers": 99})
    assert "".join(streamer) == ""  # ended: the iteration stops at once (without end() it times out)
    recorder = Recorder()
    with pytest.raises(InputError, match="one sequence"):
        specdec.generate(_shared_model(), [[1, 2], [3, 4]], streamer=recorder)
    assert recorder.calls == [("end",)]


def test_put_end_streamer_takes_one_sequence_as_transformers_text_streamer():
    with pytest.raises(InputError, match=r"one sequence in specdec \(transformers' TextStreamer takes one too\), "
                                         r"but this call generates 3") as info:
        specdec.generate("no/such/model", **_enc("left"), streamer=Recorder())
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="batch size 1"):  # transformers' own TextStreamer refuses a batch
        hf(_shared_model(), **_enc("left"), max_new_tokens=2, streamer=transformers.TextStreamer(_tok()))
    with pytest.raises(InputError, match="generates 2"):
        specdec.generate(_shared_model(), [[1, 2]], streamer=Recorder(), do_sample=True, num_return_sequences=2)


def test_put_end_streamer_counts_num_return_sequences_from_the_model_config():
    """One prompt, the model's config sampling 2 sequences: 1 x 2 = 2 sequences, refused in one line."""
    model = _model(do_sample=True, num_return_sequences=2)
    with pytest.raises(InputError, match="but this call generates 2") as info:
        specdec.generate(model, [[1, 2]], max_new_tokens=3, streamer=Recorder(), seed=0)
    assert "\n" not in str(info.value)


def test_callable_streamer_stays():
    seen = {0: [], 1: []}
    out = specdec.generate(_shared_model(), [[1, 2, 3], [4, 5]], max_new_tokens=9, drafter="ngram",
                           speculation="always", streamer=lambda i, toks: seen[i].extend(toks), return_dict=True)
    assert [seen[0], seen[1]] == out.new_tokens


# ---- num_return_sequences and max_length --------------------------------------------------------------
def test_num_return_sequences_repeats_each_prompt_consecutively_as_transformers():
    model = _shared_model()
    enc = _enc("left", texts=TEXTS[:2])
    kwargs = dict(max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=3)  # top-k 1: comparable
    out = specdec.generate(model, **enc, **kwargs)
    assert torch.equal(out, hf(model, **enc, **kwargs)) and out.shape[0] == 6
    # real sampling: copies of one prompt differ, the prompt rows stay, a seed reproduces them
    sampled = specdec.generate(model, **enc, max_new_tokens=8, do_sample=True, num_return_sequences=4, seed=0)
    width = enc["input_ids"].shape[1]
    assert torch.equal(sampled[:, :width], enc["input_ids"].repeat_interleave(4, dim=0))
    assert len({tuple(r) for r in sampled[:4, width:].tolist()}) > 1
    again = specdec.generate(model, **enc, max_new_tokens=8, do_sample=True, num_return_sequences=4, seed=0)
    assert torch.equal(sampled, again)
    lists = specdec.generate(model, [[1, 2], [3]], max_new_tokens=2, do_sample=True, num_return_sequences=2)
    assert [r[: len(p)] for r, p in zip(lists, [[1, 2], [1, 2], [3], [3]], strict=True)] == [[1, 2], [1, 2], [3], [3]]


def test_num_return_sequences_with_greedy_is_refused_as_in_transformers():
    enc = _enc("left")
    with pytest.raises(ValueError, match="num_return_sequences"):
        hf(_shared_model(), **enc, max_new_tokens=2, num_return_sequences=2)
    with pytest.raises(InputError, match=r"num_return_sequences=2 needs do_sample=True") as info:
        specdec.generate(_shared_model(), **enc, max_new_tokens=2, num_return_sequences=2)
    assert isinstance(info.value, SpecdecError) and "\n" not in str(info.value)


def test_max_length_counts_the_padded_input_and_max_new_tokens_wins(caplog):
    model = _shared_model()
    enc = _enc("left")
    width = enc["input_ids"].shape[1]
    for kwargs in (dict(max_length=width + 5), dict(max_length=width + 2, max_new_tokens=6)):
        out = specdec.generate(model, **enc, **kwargs)
        assert torch.equal(out, hf(model, **enc, do_sample=False, **kwargs)), kwargs
    with caplog.at_level(logging.WARNING, logger="specdec"):  # the caller's max_length overruled: said, as in HF
        assert specdec.generate(model, **enc, max_length=width + 2, max_new_tokens=6).shape[1] == width + 6
    assert "max_new_tokens=6 (from keyword argument) and max_length=" in caplog.text
    caplog.clear()
    # from the model's config, under a passed max_new_tokens (transformers: max_new_tokens wins across layers)
    capped = _model(max_length=width + 4)
    assert torch.equal(specdec.generate(capped, **enc), hf(capped, **enc))
    passed = transformers.GenerationConfig(max_new_tokens=2)
    with caplog.at_level(logging.WARNING, logger="specdec"):  # the model's own max_length: no warning
        assert torch.equal(specdec.generate(capped, **enc, generation_config=passed),
                           hf(capped, **enc, generation_config=passed))
    assert "takes precedence" not in caplog.text
    # lists: the longest row is the input length
    assert [len(r) for r in specdec.generate(model, [[1, 2, 3], [4]], max_length=6)] == [6, 4]
    with pytest.raises(ValueError, match="max_length"):
        hf(model, **enc, max_length=width)
    with pytest.raises(InputError, match=rf"max_length={width} \(from keyword argument\) leaves no room"):
        specdec.generate(model, **enc, max_length=width)


def test_max_length_counts_the_padding_when_every_row_is_padded():
    """The one row has 2 pad positions: max_length=6 over its width 4 leaves 2 new tokens, not 6 - 2 = 4."""
    model = _shared_model()
    ids, mask = torch.tensor([[0, 0, 3, 4]]), torch.tensor([[0, 0, 1, 1]])
    out = specdec.generate(model, ids, attention_mask=mask, max_length=6)
    assert out.shape == (1, 6)
    assert torch.equal(out, hf(model, ids, attention_mask=mask, max_length=6, do_sample=False))


def test_processors_that_leave_no_token_stop_with_an_error_where_transformers_greedy_emits_token_0():
    """Documented difference: no_repeat_ngram_size=1 over an 8-token vocabulary bans every token by the 7th new
    one; transformers' greedy search then emits token 0 (the argmax of all -inf), specdec stops with a one-line
    InvalidLogitsError. The tokens before agree."""
    model = build_tiny_model(vocab_size=8, seed=0)
    ids = torch.tensor([[1, 2]])
    want = hf(model, ids, max_new_tokens=9, do_sample=False, no_repeat_ngram_size=1)
    assert want[0, -3:].tolist() == [0, 0, 0]  # 0 repeated: no_repeat_ngram_size broken
    with pytest.raises(InvalidLogitsError, match=r"sequence 0, step \d+, new token 7: the target's logits leave no "
                                                 r"token") as info:
        specdec.generate(model, ids, max_new_tokens=9, no_repeat_ngram_size=1)
    assert "\n" not in str(info.value)
    assert torch.equal(specdec.generate(model, ids, max_new_tokens=6, no_repeat_ngram_size=1), want[:, :8])
