"""The bit-exact mode (invariant=True) on tiny models: each row's logits of a batched verify forward are bitwise
those of a one-row forward at the same position, for 1-64 rows, random trees and ragged batches, in fp32 / bf16 /
fp16; speculative text and log-probabilities equal plain decoding's bit for bit with every drafter, greedy and
coupled, batched and alone; a deliberately row-dependent product is caught."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads
from specdec.eval import bitwise_level
from specdec.eval.certificate import CertificateSizes

import specdec
from specdec.errors import InputError, InputTypeError
from specdec.models import invariance_check as ic
from specdec.models import invariant_ops
from specdec.models.llama import LlamaRunner
from specdec.models.loader import load_model
from specdec.sampling import SamplingConfig
from specdec.testing import build_tiny_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VOCAB = 96


def _runner(dtype, variant="llama-gqa-tied", invariant=True):
    return LlamaRunner(build_tiny_model(variant, vocab_size=VOCAB).to(dtype), backend="reference").invariant_mode(
        invariant)


def _case(seed: int, prompt_lens, tree_sizes):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    return prompts, [ic.random_tree(n, VOCAB, gen) for n in tree_sizes]


def _mismatched_rows(runner, prompts, trees) -> int:
    batched, alone = ic.alone_logits(runner, prompts, trees)
    return sum(int((b != a).any(-1).sum()) for b, a in zip(batched, alone, strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_logits_do_not_depend_on_the_other_rows(dtype):
    runner = _runner(dtype)
    # forwards of 1 to 64 rows: a lone root, small and full trees, and ragged batches of trees and prompts
    for seed, prompt_lens, tree_sizes in ((0, [9], [0]), (1, [4], [1]), (2, [30], [63]), (3, [5, 23, 40], [7, 30, 12]),
                                          (4, [2, 17], [20, 0])):
        prompts, trees = _case(seed, prompt_lens, tree_sizes)
        assert _mismatched_rows(runner, prompts, trees) == 0, (dtype, seed)


@pytest.mark.parametrize("variant", ["qwen3-qknorm", "llama-mqa-bias", "llama3-rope"])
def test_row_invariance_holds_for_other_layer_variants(variant):
    prompts, trees = _case(5, [6, 19], [11, 5])
    assert _mismatched_rows(_runner(torch.bfloat16, variant), prompts, trees) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_verify_rows_equal_plain_decoding_along_their_path(dtype):
    """The prompt prefilled alone and the path decoded one token per forward: what plain decoding computes."""
    runner = _runner(dtype)
    prompts, trees = _case(6, [7, 12], [5, 3])
    batched = ic.batched_tree_logits(runner, prompts, trees)
    for p, tree, got in zip(prompts, trees, batched, strict=True):
        assert torch.equal(got, ic.decoded_logits(runner, p, tree))


def test_a_row_dependent_product_is_caught(monkeypatch):
    """The check can fail: a product whose last bits depend on the row count (as BLAS kernels chosen by row
    count do) makes rows of a tree differ from the same rows alone."""
    runner = _runner(torch.float32)
    prompts, trees = _case(7, [6], [9])
    honest = invariant_ops.linear

    def row_dependent(x, weight, bias=None, backend=None):
        out = honest(x, weight, bias, backend)
        return out * (1 + 1e-6 * (x.shape[0] > 1))

    monkeypatch.setattr(invariant_ops, "linear", row_dependent)
    assert _mismatched_rows(runner, prompts, trees) > 0


def test_the_default_path_is_not_row_invariant_in_fp32():
    """What the mode is for: the default path's rows move with the row count (BLAS picks by it)."""
    prompts, trees = _case(3, [5, 23, 40], [7, 30, 12])
    assert _mismatched_rows(_runner(torch.float32, invariant=False), prompts, trees) > 0


def test_the_reference_rope_table_matches_the_runner_rope():
    model = build_tiny_model()
    runner = LlamaRunner(model, backend="reference")
    positions = torch.tensor([0, 5, 1023, 1024, 3000])
    table = invariant_ops.RopeTable(runner.rotary.inv_freq, runner.attention_scaling, runner.dtype)
    cos, sin = table(positions, 3000)
    want_cos, want_sin = runner.rope(positions)
    assert torch.allclose(cos, want_cos, atol=1e-5) and torch.allclose(sin, want_sin, atol=1e-5)


