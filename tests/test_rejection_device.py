"""The rejection sampler keeps every tensor on the logits' device (issue 18: sampling on CUDA mixed CPU tree
tensors with CUDA logits and crashed). Checked by construction on CPU: every tensor the sampler creates names
its device, so none can land on the default (CPU) device beside CUDA logits. The `device`-parametrised tests
(tests/test_generate.py, tests/test_speculative.py) run the same paths on CUDA when a GPU is present. The token
draw itself is checked on each device here."""
from __future__ import annotations

import pytest
import torch
from specdec.eval.certificate import random_deterministic_trees
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specdec.rejection import EXACT, rejection_sample
from specdec.sampling import SamplingConfig
from specdec.tree import DraftMode, DraftTree

FACTORIES = {torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.tensor, torch.rand,
             torch.randn, torch.randint, torch.as_tensor, torch.linspace, torch.eye}


class FactoriesNameADevice(TorchFunctionMode):
    """Records each tensor factory called without an explicit ``device=``."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            self.missing.append(func.__name__)
        return func(*args, **kwargs)


def trees(vocab: int, gen: torch.Generator) -> list[DraftTree]:
    probs = torch.softmax(torch.randn(4, vocab, generator=gen), -1)
    return [
        DraftTree.chain([1, 2, 3]),  # deterministic candidates
        DraftTree([4, 5, 6, 7], [-1, -1, 0, 0], probs, DraftMode.INDEPENDENT),
        DraftTree([4, 5, 6, 7], [-1, -1, 0, 0], probs, DraftMode.WITHOUT_REPLACEMENT),
        DraftTree.empty(),
    ]


@pytest.mark.parametrize("only_deterministic", [False, True], ids=["mixed-trees", "deterministic-trees"])
@pytest.mark.parametrize("sampling", [SamplingConfig(True, 0.8, 5, 0.9), SamplingConfig(False)],
                         ids=["sample", "greedy"])
def test_sampler_names_the_device_of_every_tensor_it_creates(sampling, only_deterministic):
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    batch = trees(vocab, gen)
    if only_deterministic:  # the walk on gathered probabilities (rejection._deterministic)
        batch = [t for t in batch if t.mode is DraftMode.DETERMINISTIC] + [DraftTree([3, 3, 9], [-1, -1, 1])]
    logits = torch.randn(len(batch), 5, vocab, generator=gen)
    with FactoriesNameADevice() as mode:
        for _ in range(20):
            rejection_sample(batch, logits, sampling, torch.Generator().manual_seed(1))
    assert mode.missing == []
    with FactoriesNameADevice() as mode:  # the check itself can fail
        torch.zeros(3)
    assert mode.missing == ["zeros"]


def test_generator_on_another_device_than_the_logits_is_refused():
    logits = torch.zeros(1, 1, 8, device="meta")
    with pytest.raises(ValueError, match="generator is on cpu but target_logits are on meta"):
        rejection_sample([DraftTree.empty()], logits, SamplingConfig(True), torch.Generator())


def test_token_draw_follows_the_probabilities_never_draws_a_zero_and_stays_on_device(device, monkeypatch):
    """specdec.sampling.sample (the engine's draw of recovered / bonus tokens): frequencies within 5 sigma of the
    probabilities over 200,000 draws, zero-probability tokens never drawn (also at either edge of the uniform draw),
    rows need not sum to 1, shapes and device kept."""
    from specdec.sampling import sample

    gen = torch.Generator(device=device).manual_seed(0)
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0], dtype=torch.float64, device=device)
    draws = sample(probs.expand(200_000, 6), gen)
    assert draws.device.type == device and draws.shape == (200_000,)
    freq = torch.bincount(draws.cpu(), minlength=6).double() / draws.numel()
    sigma = (probs.cpu() * (1 - probs.cpu()) / draws.numel()).sqrt()
    assert ((freq - probs.cpu()).abs() <= 5 * sigma + 1e-12).all(), freq
    unnormalised = torch.tensor([[[0.0, 2.0, 0.0]], [[1.0, 0.0, 0.0]]], device=device)  # float32, [2, 1, 3]
    assert sample(unnormalised, gen).tolist() == [[1], [0]]
    edges = torch.tensor([[0.0, 0.3, 0.7, 0.0]], dtype=torch.float64, device=device)
    real_rand = torch.rand
    for u, token in ((0.0, 1), (1 - 2**-53, 2)):  # the smallest and the largest uniform draw
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: real_rand(*a, **k).fill_(u))
        assert sample(edges, gen).tolist() == [token]


def records(acceptances) -> list[tuple]:
    """What a sequence commits and what the step records, per acceptance, as plain values."""
    return [(a.next_token, a.is_bonus, list(a.accepted_nodes), list(a.depth_tried)) for a in acceptances]


def test_plain_steps_draw_what_the_full_walk_draws(device):
    """A step with no draft in any sequence skips the walk's bookkeeping: same generator, same tokens and records
    as the walk (a leaf root draws its bonus token from the target's probabilities, with one uniform)."""
    from specdec.rejection import _stochastic

    logits = torch.randn(3, 1, 50, generator=torch.Generator().manual_seed(1)).to(device) * 3
    trees = [DraftTree.empty() for _ in range(3)]
    sampling = SamplingConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    for seed in range(5):
        fast = rejection_sample(trees, logits, sampling, torch.Generator(device=device).manual_seed(seed))
        walk = _stochastic(trees, logits, sampling, torch.Generator(device=device).manual_seed(seed), EXACT)
        assert records(fast) == records(walk)


@pytest.mark.parametrize("sampling", [SamplingConfig(True, 1.0), SamplingConfig(True, 0.7, 3, 0.9),
                                      SamplingConfig(True, 2.0, 0, 0.5)], ids=["t1", "t0.7-top3-p0.9", "t2-p0.5"])
def test_deterministic_trees_draw_what_the_full_walk_draws(device, sampling, monkeypatch):
    """Deterministic trees (EAGLE, n-gram) walk on the target's probabilities at their child tokens, not on
    vocabulary-wide residuals: with the same generator, the same accepted paths, recovered / bonus tokens and
    records as the full walk, over batches that mix empty trees, repeated sibling tokens and candidates that
    top-k / top-p give zero probability (the law itself: tests/test_rejection_stats.py, "deterministic-tree")."""
    from specdec.rejection import _deterministic, _stochastic

    gen = torch.Generator().manual_seed(3)
    vocab = 6  # few tokens: candidates are accepted and rejected often, residuals run low
    for trial in range(40):
        batch = random_deterministic_trees(vocab, gen)
        if all(t.num_nodes == 0 for t in batch):
            continue
        rows = max(t.num_nodes for t in batch) + 1
        logits = (torch.randn(len(batch), rows, vocab, generator=gen) * 2).to(device)
        fast = _deterministic(batch, logits, sampling, torch.Generator(device=device).manual_seed(trial))
        walk = _stochastic(batch, logits, sampling, torch.Generator(device=device).manual_seed(trial), EXACT)
        assert records(fast) == records(walk), trial
    # rejection_sample takes this path for deterministic trees under the exact rule
    import specdec.rejection as rejection

    calls = []
    monkeypatch.setattr(rejection, "_deterministic", lambda *a: calls.append(1) or _deterministic(*a))
    rejection_sample([DraftTree.chain([1, 2])], torch.zeros(1, 3, vocab, device=device), sampling,
                     torch.Generator(device=device))
    assert calls == [1]


class DeviceReads(TorchDispatchMode):
    """Counts the ops whose result the host must wait for: a tensor's truth value or item, and a boolean mask's
    indices (its shape depends on the values); ``.tolist()`` is counted by the test."""

    READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select"}  # 2nd, 3rd: inference mode

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.READS:
            self.reads.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def walk_once(walk: str, batch, logits, seed: int, stop_early: bool):
    from specdec.rejection import _deterministic, _stochastic

    sampling, gen = SamplingConfig(True, 0.8, 0, 0.95), torch.Generator().manual_seed(seed)
    if walk == "vocabulary-wide":
        return _stochastic(batch, logits, sampling, gen, EXACT, stop_early)
    return _deterministic(batch, logits, sampling, gen, stop_early)


@pytest.mark.parametrize("walk", ["vocabulary-wide", "deterministic"])
def test_the_sampled_walk_reads_the_device_once_and_stopping_early_changes_no_token(walk, monkeypatch):
    """On a GPU the walk runs every level of the deepest tree with ended rows masked (stop_early=False), so the
    host reads the device once, for the result: counted here on the CPU. Stopping once no row walks on (the CPU's
    default) gives the same tokens and records from the same generator, over random batches of mixed depths."""
    tolists, host = [], set()  # the trees are host records: reading them is no read of the device
    real_tolist = torch.Tensor.tolist

    def tolist(self):
        if self.data_ptr() not in host:
            tolists.append(tuple(self.shape))
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    gen = torch.Generator().manual_seed(5)
    vocab, compared = 6, 0
    for trial in range(30):
        batch = random_deterministic_trees(vocab, gen)
        if walk == "vocabulary-wide":
            probs = torch.softmax(torch.randn(4, vocab, generator=gen), -1)  # sampled siblings, with and without
            mode = (DraftMode.INDEPENDENT, DraftMode.WITHOUT_REPLACEMENT)[trial % 2]  # replacement
            batch[-1] = DraftTree([1, 2, 3, 1], [-1, -1, 0, 0], probs, mode)
        host = {x.data_ptr() for t in batch for x in (t.tokens, t.parents)}
        rows = max(t.num_nodes for t in batch) + 1
        logits = torch.randn(len(batch), rows, vocab, generator=gen) * 2
        tolists.clear()
        with DeviceReads() as mode:
            masked = walk_once(walk, batch, logits, trial, stop_early=False)
        assert mode.reads == [] and len(tolists) == 1, (mode.reads, len(tolists))
        early = walk_once(walk, batch, logits, trial, stop_early=True)
        assert records(early) == records(masked), trial
        compared += any(len(a.accepted_nodes) for a in masked)
    assert compared > 10  # paths were accepted, not only roots
    with DeviceReads() as mode:  # the count can fail
        bool(torch.ones(2).any())
    assert mode.reads == ["_local_scalar_dense"]


def test_a_sampled_tree_beside_an_empty_one_keeps_its_own_acceptance_rule():
    """A batch mixing plain steps (empty trees, deterministic by mode) with a sampled tree must take the sampled
    walk: the deterministic one ignores draft_probs, which is still lossless but accepts a draft drawn from the
    target's own law at rate p(x) instead of 1."""
    vocab = 6
    logits = torch.randn(2, 2, vocab, generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(True)
    q = torch.softmax(logits[1, 0].double(), -1).float()[None]  # the draft law is the target's
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        x = int(torch.multinomial(q[0], 1, generator=gen))
        batch = [DraftTree.empty(), DraftTree.chain([x], q, DraftMode.INDEPENDENT)]
        assert rejection_sample(batch, logits, sampling, gen)[1].accepted_tokens == (x,), seed
