"""generate()'s argument checks (issue 24, items 4 and 9), on a tiny model.

Every accepted form of ``input_ids`` / ``attention_mask`` gives the same output as the plain list;
every wrong argument is a one-line ``InputError`` / ``InputTypeError`` (``specdec.errors``) naming
it, raised before the model loads where no model is needed; a KV cache that cannot fit in memory
is refused before it is allocated; ``draft-model`` without ``model=`` loads nothing. The
hypothesis properties: any combination of (good and bad) arguments either works or raises a
``SpecdecError`` with a one-line message, never another exception.
"""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec
import specdec.kv_cache as kv_cache
from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.kv_cache import CacheFullError, PagedKVCache, cache_bytes
from specdec.testing import build_tiny_model

VOCAB = 96


@functools.lru_cache(maxsize=1)
def _model():
    return build_tiny_model(vocab_size=VOCAB)


_DEFAULT = object()


def _gen(input_ids=_DEFAULT, **kwargs):
    kwargs.setdefault("max_new_tokens", 3)
    return specdec.generate(_model(), [[1, 2, 3]] if input_ids is _DEFAULT else input_ids, **kwargs)


def _one_line_error(error: type[Exception], match: str, **kwargs) -> str:
    with pytest.raises(error, match=match) as info:
        _gen(**kwargs)
    message = str(info.value)
    assert isinstance(info.value, SpecdecError) and "\n" not in message, repr(message)
    # not raised while another error was handled: Python would print both ("During handling of the above ...")
    assert info.value.__context__ is None or info.value.__suppress_context__, repr(info.value.__context__)
    return message


# ---- input_ids -------------------------------------------------------------------------------
@pytest.mark.parametrize("form", [
    torch.tensor([[1, 2, 3]]), torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.uint8),
    np.array([[1, 2, 3]]), np.array([1, 2, 3], dtype=np.int32), np.array([1, 2, 3], dtype=np.uint16),
    [np.int64(1), np.int32(2), np.int64(3)], [[np.int64(1), 2, 3]], [torch.tensor(1), torch.tensor(2), 3],
    (1, 2, 3), [np.array([1, 2, 3])], [torch.tensor([1, 2, 3])],
], ids=lambda f: type(f).__name__)
def test_every_integer_form_of_input_ids_gives_the_same_tokens(form):
    want = _gen([[1, 2, 3]])[0]
    out = _gen(form)
    got = out[0].tolist() if isinstance(out, torch.Tensor) else out[0]
    assert got == want


@pytest.mark.parametrize("bad, error, match", [
    (torch.tensor([[1.0, 2.0]]), InputTypeError, r"input_ids .*float32 tensor"),
    (torch.tensor([[True, False]]), InputTypeError, r"input_ids .*bool tensor"),
    (torch.tensor([[1 + 0j]]), InputTypeError, r"input_ids .*complex"),
    (torch.tensor(3), InputTypeError, r"input_ids .*0-D"),
    (torch.ones(1, 1, 2, dtype=torch.long), InputTypeError, r"input_ids .*3-D"),
    (np.array([1.0, 2.0]), InputTypeError, r"input_ids .*numpy float64"),
    (np.array([True]), InputTypeError, r"input_ids .*numpy bool"),
    (np.array(3), InputTypeError, r"input_ids .*0-D numpy"),
    (np.ones((1, 1, 2), dtype=np.int64), InputTypeError, r"input_ids .*3-D numpy"),
    (np.array([[1, "a"]], dtype=object), InputTypeError, r"input_ids .*object"),
    ("hello", InputTypeError, r"input_ids .*str 'hello'"),
    # text where token ids belong (a pipeline's habit): the error says to tokenize it, and how
    ("hello", InputTypeError, r"got text str 'hello': tokenize it first, .*loaded.tokenizer\(texts, return_tensors"),
    (["a", "b"], InputTypeError, r"got text list .*: tokenize it first"),
    (b"hi", InputTypeError, r"input_ids .*bytes"),
    (None, InputTypeError, r"input_ids .*NoneType"),
    (3, InputTypeError, r"input_ids .*int 3"),
    ([[1, 2.0]], InputTypeError, r"input_ids\[0\]\[1\] must be an int token id, got float 2.0"),
    ([1, 2.5], InputTypeError, r"input_ids .*input_ids\[0\] is int 1"),  # a float in a flat list
    ([[True, 1]], InputTypeError, r"input_ids\[0\]\[0\] .*bool True"),
    ([[[1]]], InputTypeError, r"input_ids\[0\]\[0\] .*list"),
    ([[1], "ab"], InputTypeError, r"input_ids\[1\] is str"),
    ([torch.tensor([1.0])], InputTypeError, r"input_ids\[0\] .*float32"),
    ({"ids": [1, 2]}, InputError, r"input_ids is a mapping without an 'input_ids' key"),
    ({"input_ids": [1, 2], "pixel_values": [0.5]}, InputError, r"keys specdec does not use: \['pixel_values'\]"),
    ([], InputError, "no prompt"),
    (torch.zeros(0, 3, dtype=torch.long), InputError, "no prompt"),
    ([[1, 2], []], InputError, "prompt 1 is empty"),
    ([[1, 2, 500]], InputError, r"input_ids.*outside the vocabulary \[0, 96\): \[500\]"),
    ([[1, 2, 96]], InputError, r"input_ids.*outside the vocabulary \[0, 96\): \[96\]"),  # ids 0..95 exist
    (np.array([[1, -1]]), InputError, r"outside the vocabulary .*\[-1\]"),
])
def test_bad_input_ids_is_a_one_line_error(bad, error, match):
    _one_line_error(error, match, input_ids=bad)