def test_the_kernel_key_table_lists_the_reference_keys():
    """The Triton path's per-row key table (built on the device) holds each row's keys as the reference lists them."""
    from specdec.attention import AttentionPlan, SeqAttention

    gen = torch.Generator().manual_seed(8)
    tree = ic.random_tree(12, VOCAB, gen)
    bits = torch.tensor([0] + tree.ancestor_bit_list, dtype=torch.long)
    seqs = (SeqAttention(0, 13, torch.randperm(40, generator=gen)[:20 + 13], 21, bits),  # a tree after 21 keys
            SeqAttention(13, 5, torch.arange(100, 105), 0),  # a prefill
            SeqAttention(18, 1, torch.arange(200, 230), 29))  # a decode step
    plan = AttentionPlan(seqs)
    slots, lens = plan.invariant_rows
    listed = [keys for seq_keys, _ in plan.invariant_row_keys for keys in seq_keys]
    assert lens.tolist() == [k.numel() for k in listed]
    for row, keys in enumerate(listed):
        assert torch.equal(slots[row, : keys.numel()], keys)



def test_a_lone_causal_runs_key_table_is_a_view_of_its_key_slots():
    """A prompt's prefill (and a decode step of one sequence): each row's keys are a prefix of the sequence's, so the
    Triton path's key table is its key slots, every row the same, not a [prompt, prompt] int64 copy (2 GiB at a
    16k-token prompt, in the bit-exact mode's one-forward prefill); the rows list the reference's keys."""
    from specdec.attention import AttentionPlan, SeqAttention

    n = 3000
    key_slots = torch.randperm(4000, generator=torch.Generator().manual_seed(9))[:n]
    for seq in (SeqAttention(0, n, key_slots, 0), SeqAttention(0, 1, key_slots, n - 1)):  # a prefill, a decode step
        plan = AttentionPlan((seq,))
        slots, lens = plan.invariant_rows
        assert slots.shape == (seq.num_new, n)
        assert slots.untyped_storage().nbytes() <= key_slots.untyped_storage().nbytes()
        listed = [keys for seq_keys, _ in plan.invariant_row_keys for keys in seq_keys]
        assert lens.tolist() == [k.numel() for k in listed]
        for row in sorted({0, seq.num_new // 2, seq.num_new - 1}):
            assert torch.equal(slots[row, : int(lens[row])], listed[row])

# ---- generate(): speculative == plain, bit for bit ------------------------------------------------------------
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 8], [10, 20, 30, 10, 20, 30, 10, 20], [5, 5, 5, 5]]


def _eagle(model):
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config, draft_vocab=tuple(range(0, VOCAB, 2))))
    eagle.init_from_target(model)
    return EagleDrafter(model=eagle.to(model.dtype), depth=3, top_k=3, max_nodes=8)


def _medusa(model):
    heads = MedusaHeads(MedusaConfig(3, 1, model.config.hidden_size, model.config.vocab_size))
    heads.init_lm_heads_from(model.get_output_embeddings().weight.detach().float())
    return MedusaDrafter(heads=heads.to(model.dtype))


DRAFTERS = {
    "ngram": lambda m: ("ngram", {}),
    "draft-model": lambda m: ("draft-model", {"model": build_tiny_model(seed=1).to(m.dtype), "widths": (2, 2)}),
    "self-draft": lambda m: ("self-draft", {"num_layers": 1}),
    "medusa": lambda m: (_medusa(m), {}),
    "eagle": lambda m: (_eagle(m), {}),
}
SETTINGS = {"greedy": {}, "coupled": dict(do_sample=True, temperature=0.8, seed=3, sampler="coupled"),
            "coupled-warpers": dict(do_sample=True, temperature=0.8, top_p=0.95, min_p=0.02, typical_p=0.95,
                                    eta_cutoff=2e-3, top_h=0.95, seed=3, sampler="coupled")}


@pytest.fixture(scope="module")
def bf16_model():
    return build_tiny_model().to(torch.bfloat16)


@pytest.fixture(scope="module")
def plain(bf16_model):
    """Plain decoding in the mode, each prompt alone: (tokens, log-probabilities) per setting."""
    out = {}
    for name, extra in SETTINGS.items():
        runs = [specdec.generate(bf16_model, [p], max_new_tokens=24, invariant=True, output_logprobs=True,
                                 return_dict=True, **extra) for p in PROMPTS]
        out[name] = ([r.new_tokens[0] for r in runs], [r.logprobs[0] for r in runs])
    return out


