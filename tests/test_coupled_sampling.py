"""Coupled sampling (specdec.coupling) on tiny models: the noise is a pure function of (seed, key, position,
token) and matches a pure-Python reference; plain coupled sampling has the target's law (chi-square with its
power stated); speculative coupled output equals plain coupled output token for token for every drafter and
tree mode, batched == single; broken couplings (noise keyed to the step, or to the batch row) fail."""
from __future__ import annotations

import sys

import pytest
import torch
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads
from specdec.eval import coupled_level
from specdec.eval.certificate import CertificateSizes
from specdec.eval.divergence import Divergence, IdentityResult
from specdec.eval.negative_controls import COUPLING_FAULTS, generate_with_control
from specdec.eval.statistics import goodness_of_fit

import specdec
from specdec.coupling import Coupling, coupled_tokens, perturbed_logits, sequence_keys
from specdec.errors import InputError
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.testing import build_tiny_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 8], [10, 20, 30, 10, 20, 30, 10, 20], [5, 5, 5, 5], [7, 8]]
SAMPLE = dict(do_sample=True, temperature=1.0, seed=11, sampler="coupled")


# ---- the noise ----------------------------------------------------------------------------------------------
M64 = (1 << 64) - 1


def _mix64_reference(x: int) -> int:
    """splitmix64's finaliser on Python ints (unbounded, masked by hand): what the int64 tensors must wrap to."""
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _uniform_reference(coupling: Coupling, key: int, position: int, token: int) -> float:
    per_position = _mix64_reference(key + coupling._seed_word + _mix64_reference(position * 0x9E3779B97F4A7C15
                                                                                 + 0x632BE59BD9B4E019))
    bits = _mix64_reference(per_position + (token + 1) * 0x9E3779B97F4A7C15)
    return ((bits >> 11) + 0.5) * 2.0**-53


def test_noise_matches_the_reference_on_every_device(device):
    coupling = Coupling(seed=2**63 + 5)
    keys = torch.tensor(sequence_keys([[1, 2], [3]]), device=device)
    positions = torch.tensor([[0, 7], [2**31 + 3, 40]], device=device)
    u = coupling.uniforms(keys, positions, 50).cpu()
    for b in range(2):
        for p in range(2):
            for token in (0, 17, 49):
                want = _uniform_reference(coupling, int(keys[b]), int(positions[b, p]), token)
                assert u[b, p, token].item() == want
    assert 0 < u.min() and u.max() < 1


def test_noise_depends_on_seed_key_position_and_token_only():
    c = Coupling(3)
    keys = torch.tensor(sequence_keys([[1, 2, 3], [1, 2, 3], [1, 2, 4]]))
    assert len(set(keys.tolist())) == 3  # the second copy of a prompt gets its own key
    assert sequence_keys([[1, 2, 3]])[0] == keys[0]  # and the first copy the key it has alone
    g = c.gumbel(keys, torch.tensor([[4, 5]] * 3), 64)
    assert torch.equal(g[:, :, :32], c.gumbel(keys, torch.tensor([[4, 5]] * 3), 32))  # no dependence on vocab
    assert torch.equal(g[0, 1], c.gumbel(keys[:1], torch.tensor([[5]]), 64)[0, 0])  # nor on the other positions
    assert not torch.equal(g[0, 0], g[0, 1]) and not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    assert not torch.equal(g, Coupling(4).gumbel(keys, torch.tensor([[4, 5]] * 3), 64))


def test_coupling_rejects_a_bad_seed():
    with pytest.raises(InputError):
        Coupling(2**64)


# ---- the law --------------------------------------------------------------------------------------------------
LAW_CASES = [SamplingConfig(True, 1.0), SamplingConfig(True, 0.7, top_k=5), SamplingConfig(True, 1.3, top_p=0.8),
             SamplingConfig(True, 1.3, min_p=0.1, typical_p=0.95, eta_cutoff=0.01)]