@pytest.mark.parametrize("argument, value", [
    ("input_ids", torch.tensor([[1, 2, 3]], device="meta")),
    ("input_ids", torch.tensor([[1, 2, 3]]).to_sparse()),
    ("input_ids", [torch.tensor([1, 2, 3], device="meta")]),
    ("attention_mask", torch.ones(1, 3, dtype=torch.long, device="meta")),
    ("attention_mask", torch.ones(1, 3, dtype=torch.long).to_sparse()),
    ("eos_token_id", torch.tensor([3], device="meta")),
], ids=["meta-ids", "sparse-ids", "meta-row", "meta-mask", "sparse-mask", "meta-eos"])
def test_a_tensor_whose_values_cannot_be_read_is_a_one_line_error(argument, value):
    """A meta tensor (made under torch.set_default_device("meta")) or a sparse one has no values to read: torch's
    NotImplementedError / RuntimeError came out of generate()."""
    arguments = {"input_ids": torch.tensor([[1, 2, 3]]), argument: value}
    _one_line_error(InputTypeError, rf"^{argument}(\[0\])? is a (meta|sparse)", **arguments)


# ---- attention_mask ----------------------------------------------------------------------------
def test_attention_mask_of_another_shape_names_both_shapes():
    msg = _one_line_error(InputError, "shape of input_ids", input_ids=torch.tensor([[1, 2, 3]]),
                          attention_mask=torch.tensor([[1, 1]]))
    assert "(1, 3)" in msg and "(1, 2)" in msg


@pytest.mark.parametrize("ids, mask, error, match", [
    (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 1]]), InputError, r"only 0 and 1.*\[2\]"),
    (torch.tensor([[1, 2, 3]]), torch.tensor([[0.5, 1, 1]]), InputError, r"only 0 and 1"),
    (torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 1, 1], [0, 0, 0]]), InputError,
     r"prompt 1 is empty .*attention_mask"),
    (torch.tensor([[1, 2, 3]]), "111", InputTypeError, "attention_mask"),
    (torch.tensor([[1, 2, 3]]), torch.ones(1, 1, 3), InputTypeError, r"attention_mask .*3-D"),
    ([[1, 2, 3], [4, 5]], [[1, 1, 1], [1, 1, 1]], InputError, r"lengths \[3, 2\].*lengths \[3, 3\]"),
    ([[1, 2, 3]], [[1, 1]], InputError, "shape of input_ids"),
    ([1, 2, 3], [[1, 1, 1], [1, 1, 1]], InputError, "shape of input_ids"),
])
def test_bad_attention_mask_is_a_one_line_error(ids, mask, error, match):
    _one_line_error(error, match, input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("mask_of", [
    lambda m: m, lambda m: m.bool(), lambda m: m.float(), lambda m: m.numpy(), lambda m: m.tolist(),
], ids=["long", "bool", "float", "numpy", "list"])
def test_attention_mask_drops_padding_in_every_form(mask_of):
    """Left and right padding of a tensor, and a list input with a mask (it used to be ignored), give the
    ragged prompts' output."""
    ragged = [[5, 6, 7], [8, 9]]
    want = _gen(ragged, return_dict=True).new_tokens
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])  # row 1 left-padded
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    assert _gen(ids, attention_mask=mask_of(mask), return_dict=True).new_tokens == want
    assert _gen(ids.tolist(), attention_mask=mask_of(mask), return_dict=True).new_tokens == want
    assert _gen(ids.numpy(), attention_mask=mask_of(mask), return_dict=True).new_tokens == want