# n-gram and self-draft in the default run; the model drafters (a second forward per step) in the slow one
@pytest.mark.parametrize("name", [n if n in ("ngram", "self-draft") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in DRAFTERS])
def test_speculative_output_is_plain_output_bit_for_bit(bf16_model, plain, name):
    for setting, extra in SETTINGS.items():
        want_tokens, want_logprobs = plain[setting]
        drafter, options = DRAFTERS[name](bf16_model)
        batched = specdec.generate(bf16_model, PROMPTS, drafter=drafter, drafter_options=options or None,
                                   max_new_tokens=24, speculation="always", invariant=True, output_logprobs=True,
                                   return_dict=True, **extra)
        assert batched.new_tokens == want_tokens, (name, setting)
        assert batched.logprobs == want_logprobs, (name, setting)  # floats compared exactly
        assert batched.forward_passes < sum(len(t) for t in want_tokens), "nothing was speculated"
        drafter, options = DRAFTERS[name](bf16_model)
        alone = specdec.generate(bf16_model, [PROMPTS[2]], drafter=drafter, drafter_options=options or None,
                                 max_new_tokens=24, speculation="always", invariant=True, output_logprobs=True,
                                 return_dict=True, **extra)
        assert (alone.new_tokens[0], alone.logprobs[0]) == (want_tokens[2], want_logprobs[2]), (name, setting)


def test_invariant_is_a_checked_config_field():
    model = build_tiny_model()
    with pytest.raises(InputTypeError, match="invariant"):
        specdec.generate(model, [PROMPTS[0]], max_new_tokens=2, invariant="yes")
    with pytest.raises(InputError, match="CUDA graphs"):
        specdec.generate(model, [PROMPTS[0]], max_new_tokens=2, invariant=True, cuda_graphs=True)


# ---- the certificate level ---------------------------------------------------------------------------------------
def test_the_bitwise_certificate_level_passes_and_its_controls_fail(bf16_model):
    from specdec.eval.certificate import CertificateSizes, run_certificate

    from specdec.models.loader import load_model
    from specdec.sampling import SamplingConfig

    loaded = load_model(bf16_model)
    sizes = CertificateSizes(identity_prompts=3, identity_tokens=16)
    cert = run_certificate(loaded, "ngram", {}, SamplingConfig(True, 0.8), sizes,
                           lambda n: [list(p) for p in (PROMPTS * n)[:n]], levels=("bitwise",))
    by_control = {}
    for c in cert.checks:
        by_control.setdefault(c.control, []).append(c.passed)
    assert by_control[None] == [True, True, True], cert.to_markdown()  # rows, greedy, coupled
    assert not any(by_control["default_path"]) and len(by_control["default_path"]) == 3, cert.to_markdown()
    # rows, greedy, coupled: every check of the level can fail, whatever the device's default kernels
    assert by_control["row_dependent_kernel"] == [False, False, False], cert.to_markdown()
    assert cert.passed and not cert.void


def test_the_cli_flag_prints_plain_decodings_text(tmp_path, capsys):
    from specdec.cli import main
    from specdec.testing import save_tiny_checkpoint

    ckpt = str(save_tiny_checkpoint(tmp_path / "tiny"))
    prompt = "abcabcabcab"
    loaded = specdec.load_model(ckpt, dtype=torch.bfloat16)
    ids = loaded.tokenizer(prompt)["input_ids"]
    plain = specdec.generate(loaded, [ids], max_new_tokens=16, invariant=True, return_dict=True)
    want = loaded.tokenizer.decode(plain.new_tokens[0], skip_special_tokens=True)
    rc = main(["generate", prompt, "--model", ckpt, "--max-new-tokens", "16", "--dtype", "bfloat16", "--drafter",
               "ngram", "--speculation", "always", "--invariant", "--no-chat-template"])
    assert rc == 0 and capsys.readouterr().out == want + "\n"


def test_a_divergence_records_where_the_text_parts_as_well_as_the_first_bit():
    from specdec.eval.bitwise_level import first_divergence

    plain = ([5, 6, 7, 8], [-0.5, -0.25, -1.0, -2.0])
    assert first_divergence(0, [1], plain, plain) is None
    bits_then_text = first_divergence(0, [1], plain, ([5, 6, 9, 8], [-0.5, -0.3, -1.5, -2.0]))
    assert (bits_then_text.position, bits_then_text.text_position) == (1, 2)
    assert bits_then_text.logprob_delta == pytest.approx(-0.05) and bits_then_text.gap is None
    bits_only = first_divergence(0, [1], plain, ([5, 6, 7, 8], [-0.5, -0.25, -1.0, -2.5]))
    assert (bits_only.position, bits_only.text_position) == (3, None)
    shorter = first_divergence(0, [1], plain, ([5, 6], [-0.5, -0.25]))
    assert (shorter.position, shorter.text_position, shorter.speculative_token) == (2, 2, -1)