@pytest.mark.parametrize("sampling", LAW_CASES, ids=["t1", "t0.7-topk5", "t1.3-topp0.8", "t1.3-warpers"])
@pytest.mark.parametrize("vary", ["key", "position"])
def test_plain_coupled_sampling_has_the_targets_law(sampling, vary):
    """20,000 coupled draws over fresh keys (or fresh positions of one key) against target_probs: chi-square at
    level 1e-3 with power >= 0.9 against any law at TV 0.03 from it."""
    torch.manual_seed(0)
    logits = torch.randn(12, dtype=torch.float64) * 1.5
    n = 20_000
    keys = torch.arange(n) * 7919 + 1 if vary == "key" else torch.full((n,), 5)
    positions = torch.full((n, 1), 9) if vary == "key" else torch.arange(n)[:, None]
    noise = Coupling(1).gumbel(keys, positions, 12)[:, 0]  # [n, 12]
    tokens = coupled_tokens(logits.expand(n, -1), sampling, noise).tolist()
    target_probs = logits_to_probs(logits, sampling)
    assert int((target_probs > 0).sum()) > 1
    law = {i: float(p) for i, p in enumerate(target_probs) if p > 0}
    p_value, power = goodness_of_fit(tokens, law, tv=0.03, alpha=1e-3)
    assert power >= 0.9
    assert p_value > 1e-3
    # a broken coupling that reuses one noise row for every draw is not a sampler at all
    broken = coupled_tokens(logits.expand(n, -1), sampling, noise[:1].expand(n, -1)).tolist()
    assert goodness_of_fit(broken, law, tv=0.03, alpha=1e-3).p_value < 1e-3


# ---- speculative == plain, batched == single --------------------------------------------------------------------
def _eagle(model):
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config, draft_vocab=tuple(range(0, 96, 2))))
    eagle.init_from_target(model)
    return EagleDrafter(model=eagle, depth=3, top_k=3, max_nodes=8)


def _medusa(model, **options):
    heads = MedusaHeads(MedusaConfig(3, 1, model.config.hidden_size, model.config.vocab_size))
    heads.init_lm_heads_from(model.get_output_embeddings().weight.detach())
    return MedusaDrafter(heads=heads, **options)


DRAFTERS = {
    "ngram": lambda m: ("ngram", {}),
    "draft-model-chain": lambda m: ("draft-model", {"model": m}),
    # a layer fewer than the target: under speculation="auto" one of its size is never asked (it cannot pay)
    "draft-model-static-tree": lambda m: ("draft-model", {"model": build_tiny_model(seed=1, num_hidden_layers=1),
                                                          "widths": (2, 2)}),
    "draft-model-dynamic": lambda m: ("draft-model", {"model": build_tiny_model(seed=1, num_hidden_layers=1),
                                                      "tree": "dynamic"}),
    "self-draft": lambda m: ("self-draft", {"num_layers": 1}),
    "medusa-static": lambda m: (_medusa(m), {}),
    "medusa-dynamic": lambda m: (_medusa(m, tree="dynamic"), {}),
    "eagle": lambda m: (_eagle(m), {}),
    "combined": lambda m: ("combined", {"drafters": ["ngram", {"name": "draft-model", "model": m}]}),
}


# sampling settings of the speculative == plain checks (transformers' other warpers in "warpers")
SETTINGS = {"t1": {}, "topk": dict(temperature=0.8, top_k=20, top_p=0.9),
            "warpers": dict(temperature=0.9, min_p=0.02, typical_p=0.95, epsilon_cutoff=1e-3, eta_cutoff=2e-3,
                            top_h=0.95)}


@pytest.fixture(scope="module")
def model():
    return build_tiny_model()