def test_ragged_lists_take_a_ragged_mask():
    """The mask drops the padding from the prompts; the result keeps each row as given (as transformers keeps a
    padded tensor's rows), so row[len(input row):] is the new tokens."""
    want = _gen([[5, 6, 7], [9]], return_dict=True).new_tokens
    out = _gen([[5, 6, 7, 0], [8, 9]], attention_mask=[[1, 1, 1, 0], [0, 1]])
    assert out == [[5, 6, 7, 0] + want[0], [8, 9] + want[1]]


def test_a_numpy_array_is_read_as_lists_are():
    """docs/python-api.md: a numpy array (transformers' generate() takes none) gives lists, and without a mask
    its pad ids are tokens; a tensor's are padding, as transformers infers them."""
    ids = np.array([[0, 0, 3, 4], [7, 8, 9, 10]])  # the pad id 0 (the model's) left-pads row 0
    assert _model().generation_config.pad_token_id == 0
    lists = _gen(ids.tolist())
    assert _gen(ids) == lists and isinstance(lists, list)
    unpadded = _gen(torch.tensor(ids)).tolist()
    assert unpadded == _gen(torch.tensor(ids), attention_mask=torch.tensor(ids != 0)).tolist()
    assert unpadded[0] != lists[0]  # the pads change row 0: read as tokens or not, the two are told apart


