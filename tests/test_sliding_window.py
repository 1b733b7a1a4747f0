"""Sliding-window models (a tiny Mistral with a 16-token window): inside the window specdec's full attention is
the model's windowed attention, so greedy output equals transformers' generate(), up to the window plus the last new
token (which nothing attends from); past it the two differ, so the request is refused with a message that names the
window."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

import specdec
from specdec.errors import InputError
from specdec.models.llama import LlamaRunner, UnsupportedModelError, sliding_window
from specdec.testing import build_tiny_model

WINDOW = 16


@pytest.fixture(scope="module")
def mistral():
    return build_tiny_model("mistral", vocab_size=64, sliding_window=WINDOW)


def test_the_window_is_the_runner_limit(mistral):
    shape = LlamaRunner(mistral).shape
    assert shape.sliding_window == WINDOW and shape.max_positions == WINDOW + 1
    plain = LlamaRunner(build_tiny_model("mistral", vocab_size=64)).shape  # sliding_window=None: the context
    assert plain.sliding_window is None and plain.max_positions == 512


def test_the_window_changes_the_model_past_it(mistral):
    """Why specdec must stop at the window: transformers' windowed attention and full attention agree on the
    first WINDOW positions and differ after them."""
    ids = torch.randint(1, 64, (1, WINDOW + 8), generator=torch.Generator().manual_seed(0))
    full = build_tiny_model("mistral", vocab_size=64)  # the same weights (same seed), no window
    with torch.no_grad():
        windowed_logits, full_logits = mistral(ids).logits[0], full(ids).logits[0]
    torch.testing.assert_close(windowed_logits[:WINDOW], full_logits[:WINDOW], rtol=1e-4, atol=1e-4)
    assert (windowed_logits[WINDOW:] - full_logits[WINDOW:]).abs().amax() > 1e-2


@pytest.mark.parametrize("total", [WINDOW - 1, WINDOW, WINDOW + 1])
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_greedy_equals_transformers_inside_the_window(drafter, total, device):
    """Up to the window plus one token: the last new token is attended from by nothing, so every query of a
    sequence of WINDOW + 1 tokens still sees its whole prefix (it was refused, one token short of the limit)."""
    model = build_tiny_model("mistral", vocab_size=64, sliding_window=WINDOW).to(device)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11]]
    new = total - len(prompts[0])  # the longest prompt + its answer: `total` tokens
    options = dict(drafter=drafter, speculation="always") if drafter else {}
    out = specdec.generate(model, prompts, max_new_tokens=new, **options)
    for prompt, seq in zip(prompts, out, strict=True):
        ref = model.generate(torch.tensor([prompt], device=device), max_new_tokens=new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device))
        assert seq == ref[0].tolist()


def test_past_the_window_is_refused_before_generating(mistral):
    streamed = []
    with pytest.raises(InputError, match=f"sliding window of {WINDOW} tokens"):
        specdec.generate(mistral, [[5, 6, 7, 8, 5, 6, 7]], max_new_tokens=WINDOW - 5,
                         streamer=lambda i, toks: streamed.append(toks))
    assert not streamed


def test_the_message_names_the_window(mistral):
    shape = LlamaRunner(mistral).shape
    shape.check_fits(7, WINDOW + 1 - 7)  # fits exactly
    with pytest.raises(InputError, match=rf"prompt \(7 tokens\) \+ max_new_tokens \(11\) exceeds the model's "
                                         rf"sliding window of {WINDOW} tokens plus the last new token "
                                         rf"\({WINDOW + 1} in all\) \(config\.sliding_window\)"):
        shape.check_fits(7, 11)
    with pytest.raises(InputError, match=r"max_new_tokens \(11, set by max_length from kwargs\) exceeds .*sliding.*"
                                         r"lower max_length$"):
        shape.check_fits(7, 11, ", set by max_length from kwargs", "max_length")
    short = LlamaRunner(build_tiny_model("mistral", vocab_size=64, max_position_embeddings=12,
                                         sliding_window=WINDOW)).shape
    assert short.max_positions == 12  # a context shorter than the window is the limit, and named as such
    with pytest.raises(InputError, match="exceeds the model's context of 12 tokens") as err:
        short.check_fits(7, 10)
    assert "sliding" not in str(err.value)


@pytest.mark.parametrize("config, window", [
    (MistralConfig(sliding_window=WINDOW), WINDOW),
    (MistralConfig(sliding_window=None), None),
    (Qwen2Config(sliding_window=WINDOW), None),  # use_sliding_window defaults to False
    (Qwen2Config(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1, num_hidden_layers=2), WINDOW),
    (Qwen2Config(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2, num_hidden_layers=2), None),
    # transformers' Mistral windows every layer whatever layer_types / use_sliding_window say; a Llama config's
    # stray key is a window too (transformers' cache keeps only the window while decoding, not in the prefill)
    (MistralConfig(sliding_window=WINDOW, layer_types=["full_attention"] * 2, num_hidden_layers=2), WINDOW),
    (MistralConfig(sliding_window=WINDOW, use_sliding_window=False), WINDOW),
    (LlamaConfig(sliding_window=WINDOW), WINDOW),
    (LlamaConfig(sliding_window=WINDOW, use_sliding_window=False), WINDOW),  # a key transformers' Llama never reads
    # transformers 4's Qwen configs: no layer_types, use_sliding_window decides
    (SimpleNamespace(model_type="qwen3", sliding_window=WINDOW, layer_types=None, use_sliding_window=False), None),
    (SimpleNamespace(model_type="qwen3", sliding_window=WINDOW, layer_types=None, use_sliding_window=True), WINDOW),
])
def test_which_configs_have_a_window(config, window):
    assert sliding_window(config) == window


def test_sliding_layers_with_a_window_of_0_are_refused():
    """A window of 0 is no window for transformers either: its sliding_attention layers are refused, not run as full
    attention."""
    config = SimpleNamespace(model_type="qwen2", sliding_window=0, layer_types=["sliding_attention"])
    with pytest.raises(UnsupportedModelError, match=r"^config\.layer_types has sliding_attention layers but "
                                                    r"config\.sliding_window is 0 "):
        sliding_window(config)


@pytest.mark.parametrize("model_type, extra", [
    ("mistral", {"layer_types": ["full_attention"] * 2}), ("mistral", {"use_sliding_window": False}),
    ("llama-gqa-tied", {"use_sliding_window": False}),
], ids=["mistral-layer-types", "mistral-no-flag", "llama-no-flag"])
def test_past_the_window_it_is_refused_or_transformers_tokens(model_type, extra):
    """Past the window specdec either refuses or gives transformers' greedy tokens: a Mistral config that also
    carried layer_types or use_sliding_window=False ran full attention there (other tokens than transformers', which
    windows every Mistral layer), and so did a Llama config with stray sliding_window and use_sliding_window=False
    keys (transformers' Llama reads no use_sliding_window: its cache keeps only the window while decoding)."""
    model = build_tiny_model(model_type, vocab_size=64, sliding_window=WINDOW, **extra)
    prompt = [(7 * i) % 60 + 1 for i in range(WINDOW + 5)]
    ids = torch.tensor([prompt])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                          pad_token_id=0)[0, len(prompt):].tolist()
    try:
        got = specdec.generate(model, [prompt], max_new_tokens=8)[0][len(prompt):]
    except InputError as err:
        assert "sliding window" in str(err)
    else:
        assert got == want