@pytest.fixture(scope="module")
def plain(model):
    """Plain coupled sampling of the batch, at each of SETTINGS: every prompt but the second copy of [7, 8]
    as sampled alone (the second copy has a key of its own, so it is a different sample)."""
    out = {}
    for name, extra in SETTINGS.items():
        kw = {**SAMPLE, **extra}
        out[name] = specdec.generate(model, PROMPTS, max_new_tokens=48, **kw)
        assert out[name][:4] == [specdec.generate(model, [p], max_new_tokens=48, **kw)[0] for p in PROMPTS[:4]]
    # the warpers change the text (so the checks with them check something)
    assert out["warpers"] != specdec.generate(model, PROMPTS, max_new_tokens=48, **{**SAMPLE, "temperature": 0.9})
    return out


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_speculative_coupled_output_is_plain_coupled_output(model, plain, name):
    for setting, extra in SETTINGS.items():
        drafter, options = DRAFTERS[name](model)
        kw = dict(max_new_tokens=48, drafter=drafter, drafter_options=options or None, **{**SAMPLE, **extra})
        batched = specdec.generate(model, PROMPTS, return_dict=True, speculation="always", **kw)
        assert batched.sequences == plain[setting], f"{name} {setting}: batched differs from plain"
        drafter, options = DRAFTERS[name](model)
        kw.update(drafter=drafter, drafter_options=options or None)
        single = [specdec.generate(model, [p], speculation="auto", **kw)[0] for p in PROMPTS[:3]]
        assert single == plain[setting][:3], f"{name} {setting}: single (tree sizing on) differs from plain"
        if name == "draft-model-chain":  # the target drafting for itself with the shared noise: nothing rejected
            assert all(s.tau > 4 for s in batched.stats if s.new_tokens >= 20)
        elif name != "ngram":
            assert sum(s.steps for s in batched.stats) < sum(s.new_tokens for s in batched.stats)  # drafts accepted


def test_plain_coupled_batched_equals_single_and_the_seed_matters(model, plain):
    alone = [specdec.generate(model, [p], max_new_tokens=48, **SAMPLE)[0] for p in PROMPTS[:4]]
    assert plain["t1"][:4] == alone  # the fixture checks it too; here it is the test
    other = specdec.generate(model, PROMPTS, max_new_tokens=48, **{**SAMPLE, "seed": 12})
    assert other != plain["t1"]
    assert plain["t1"][1] != plain["t1"][4]  # the two copies of [7, 8] are different samples


@pytest.mark.parametrize("fault", list(COUPLING_FAULTS))
def test_broken_couplings_are_caught(model, plain, fault):
    control = COUPLING_FAULTS[fault]
    kw = dict(max_new_tokens=48, **SAMPLE)
    if fault == "noise_keyed_to_step":  # plain decoding is one token per step; a drafter breaks the identity
        runs = [generate_with_control(model, [p], fault=control, drafter="draft-model",
                                      drafter_options={"model": model}, speculation="always", **kw)[0]
                for p in PROMPTS]
        reference = [generate_with_control(model, [p], fault=control, **kw)[0] for p in PROMPTS]
    else:  # batch rows: batched differs from single
        runs = generate_with_control(model, PROMPTS, fault=control, **kw)
        reference = [generate_with_control(model, [p], fault=control, **kw)[0] for p in PROMPTS]
    assert runs != reference


def test_medusa_ranks_by_the_noise_of_each_heads_position(model):
    """Head d's first candidate is argmax(sampling_logits(head d) + G[root + 1 + d]), computed here by hand."""
    drafter = _medusa(model, tree="dynamic", top_k=2)
    seen = {}

    class Spy(type(drafter)):
        def propose(self, seqs):
            trees = super().propose(seqs)
            seen["view"], seen["root"], seen["tree"] = seqs[-1], len(seqs[-1].token_ids) - 1, trees[-1]
            return trees

    drafter.__class__ = Spy
    specdec.generate(model, [PROMPTS[0]], max_new_tokens=2, drafter=drafter, speculation="always", **SAMPLE)
    view, tree, root = seen["view"], seen["tree"], seen["root"]  # token_ids is a live view: read at propose
    sampling = SamplingConfig(True, 1.0)
    logits = drafter._head_logits(view.last_hidden[None].to(model.dtype), 3)[:, 0]  # [3, vocab]
    noise = Coupling(SAMPLE["seed"]).draft_noise(view.noise_key, range(root + 1, root + 4), 96, "cpu")
    firsts = perturbed_logits(logits, sampling, noise).argmax(-1).tolist()
    depth1 = [int(t) for t, d in zip(tree.tokens, tree.depths, strict=True) if d == 1]
    assert firsts[0] in depth1


def test_bad_sampler_and_rule_combinations_are_errors(model):
    with pytest.raises(InputError, match="sampler"):
        specdec.generate(model, [PROMPTS[0]], max_new_tokens=2, sampler="gumbel")
    from specdec.eval.negative_controls import BROKEN_RULES
    with pytest.raises(InputError, match="coupled"):
        generate_with_control(model, [PROMPTS[0]], rule=next(iter(BROKEN_RULES.values())), max_new_tokens=2,
                              **SAMPLE)