# ---- scalar arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_new_tokens=4.0), InputTypeError, r"max_new_tokens must be an int, got float 4.0"),
    (dict(max_new_tokens="4"), InputTypeError, r"max_new_tokens must be an int, got str '4'"),
    (dict(max_new_tokens=True), InputTypeError, r"max_new_tokens must be an int, got bool"),
    (dict(max_new_tokens=0), InputError, r"max_new_tokens must be >= 1, got 0"),
    (dict(max_new_tokens=1000), InputError, r"context of 512"),
    (dict(block_size=16.0), InputTypeError, r"block_size must be an int, got float"),
    (dict(block_size=0), InputError, r"block_size must be >= 1"),
    (dict(block_size="16"), InputTypeError, r"block_size"),
    (dict(num_blocks=8.0), InputTypeError, r"num_blocks must be an int or None, got float"),
    (dict(num_blocks=0), InputError, r"num_blocks must be >= 1"),
    (dict(num_blocks=False), InputTypeError, r"num_blocks .*bool"),
    (dict(do_sample=1), InputTypeError, r"do_sample must be True or False, got int 1"),
    # numpy's bool named as numpy's (it read "got bool np.True_", as if a bool were refused)
    (dict(do_sample=np.True_), InputTypeError,  # numpy 1.x (pyproject's floor 1.24) spells it numpy.bool_ True
     "do_sample must be True or False, got " + re.escape(f"numpy.{type(np.True_).__name__} {np.True_!r}")),
    (dict(do_sample="yes"), InputTypeError, r"do_sample"),
    (dict(temperature="1"), InputTypeError, r"temperature must be a number, got str"),
    (dict(temperature=float("nan")), InputError, r"temperature"),
    (dict(temperature=float("inf")), InputError, r"temperature must be a finite"),
    (dict(do_sample=True, temperature=0.0), InputError, r"temperature must be > 0 when sampling"),
    (dict(top_k=2.0), InputTypeError, r"top_k must be an int"),
    (dict(top_k=-1), InputError, r"top_k"),
    (dict(top_p="0.9"), InputTypeError, r"top_p must be a number"),  # None: off, as in transformers
    (dict(top_p=1.5), InputError, r"top_p must lie in"),
    (dict(seed=1.5), InputTypeError, r"seed must be an int or None, got float"),
    (dict(seed="1"), InputTypeError, r"seed"),
    (dict(seed=2**64), InputError, r"seed must be <="),
    (dict(generator=1), InputTypeError, r"generator must be a torch.Generator"),
    (dict(pad_token_id="x"), InputTypeError, r"pad_token_id must be an int or None, got str"),
    (dict(pad_token_id=1.0), InputTypeError, r"pad_token_id"),
    (dict(streamer=3), InputTypeError, r"streamer must be a callable .*, an object with put\(\) and end\(\) .* "
                                       r"or None, got int 3"),
    (dict(drafter="ngram", drafter_options=[("n", 2)]), InputTypeError, r"drafter_options must be a dict"),
    (dict(drafter="ngram", drafter_options="n=2"), InputTypeError, r"drafter_options"),
    (dict(cuda_graphs="yes"), InputTypeError, r"cuda_graphs must be a bool"),
    (dict(return_dict=1), InputTypeError, r"return_dict must be True or False, got int 1"),
    (dict(progress="yes"), InputTypeError, r"progress must be True or False"),
    (dict(audit_drafts=None), InputTypeError, r"audit_drafts must be True or False"),
    # the negative controls are not generate() arguments (eval.negative_controls.generate_with_control injects them)
    (dict(acceptance_rule="exact"), InputTypeError, r"unknown generation argument acceptance_rule; known: "),
    (dict(engine_fault="wrong_slot"), InputTypeError, r"unknown generation argument engine_fault"),
    (dict(max_new_token=3), InputTypeError,
     r"unknown generation argument max_new_token \(did you mean max_new_tokens\?\); known: .*max_new_tokens"),
    # from_pretrained's arguments, passed to generate() as to a loader: the error says where they go
    (dict(dtype=torch.bfloat16), InputTypeError, r"unknown generation argument dtype \(dtype: an argument of loading, "
     r"not of generation; load the model once with specdec.load_model\(model, dtype=...\) and pass what it returns "
     r"to generate\(\)\)$"),  # not followed by the ~95 generation arguments' names (1,800 characters)
    (dict(torch_dtype=torch.float16, device="cpu"), InputTypeError,
     r"arguments device, torch_dtype \(device, torch_dtype: .*specdec.load_model\(model, device=..., dtype=...\)"),
    (dict(generation_config={"max_new_tokens": 3}), InputTypeError,
     r"generation_config must be a specdec or transformers GenerationConfig"),
    (dict(drafter="no-such-drafter"), InputError, r"unknown drafter 'no-such-drafter'; available: .*ngram"),
    # generate()'s own keyword arguments misspelt: refused naming none meant, as they are no generation fields
    (dict(drafter_option={"max_nodes": 3}), InputTypeError,
     r"^unknown generation argument drafter_option \(did you mean drafter_options\?\); known: "),
    (dict(draft="ngram"), InputTypeError, r"^unknown generation argument draft \(did you mean drafter\?\)"),
    (dict(return_dicts=True), InputTypeError,
     r"^unknown generation argument return_dicts \(did you mean return_dict\?\)"),
    (dict(drafter=5), InputTypeError, r"drafter must be None, a name or a Drafter"),
    (dict(drafter="ngram", drafter_options={"bogus": 1}), InputTypeError,
     r"drafter 'ngram' has no option 'bogus'; its options: .*max_ngram"),
    (dict(drafter="self-draft", drafter_options={"bogus": 1, "layers": 2}), InputTypeError,
     r"drafter 'self-draft' has no option 'bogus', 'layers' \(did you mean 'num_layers'\?\); its options: "),
    (dict(drafter="mtp", drafter_options={"model": 1}), InputTypeError, r"drafter 'mtp' has no option 'model'"),
    (dict(eos_token_id=np.array([1.0])), InputTypeError, r"eos_token_id .*float64"),
    (dict(eos_token_id=np.array([[1]])), InputTypeError, r"eos_token_id"),
    (dict(eos_token_id=[1, "2"]), InputTypeError, r"eos_token_id"),
    # an AttributeError at the first stop check, after the model had loaded and prefilled
    (dict(tokenizer="not-a-tokenizer", stop=["ab"]), InputTypeError, r"tokenizer must be a tokenizer .*got str"),
    # options of the wrong type that failed mid-generation (beam=1.5: topk's TypeError), or were taken silently
    # (widths="3" as (3,), medusa rank 0.5 as 0, an infinite prior weight as NaN rates), or named no option
    (dict(drafter="self-draft", drafter_options={"num_layers": 1, "tree": "dynamic", "beam": 1.5}), InputTypeError,
     r"beam must be an int, got float 1.5"),
    (dict(drafter="self-draft", drafter_options={"num_layers": 1, "widths": "3"}), InputTypeError,
     r"widths must be a list of ints"),
    (dict(drafter="self-draft", drafter_options={"num_layers": 1, "max_nodes": True}), InputTypeError,
     r"max_nodes must be an int, got bool"),
    (dict(drafter="combined", drafter_options={"prior_weight": float("inf")}), InputError,
     r"prior_weight must be a finite number"),
    (dict(drafter="ngram", drafter_options={"config": {"max_nodes": 3}}), InputTypeError,
     r"config must be an NGramConfig, got dict"),
    (dict(drafter="mtp", drafter_options={"path": 5}), InputTypeError, r"mtp: path= must be a checkpoint directory"),
    # a bare ValueError from the engine's build with the drafter's default 4 layers on this 2-layer model
    (dict(drafter="self-draft"), InputError,  # a 2-layer target: one choice, not "from 1 to 1"
     r"self-draft: num_layers=4 must be below the target's 2 layers; give num_layers=1 \(on the command line "
     r"--drafter-option num_layers=1\)$"),
])
def test_bad_scalar_argument_is_a_one_line_error(kwargs, error, match):
    _one_line_error(error, match, **kwargs)