@pytest.mark.parametrize("variant, extra", [
    ("qwen3-qknorm", {}), ("qwen2-bias", {"use_sliding_window": False}), ("llama-gqa-tied", {"sliding_window": None}),
])
def test_sliding_layers_without_a_window_are_refused_in_one_line(variant, extra):
    """layer_types naming sliding_attention layers while sliding_window is None (Qwen2 / Qwen3 null it unless
    use_sliding_window is true) is a model transformers cannot run (its mask and its cache need the window):
    specdec ran those layers with full attention and returned tokens no transformers model gives."""
    fields = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"], **extra}
    model = build_tiny_model(variant, vocab_size=64, **fields)
    assert model.config.sliding_window is None
    with pytest.raises(UnsupportedModelError, match=r"^config\.layer_types has sliding_attention layers but "
                                                    r"config\.sliding_window is None \(.*\): transformers cannot "
                                                    r"run such a layer; set sliding_window, or make those layers "
                                                    r"full_attention$"):
        specdec.generate(model, [[5, 6, 7]], max_new_tokens=4)


def test_the_eval_commands_name_the_window_too(mistral):
    """eval acceptance's prompt check and eval lossless's --identity-tokens check said "context" for a window."""
    from types import SimpleNamespace

    from specdec.eval.cli import _check_identity_fits
    from specdec.eval.conversations import check_prompts_fit
    from specdec.eval.prompt_files import Conversation

    loaded = SimpleNamespace(runner=LlamaRunner(mistral))
    chat = [Conversation("chat", ("hi",), where="p.jsonl:1")]
    window = rf"sliding window of {WINDOW} tokens plus the last new token \({WINDOW + 1} in all\)"
    with pytest.raises(InputError, match=rf"exceed the model's {window}; lower --max-new-tokens to 7 or less"):
        check_prompts_fit(loaded, chat, {0: [5] * 10}, 1, 8)
    with pytest.raises(InputError, match=rf"exceed the model's {window}; lower --identity-tokens to 7 or less$"):
        _check_identity_fits(loaded, [[5] * 10], 8)
    with pytest.raises(InputError, match=rf"exceed the model's {window}; the prompt alone fills it$"):
        _check_identity_fits(loaded, [[5] * (WINDOW + 1)], 1)


def test_the_commands_context_checks_say_it_in_one_wording(mistral):
    """train's answers, eval lossless's identity answers and eval acceptance's conversation prompts were each refused
    in words of their own ("--identity-tokens 8: identity prompt 0 (10 tokens) + 8 new tokens exceeds ...; lower it
    to 7" beside "p.jsonl:1: its 10 tokens + --max-new-tokens 8 exceed ...; lower --max-new-tokens to 7"); one
    wording now, each with its prompt, its option and its other way out."""
    from types import SimpleNamespace

    from specdec.eval.cli import _check_identity_fits
    from specdec.eval.conversations import check_prompts_fit
    from specdec.eval.prompt_files import Conversation
    from specdec.train.pipeline import _check_answers_fit

    runner = LlamaRunner(mistral)
    window = f"sliding window of {WINDOW} tokens plus the last new token ({WINDOW + 1} in all)"
    said = []
    for check in (lambda: _check_answers_fit(runner.shape, [3, 10], 8),
                  lambda: _check_identity_fits(SimpleNamespace(runner=runner), [[5] * 10], 8),
                  lambda: check_prompts_fit(SimpleNamespace(runner=runner),
                                            [Conversation("chat", ("hi",), where="p.jsonl:1")], {0: [5] * 10}, 1, 8)):
        with pytest.raises(InputError) as err:
            check()
        said.append(str(err.value))
    assert said == [f"{prompt}: its 10 tokens + {flag} 8 exceed the model's {window}; lower {flag} to 7 or less{more}"
                    for prompt, flag, more in (("the longest prompt", "--distill-max-new-tokens", ""),
                                               ("identity prompt 0", "--identity-tokens", ""),
                                               ("p.jsonl:1", "--max-new-tokens", ", or leave it out of the file"))]