def test_generator_and_unseeded_coupled_sampling(model):
    g = torch.Generator().manual_seed(5)
    a = specdec.generate(model, [PROMPTS[0]], max_new_tokens=16, do_sample=True, sampler="coupled", generator=g)
    g = torch.Generator().manual_seed(5)
    b = specdec.generate(model, [PROMPTS[0]], max_new_tokens=16, do_sample=True, sampler="coupled", generator=g,
                         drafter="ngram", speculation="always")
    assert a == b
    torch.manual_seed(0)  # unseeded: one draw of torch's global RNG seeds the noise
    c = specdec.generate(model, [PROMPTS[0]], max_new_tokens=16, do_sample=True, sampler="coupled")
    torch.manual_seed(0)
    d = specdec.generate(model, [PROMPTS[0]], max_new_tokens=16, do_sample=True, sampler="coupled",
                         drafter="draft-model", drafter_options={"model": model}, speculation="always")
    assert c == d and 0 < len(c[0]) - len(PROMPTS[0]) <= 16


def test_identity_on_every_device(device):
    """The model, the noise and the walk on ``device`` (CUDA when present): draft-model and n-gram == plain."""
    model = build_tiny_model().to(device)
    kw = dict(max_new_tokens=32, **SAMPLE)
    plain = specdec.generate(model, PROMPTS, **kw)
    for drafter, options in (("ngram", None), ("draft-model", {"model": model})):  # "always": the target can't pay
        assert specdec.generate(model, PROMPTS, drafter=drafter, drafter_options=options, speculation="always",
                                **kw) == plain


# ---- the certificate's coupled level ----------------------------------------------------------------------------
def test_certificate_coupled_level_passes_and_catches_its_controls(model):
    from specdec.eval.certificate import CertificateSizes, run_certificate

    from specdec.models.loader import load_model

    sizes = CertificateSizes(stat_samples=8_000, stat_tv=0.05, identity_prompts=4, identity_tokens=24)
    cert = run_certificate(load_model(model), "draft-model", {"model": model}, SamplingConfig(True, 0.9, 20), sizes,
                           lambda n: PROMPTS[:n], levels=("coupled",), seed=3)
    failed = [(c.name, c.control, c.detail) for c in cert.checks if not c.as_expected]
    assert cert.passed and not cert.void, failed
    assert {c.control for c in cert.checks} == {None, "noise_reused", *COUPLING_FAULTS}
    law = [c for c in cert.checks if c.control is None and "law" in c.name]
    assert len(law) == 6 and all(c.power >= 0.9 for c in law)
    identity = next(c for c in cert.checks if c.control is None and "==" in c.name and "law" not in c.name)
    assert "0 real mismatches" in identity.detail and "tau 1.00" not in identity.detail


def test_certificate_coupled_law_rows_run_top_k_where_it_removes_tokens():
    """The law rows' cases have 16 tokens: a top-k of 16 or more (the committed certificates' 50) removed nothing
    there, so the rows checked the law without the top-k the certificate names. It now runs as 14."""
    from specdec.eval.certificate import CertificateSizes
    from specdec.eval.coupled_level import LAW_VOCAB, law_checks

    sizes = CertificateSizes(stat_samples=500, stat_tv=0.2)
    for top_k in (50, 8):
        rows = [c for c in law_checks(SamplingConfig(True, 0.8, top_k), sizes, seed=0) if c.control is None]
        kept = min(top_k, LAW_VOCAB - 2)
        assert rows and all(c.detail.startswith(f"{kept} of {LAW_VOCAB} tokens") for c in rows), rows[0].detail
        assert all(("run as" in c.detail) == (top_k >= LAW_VOCAB - 1) for c in rows)