def test_a_default_path_that_is_exact_on_the_device_makes_its_control_not_applicable(bf16_model, monkeypatch):
    """On a device whose default kernels do not depend on the row count (a GPU in float32 may be one), the
    default_path control passes its checks: that voided the certificate although the mode was exact. Simulated
    here by a default path that is the invariant one: its checks are not applicable (neither pass nor void, with a
    warning), row_dependent_kernel still fails, also on the greedy text check (whose power would otherwise rest
    on the row check alone there), and the certificate passes."""
    from specdec.eval.certificate import CertificateSizes, run_certificate

    from specdec.models.loader import load_model
    from specdec.sampling import SamplingConfig

    always_invariant = LlamaRunner.invariant_mode
    monkeypatch.setattr(LlamaRunner, "invariant_mode", lambda self, on=True: always_invariant(self, True))
    loaded = load_model(bf16_model)
    sizes = CertificateSizes(identity_prompts=2, identity_tokens=8)
    cert = run_certificate(loaded, "ngram", {}, SamplingConfig(False), sizes,
                           lambda n: [list(p) for p in (PROMPTS * n)[:n]], levels=("bitwise",))
    default = [c for c in cert.checks if c.control == "default_path"]
    assert len(default) == 2 and all("not applicable on this device" in c.detail for c in default), cert.to_markdown()
    broken = [c for c in cert.checks if c.control == "row_dependent_kernel"]
    assert [(c.name.split()[0], c.passed) for c in broken] == [("row", False), ("greedy", False)], cert.to_markdown()
    assert cert.passed and not cert.void, cert.to_markdown()
    assert any("default path was row-invariant on this device" in w for w in cert.warnings), cert.warnings
    assert "| n/a |" in cert.to_markdown()


def test_the_bitwise_level_runs_with_a_single_identity_prompt(bf16_model):
    """--identity-prompts 1 crashed the row check ("zip() argument 2 is longer than argument 1": two trees, one
    prompt) after the model had loaded; the prompt now runs twice, and every control is still caught."""
    from specdec.eval.certificate import CertificateSizes, run_certificate

    from specdec.models.loader import load_model
    from specdec.sampling import SamplingConfig

    sizes = CertificateSizes(identity_prompts=1, identity_tokens=8)
    cert = run_certificate(load_model(bf16_model), "ngram", {}, SamplingConfig(False), sizes,
                           lambda n: [list(p) for p in PROMPTS[:n]], levels=("bitwise",))
    rows = [c for c in cert.checks if c.name.startswith("row logits")]
    assert len(rows) == 3 and all("the one prompt twice together" in c.detail for c in rows), cert.to_markdown()
    assert [c.passed for c in rows if c.control == "row_dependent_kernel"] == [False], cert.to_markdown()
    assert cert.passed and not cert.void, cert.to_markdown()


def test_bitwise_identity_counts_every_plain_token_as_compared(monkeypatch):
    """The level's samples are the new tokens compared, not the number of prompts."""
    plain = [([1, 2, 3], [-0.1, -0.2, -0.3]), ([4, 5], [-0.4, -0.5])]
    out = SimpleNamespace(new_tokens=[t for t, _ in plain], logprobs=[lp for _, lp in plain],
                          stats=[SimpleNamespace(steps=2), SimpleNamespace(steps=1)], total_new_tokens=5)
    monkeypatch.setattr(bitwise_level, "_generate", lambda loaded, prompts, **kw: out)
    got = bitwise_level.bitwise_identity(SimpleNamespace(), [[7], [8]], "ngram", {}, 3, True, True, plain)
    # 3 + 2 new tokens compared; tau = 5 tokens / (2 + 1) steps
    assert got.identical and got.tokens_compared == 5 and got.tau == pytest.approx(5 / 3)


def test_the_bitwise_level_fails_an_engine_wrong_only_when_it_speculates_for_a_batch(bf16_model, monkeypatch):
    """Speculating for two prompts in one batch must be compared with plain decoding too: an engine whose batched
    speculation moves one log-probability (its one-prompt runs exact) fails the level's own greedy check."""
    real = bitwise_level._generate

    def wrong_when_batched(loaded, prompts, **kw):
        out = real(loaded, prompts, **kw)
        if kw.get("drafter") is not None and len(prompts) > 1:
            out.logprobs[0][0] -= 1.0
        return out

    monkeypatch.setattr(bitwise_level, "_generate", wrong_when_batched)
    sizes = CertificateSizes(identity_prompts=2, identity_tokens=8)
    checks, _ = bitwise_level.bitwise_checks(load_model(bf16_model), "ngram", {}, SamplingConfig(False), sizes,
                                             lambda n: [list(p) for p in PROMPTS[:n]])
    own = [c for c in checks if c.control is None and c.name.startswith("greedy text")]
    # prompt 0 of the batched run: same tokens, its first log-probability 1.0 lower
    assert len(own) == 1 and not own[0].passed, own
    assert "1 outputs differ (0 in text" in own[0].detail and "log-prob delta -1" in own[0].detail, own[0].detail