def test_model_inputs_transformers_passes_on_are_taken_as_none_and_refused_set():
    """past_key_values=None (generic code passing what it has) was an unknown argument, with "did you mean
    eos_token_id?"; transformers takes None as absent. Set, each is refused by name: specdec would not use it."""
    none = dict(past_key_values=None, inputs_embeds=None, position_ids=None, cache_position=None)
    assert _gen(**none) == _gen()
    for name in none:
        message = _one_line_error(InputError, rf"keyword argument sets {name}=", **{name: torch.zeros(1, 3)})
        assert "did you mean" not in message and "refuses it rather than ignore it" in message


def test_self_draft_on_a_one_layer_target_says_it_needs_two_layers():
    """It said "num_layers=1 must be below the target's 1 layers; give a num_layers option from 1 to 0": a range with
    no option in it (found by a fuzz sweep)."""
    one_layer = build_tiny_model(num_hidden_layers=1)
    with pytest.raises(InputError, match=r"^self-draft: the target has 1 layer; .* needs a target of 2") as info:
        specdec.generate(one_layer, [[1, 2, 3]], max_new_tokens=2, drafter="self-draft",
                         drafter_options={"num_layers": 1})
    assert "\n" not in str(info.value)


def test_numpy_integers_are_ints_for_the_scalar_arguments():
    assert _gen(max_new_tokens=np.int64(3), block_size=np.int32(4), seed=np.int64(1)) == _gen(block_size=4)
    eos = _gen()[0][3]
    assert _gen(eos_token_id=np.array([eos]), max_new_tokens=6) == [[1, 2, 3, eos]]


def test_argument_errors_come_before_the_model_is_loaded():
    with pytest.raises(InputTypeError, match="max_new_tokens"):
        specdec.generate("/no/such/model", [[1, 2]], max_new_tokens=4.0)
    with pytest.raises(InputTypeError, match="input_ids"):
        specdec.generate("/no/such/model", torch.tensor([[1.0]]))


# ---- stop ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop, error, match", [
    (5, InputTypeError, r"stop must be .*got int 5.*stop=\[\[5\]\].*eos_token_id=5"),
    ([5], InputTypeError, r"stop\[0\] is a bare token id \(5\): ambiguous; pass stop=\[\[5\]\]"),
    (["a", 5], InputTypeError, r"stop\[1\] is a bare token id"),
    ("", InputError, r"stop\[0\] is an empty string"),
    (["x", ""], InputError, r"stop\[1\] is an empty string"),
    ([[]], InputError, r"stop\[0\] is an empty token sequence"),
    ([torch.tensor([], dtype=torch.long)], InputError, r"empty token sequence"),
    ([[1, 2.0]], InputTypeError, r"stop\[0\] must be a string or a sequence of int token ids"),
    ([[1, 500]], InputError, r"stop.*outside the vocabulary"),
    ([[1, 96]], InputError, r"stop.*outside the vocabulary \[0, 96\): \[96\]"),  # the vocabulary's size
    (1.5, InputTypeError, r"stop must be"),
    ({"a": 1}, InputTypeError, r"stop must be"),
    (["ab"], InputError, r"stop strings need a tokenizer .*\['ab'\]"),
])
def test_bad_stop_is_a_one_line_error(stop, error, match):
    _one_line_error(error, match, stop=stop)