def test_the_largest_noise_word_is_a_uniform_below_one():
    """(k + 0.5) * 2**-53 rounds to 1.0 for the largest 53-bit k: its Gumbel noise was +inf, and on finite logits
    the step emitted "no law" (the engine then blamed the logits). The key below (seed 0, position 5) gives token
    0 that word; it was found by inverting splitmix64."""
    keys, positions = torch.tensor([-1644136720217836805]), torch.tensor([[5]])
    coupling = Coupling(seed=0)
    u = coupling.uniforms(keys, positions, 8)[0, 0]
    assert float(u[0]) == 1.0 - 2.0**-53 and bool(((u > 0) & (u < 1)).all())
    noise = coupling.gumbel(keys, positions, 8)[0, 0]
    assert bool(torch.isfinite(noise).all())
    logits = torch.tensor([[-30.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], dtype=torch.float64)
    for sampling in (SamplingConfig(True, 1.0), SamplingConfig(True, 1.0, top_k=3)):
        assert 0 <= int(coupled_tokens(logits, sampling, noise[None])[0]) < 8


def test_certificate_coupled_law_rows_keep_two_tokens_under_top_p():
    """At temperature 0.8 and top-p 0.9 the sharpest law case kept one token: its two rows drew that token every
    time and passed with power 0, and the warning advised more draws, which cannot add a token. Its logits are
    now flattened until the warpers leave two tokens or more."""
    from specdec.eval.certificate import CertificateSizes
    from specdec.eval.coupled_level import law_checks

    sizes = CertificateSizes(stat_samples=2000, stat_tv=0.2)
    rows = [c for c in law_checks(SamplingConfig(True, 0.8, top_p=0.9), sizes, seed=0) if c.control is None]
    assert len(rows) == 6 and all(int(c.detail.split()[0]) >= 2 and c.power > 0.5 for c in rows), rows
    assert any("halved" in c.detail for c in rows) and all(c.passed for c in rows)


def _identity_rows(monkeypatch, kind: str):
    """The coupled identity rows where the batched speculative run parts from plain at one token of the given
    ``kind`` (the engine and the controls faked: only the level's verdict on those results runs)."""
    def identity(loaded, prompts, *args, fault=None, batched=True, **kw):
        apart = (Divergence(0, 3, 5, 6, 1.0, 0.5, 0.5, kind),) if fault is None and args[-1] else ()
        return IdentityResult(len(prompts), 8 * len(prompts), apart, 1.5)

    monkeypatch.setattr(sys.modules["specdec.generate"], "generate", lambda loaded, prompts, **kw: prompts)
    monkeypatch.setattr(coupled_level, "generate_with_control", lambda loaded, prompts, **kw: prompts)
    monkeypatch.setattr(coupled_level, "greedy_identity", identity)
    return coupled_level.identity_checks(None, "ngram", {}, SamplingConfig(True), CertificateSizes(identity_tokens=8),
                                         [[1, 2], [3, 4]], seed=0)


def test_certificate_coupled_identity_fails_on_one_real_mismatch_and_passes_a_near_tie(monkeypatch):
    checks, warnings = _identity_rows(monkeypatch, "real mismatch")
    own = next(c for c in checks if c.control is None)
    assert not own.passed and "1 real mismatches, 0 near-ties" in own.detail, own.detail
    checks, warnings = _identity_rows(monkeypatch, "numerical near-tie")
    own = next(c for c in checks if c.control is None)
    assert own.passed and "0 real mismatches, 1 near-ties" in own.detail, own.detail
    assert any("1 divergences were numerical near-ties" in w for w in warnings), warnings


def test_certificate_coupled_level_checks_a_greedy_setting_at_temperature_1(monkeypatch):
    """Coupling only matters when sampling: a greedy setting is certified as sampling at temperature 1, no warper."""
    seen = []
    monkeypatch.setattr(coupled_level, "identity_checks", lambda *args: seen.append(args[3]) or ([], []))
    monkeypatch.setattr(coupled_level, "engine_law_checks", lambda *args: seen.append(args[1]) or ([], []))
    sizes = CertificateSizes(stat_samples=500, stat_tv=0.2)
    checks, _ = coupled_level.coupled_checks(None, "ngram", {}, SamplingConfig(False), sizes, lambda n: [[1]] * n)
    assert seen == [SamplingConfig(True), SamplingConfig(True)]
    # softmax of finite logits at temperature 1 gives every one of the 16 tokens a positive probability
    rows = [c for c in checks if c.control is None]
    assert len(rows) == 6 and all(c.detail == "16 of 16 tokens in the support" for c in rows), rows
