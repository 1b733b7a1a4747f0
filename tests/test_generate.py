"""generate(): plain decoding is exactly transformers' decoding; inputs, stops and errors."""
from __future__ import annotations

import pytest
import torch
from scipy import stats

import specdec
from specdec.kv_cache import CacheFullError
from specdec.models.llama import UnsupportedModelError
from specdec.testing import build_tiny_model


def hf_greedy(model, prompt, n):
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0].tolist()


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [10, 20, 30, 40, 50, 60, 70, 80, 90, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21, 22], [5, 5]]


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "llama-mha-untied", "qwen3-qknorm", "llama3-rope", "qwen2-bias"])
def test_greedy_matches_transformers_single_and_batched(variant):
    model = build_tiny_model(variant)
    refs = [hf_greedy(model, p, 40) for p in PROMPTS]
    batched = specdec.generate(model, PROMPTS, max_new_tokens=40)
    assert batched == refs
    for p, ref in zip(PROMPTS, refs):
        assert specdec.generate(model, [p], max_new_tokens=40, block_size=3)[0] == ref


def test_tensor_input_with_left_padding():
    model = build_tiny_model()
    ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=6)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 11)
    assert out[0, :9].tolist() == hf_greedy(model, [3, 4, 5], 6)
    assert out[1].tolist() == hf_greedy(model, [6, 7, 8, 9, 10], 6)


def test_eos_and_stop_sequences_end_generation():
    model = build_tiny_model()
    free = specdec.generate(model, [PROMPTS[0]], max_new_tokens=30)[0][len(PROMPTS[0]):]
    eos = free[5]
    first = free.index(eos)
    out = specdec.generate(model, [PROMPTS[0]], max_new_tokens=30, eos_token_id=eos, return_dict=True)
    assert out.new_tokens[0] == free[: first + 1] and out.stats[0].finish_reason == "eos"
    stop_seq = free[7:9]
    out = specdec.generate(model, [PROMPTS[0]], max_new_tokens=30, stop=[stop_seq], return_dict=True)
    end = next(i for i in range(1, 30) if free[i - 1 : i + 1] == stop_seq) + 1
    assert out.new_tokens[0] == free[:end] and out.stats[0].finish_reason == "stop"


def test_streamer_sees_every_token_in_order():
    model = build_tiny_model()
    seen: dict[int, list[int]] = {0: [], 1: []}
    out = specdec.generate(model, PROMPTS[:2], max_new_tokens=12, streamer=lambda i, t: seen[i].extend(t),
                           return_dict=True)
    assert seen[0] == out.new_tokens[0] and seen[1] == out.new_tokens[1]
    assert out.stats[0].steps == 12 and out.stats[0].tau == 1.0


def test_sampling_first_token_follows_target_distribution():
    model = build_tiny_model(vocab_size=16)
    prompt = [1, 2, 3]
    n = 4000
    out = specdec.generate(model, [prompt] * n, max_new_tokens=1, do_sample=True, temperature=1.3, seed=0)
    counts = torch.bincount(torch.tensor([o[-1] for o in out]), minlength=16).double()
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / 1.3, -1)
    _, p = stats.chisquare(counts.numpy(), (probs * n).numpy())
    assert p > 1e-3, p
    # a wrong temperature must be detected by the same test (the test can fail)
    wrong = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double().detach(), -1)
    _, p_wrong = stats.chisquare(counts.numpy(), (wrong * n).numpy())
    assert p_wrong < 1e-6


def test_seed_makes_sampling_reproducible():
    model = build_tiny_model()
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
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(drafter="no-such-drafter"), "unknown drafter"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
    model = build_tiny_model()
    kwargs = {"input_ids": [[1, 2, 3]], **kwargs}
    with pytest.raises(ValueError, match=match):
        specdec.generate(model, kwargs.pop("input_ids"), **kwargs)


def test_unknown_model_and_architecture():
    with pytest.raises(FileNotFoundError, match="unknown model"):
        specdec.generate("/no/such/model", [[1]])
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="supported"):
        specdec.generate(gpt2, [[1]])


def test_cache_out_of_blocks_is_clear():
    model = build_tiny_model()
    with pytest.raises(CacheFullError, match="num_blocks"):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=40, block_size=4, num_blocks=2)


def test_checkpoint_directory_roundtrip(tmp_path):
    model = build_tiny_model("llama-mha-untied")
    model.save_pretrained(tmp_path)
    ref = specdec.generate(model, [PROMPTS[0]], max_new_tokens=8)
    assert specdec.generate(str(tmp_path), [PROMPTS[0]], max_new_tokens=8) == ref