@pytest.mark.parametrize("form", [lambda t: [[t]], lambda t: [(t,)], lambda t: [torch.tensor([t])],
                                  lambda t: [np.array([t])]], ids=["list", "tuple", "tensor", "numpy"])
def test_token_stop_sequences_in_every_form(form):
    plain = _gen(max_new_tokens=8, return_dict=True).new_tokens[0]
    tok = plain[2]
    out = _gen(max_new_tokens=8, stop=form(tok), return_dict=True)
    assert out.new_tokens[0] == plain[: plain.index(tok) + 1] and out.stats[0].finish_reason == "stop"


# ---- KV cache size vs memory ---------------------------------------------------------------------
@pytest.mark.parametrize("layers, kv_heads, head_dim, blocks, block_size, dtype", [
    (2, 2, 16, 5, 4, torch.float32), (3, 1, 8, 2, 16, torch.float16), (1, 4, 32, 7, 1, torch.bfloat16),
])
def test_cache_bytes_is_what_the_cache_allocates(layers, kv_heads, head_dim, blocks, block_size, dtype):
    cache = PagedKVCache(layers, kv_heads, head_dim, blocks, block_size, dtype)
    assert cache_bytes(layers, kv_heads, head_dim, blocks, block_size, dtype) == cache.kv.nbytes


def test_available_memory_is_known_on_cpu():
    have = kv_cache.available_memory_bytes("cpu")
    assert have is not None and have > 0
    assert kv_cache.available_memory_bytes("meta") is None


def test_available_memory_reads_meminfo_in_kib(monkeypatch, tmp_path):
    """/proc/meminfo counts kB (KiB): MemAvailable 2048 kB is 2048 * 1024 = 2097152 bytes."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8192 kB\nMemFree:         1024 kB\nMemAvailable:    2048 kB\n")
    monkeypatch.setattr(kv_cache, "open", lambda path, *a, **kw: open(meminfo, *a, **kw), raising=False)
    assert kv_cache.available_memory_bytes("cpu") == 2097152


def test_num_blocks_beyond_memory_is_refused_before_allocating(monkeypatch):
    def no_alloc(*args, **kwargs):
        raise AssertionError("the cache was allocated")

    monkeypatch.setattr(PagedKVCache, "__init__", no_alloc)
    msg = _one_line_error(InputError, r"num_blocks=1000000000 .*needs [0-9.]+ GiB, but only [0-9.]+ GiB are "
                                      r"available on cpu: pass num_blocks <= \d+", num_blocks=10**9)
    need = 2 * 2 * 2 * 16 * 10**9 * 16 * 4 / 2**30  # tiny model: 2 layers, 2 KV heads, head_dim 16, float32
    assert f"{need:.2f} GiB" in msg


def test_a_block_beyond_memory_asks_for_a_smaller_block_size():
    _one_line_error(CacheFullError, r"needs [0-9.]+ GiB, .*not even one block of 10000000000000 tokens fits: pass "
                                    r"a smaller block_size", block_size=10**13)


def test_automatic_cache_size_beyond_memory_suggests_a_num_blocks_that_fits(monkeypatch):
    per_block = cache_bytes(2, 2, 16, 1, 16, torch.float32)
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: 40 * per_block)
    prompts = [[1, 2, 3]] * 8  # 8 x ceil((3 + 100 + tree budget + 1) / 16) blocks >> 40
    msg = _one_line_error(CacheFullError, r"this request's KV cache .*needs .*GiB, but only .*GiB are available "
                                          r"on cpu: .*num_blocks <= 40", input_ids=prompts, max_new_tokens=100)
    fits = int(re.search(r"num_blocks <= (\d+)", msg).group(1))
    assert len(_gen(prompts, max_new_tokens=2, num_blocks=fits)) == 8  # the suggestion is taken


# ---- draft-model without model= -------------------------------------------------------------------
def test_draft_model_without_model_loads_nothing(monkeypatch):
    import specdec.drafters.draft_model as draft_model

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(draft_model, "load_model", no_load)
    msg = _one_line_error(InputError, r"draft-model needs model=", drafter="draft-model")
    assert "vocabulary" in msg
    with pytest.raises(InputError, match="model="):
        draft_model.DraftModelDrafter(num_draft_tokens=3)
    with pytest.raises(InputError, match="model="):  # also before the target loads
        specdec.generate("/no/such/model", [[1, 2]], drafter="draft-model")


# ---- properties ------------------------------------------------------------------------------------
_ints = st.integers(-3, 110)
_bad_scalars = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
                         st.integers(-(2**70), 2**70), st.just([1]), st.just(object()))


def _as_array(rows, kind):
    if kind == "list":
        return rows
    data = np.array(rows, dtype=object) if len({len(r) for r in rows}) > 1 else np.array(rows)
    if kind == "numpy":
        return data
    try:
        return torch.tensor(data.tolist())
    except (TypeError, ValueError, RuntimeError):
        return rows


_rows = st.lists(st.lists(_ints, min_size=0, max_size=5), min_size=0, max_size=3)
_input_ids = st.one_of(
    st.builds(_as_array, _rows, st.sampled_from(["list", "numpy", "tensor"])),
    st.lists(_ints, max_size=4),
    st.lists(st.one_of(_ints, st.floats(0, 5), st.booleans(), st.text(max_size=2)), max_size=4),
    st.builds(lambda v, dt, shape: torch.full(shape, v).to(dt), st.integers(0, 5),
              st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float32, torch.bool]),
              st.sampled_from([(), (3,), (1, 3), (2, 2), (1, 1, 2), (0,), (1, 0)])),
    st.builds(lambda v, dt, shape: np.full(shape, v, dtype=dt), st.integers(0, 5),
              st.sampled_from([np.int64, np.uint8, np.float32, np.bool_]), st.sampled_from([(), (3,), (1, 2, 2)])),
    _bad_scalars,
)
_mask = st.one_of(st.none(), st.none(), st.lists(st.lists(st.sampled_from([0, 1, 2, True, 0.5]), max_size=5),
                                                 max_size=3), _bad_scalars)
_stop = st.one_of(st.none(), st.text(max_size=2), _ints, st.lists(_ints, max_size=2),
                  st.lists(st.lists(_ints, max_size=2), max_size=2), _bad_scalars)


def _mostly(good, bad=_bad_scalars):
    """A good value 9 times in 10, so that examples get past the first check and reach generation."""
    return st.integers(0, 9).flatmap(lambda i: bad if i == 9 else good)


def _int_or_bad(lo, hi):
    return _mostly(st.integers(lo, hi), st.one_of(_bad_scalars, st.integers(lo - 3, lo - 1)))


def _works_or_one_line_specdec_error(**kwargs):
    try:
        specdec.generate(_model(), **kwargs)
    except SpecdecError as err:
        assert "\n" not in str(err) and str(err), repr(str(err))
    # any other exception type propagates: the property fails with it


@st.composite
def _ids_and_mask(draw):
    """Half the time well-formed rows with a mask of their shape (0 / 1 values, some rows maybe all 0)."""
    if draw(st.booleans()):
        return draw(_input_ids), draw(_mask)
    rows = draw(st.lists(st.lists(_ints, min_size=1, max_size=5), min_size=1, max_size=3))
    kind = draw(st.sampled_from(["list", "numpy", "tensor"]))
    mask = [draw(st.lists(st.sampled_from([0, 1, 1, 1]), min_size=len(r), max_size=len(r))) for r in rows]
    return _as_array(rows, kind), draw(st.sampled_from([None, _as_array(mask, kind)]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids_and_mask=_ids_and_mask())
def test_any_input_ids_and_mask_work_or_raise_a_one_line_specdec_error(ids_and_mask):
    input_ids, attention_mask = ids_and_mask
    _works_or_one_line_specdec_error(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=2)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_new_tokens=_int_or_bad(1, 4), block_size=_int_or_bad(1, 8),
       num_blocks=_mostly(st.none(), st.one_of(_int_or_bad(1, 12), st.just(10**12))), stop=_mostly(st.none(), _stop),
       do_sample=_mostly(st.booleans()), temperature=_mostly(st.floats(0.1, 2)), top_k=_int_or_bad(0, 10),
       top_p=_mostly(st.floats(0.05, 1)), seed=_mostly(st.none(), _int_or_bad(0, 9)),
       pad_token_id=_mostly(st.none(), _int_or_bad(0, 5)),
       eos_token_id=_mostly(st.one_of(st.none(), _ints, st.lists(_ints, max_size=2))),
       streamer=_mostly(st.none(), st.just(3)),
       drafter=_mostly(st.sampled_from([None, "ngram"]), st.sampled_from(["no-such-drafter", 5, "draft-model"])))
def test_any_generate_arguments_work_or_raise_a_one_line_specdec_error(**kwargs):
    _works_or_one_line_specdec_error(input_ids=[[1, 2, 3], [4, 5]], **kwargs)


@settings(max_examples=25, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=3),
       left=st.booleans())
def test_padded_tensor_with_mask_equals_ragged_lists(prompts, left):
    width = max(len(p) for p in prompts)
    pad = [[7] * (width - len(p)) for p in prompts]
    ids = torch.tensor([q + p if left else p + q for p, q in zip(prompts, pad, strict=True)])
    mask = torch.tensor([[0] * len(q) + [1] * len(p) if left else [1] * len(p) + [0] * len(q)
                         for p, q in zip(prompts, pad, strict=True)])
    want = _gen(prompts, return_dict=True).new_tokens
    assert _gen(ids, attention_mask=mask, return_dict=True).new_tokens == want


def test_generation_config_is_the_default_and_keyword_arguments_win():
    from specdec.generation_config import GenerationConfig

    config = GenerationConfig(max_new_tokens=2, do_sample=True, seed=3)
    from_config = specdec.generate(_model(), [[1, 2, 3]], generation_config=config)
    assert len(from_config[0]) == 5 and from_config == _gen(max_new_tokens=2, do_sample=True, seed=3)
    assert _gen(generation_config=config, max_new_tokens=4) == _gen(max_new_tokens=4, do_sample=True, seed=3)
    assert config.update(top_k=5).top_k == 5 and config.top_k == 0  # frozen: update() returns a copy
    # the fields given (not the defaults) are the ones that override a model's generation_config
    assert config.fields_set == {"max_new_tokens", "do_sample", "seed"}
    assert config.update(top_k=5).fields_set == {"max_new_tokens", "do_sample", "seed", "top_k"}
    # a field the config already sets takes update()'s value (2 -> 4), the others stay
    changed = config.update(max_new_tokens=4)
    assert (changed.max_new_tokens, changed.do_sample, changed.seed) == (4, True, 3)
    assert GenerationConfig().fields_set == frozenset() and GenerationConfig(64).fields_set == {"max_new_tokens"}
    with pytest.raises(InputError, match="temperature must be > 0"):
        GenerationConfig(do_sample=True, temperature=0)


def test_negative_controls_enter_only_where_the_engine_is_built():
    from specdec.eval.negative_controls import BROKEN_RULES, generate_with_control

    from specdec.rejection import EXACT

    with pytest.raises(InputTypeError, match="rule must be an AcceptanceRule"):
        generate_with_control(_model(), [[1, 2]], "exact", max_new_tokens=2)
    with pytest.raises(InputTypeError, match="fault must be an EngineFault"):
        generate_with_control(_model(), [[1, 2]], EXACT, "wrong_slot", max_new_tokens=2)
    assert generate_with_control(_model(), [[1, 2, 3]], EXACT, max_new_tokens=3) == _gen(max_new_tokens=3)
    assert "always_accept" in BROKEN_RULES


def test_the_default_length_is_named_as_the_default_when_it_does_not_fit():
    """"lower max_new_tokens (128)" read as if the caller had passed 128: no length was set anywhere."""
    model = build_tiny_model(max_position_embeddings=64)
    model.generation_config.max_length = None
    with pytest.raises(InputError, match=r"max_new_tokens \(128, specdec's default: none was set\) exceeds"):
        specdec.generate(model, [[1, 2, 3]])
    with pytest.raises(InputError, match=r"max_new_tokens \(100\) exceeds"):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=100)
