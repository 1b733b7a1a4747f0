"""Plain decoding with each step queued before the last is read (specdec.decode_ahead) gives the tokens of plain
decoding read step by step, greedy or sampled: early stops in a ragged batch, the context's and the pool's edges,
invalid logits.

On CPU the buckets run eagerly in the Triton interpreter; with a GPU they are captured and replayed."""
from __future__ import annotations

import gc
import weakref

import pytest
from specdec.kernels.testing import PADDED_ROWS_WARNINGS, kernel_device, triton_tiny_model

DEVICE = kernel_device()  # sets TRITON_INTERPRET=1 without a GPU: must run before triton is imported
pytest.importorskip("triton")

import dataclasses  # noqa: E402

import torch  # noqa: E402

from specdec.cuda_graphs import GraphConfig, GraphedForward  # noqa: E402
from specdec.decode_ahead import DecodeAhead  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.kv_cache import CacheFullError, PagedKVCache  # noqa: E402
from specdec.models.llama import LlamaRunner  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.sampling import InvalidLogitsError, SamplingConfig  # noqa: E402
from specdec.stopping import StopCriteria  # noqa: E402
from specdec.testing import build_tiny_model, ragged_prompts  # noqa: E402

VOCAB = 64
GREEDY = SamplingConfig()
CONFIG = GraphConfig(batch_sizes=(1, 2, 4), tokens_per_seq=(1, 2), capture=DEVICE == "cuda")
pytestmark = [pytest.mark.filterwarnings(w) for w in PADDED_ROWS_WARNINGS]  # padded rows' garbage


@pytest.fixture(scope="module")
def loaded():
    return triton_tiny_model(VOCAB, DEVICE)


def run(runner, prompts, stop: StopCriteria, queue_ahead: bool, blocks: int = 48, cache_cls=PagedKVCache,
        sampling: SamplingConfig = GREEDY, seed: int | None = None):
    """(new tokens, finish reasons, engine) of one generation (greedy, or sampled from a generator seeded with
    ``seed``) through uncaptured (CPU) or captured buckets."""
    s = runner.shape
    cache = cache_cls(s.num_layers, s.num_kv_heads, s.head_dim, blocks, 4, runner.dtype, runner.device,
                      runner.backend)
    generator = None if seed is None else torch.Generator(device=runner.device).manual_seed(seed)
    engine = Engine(runner, cache, sampling=sampling, stop=stop, graphed=GraphedForward(runner, cache, CONFIG),
                    generator=generator, queue_ahead=queue_ahead)
    seqs = engine.add(prompts)
    while engine.live:
        engine.step()
    return [q.new_tokens for q in seqs], [q.finish_reason for q in seqs], engine


def count_queued(monkeypatch) -> list[int]:
    """Patch DecodeAhead.launch to count the steps queued behind an unread one (their batch sizes)."""
    queued, launch = [], DecodeAhead.launch

    def spy(self, seqs, after, rows=None):
        if after is not None:
            queued.append(len(seqs))
        return launch(self, seqs, after, rows)

    monkeypatch.setattr(DecodeAhead, "launch", spy)
    return queued


def test_queued_steps_give_plain_decodings_tokens(loaded, monkeypatch):
    """A ragged batch whose sequences stop on an EOS at different steps (one in the middle of the batch, one at
    its first token), and by length: the tokens, finish reasons and forward count of the synchronous engine, plus
    one thrown-away step per EOS stop; every step but the first and the last was queued behind an unread one."""
    runner = loaded.runner
    prompts = ragged_prompts(3, VOCAB, seed=4, max_len=12)
    free, _, _ = run(runner, prompts, StopCriteria(10), queue_ahead=False)
    eos = [free[1][3], free[2][0]]  # the middle sequence stops at its 4th token (or before), the last at its 1st
    assert free[0][:1] != [eos[0]] and eos[0] not in free[0][:1] and eos[1] not in free[0][:1]
    stop = StopCriteria(10, eos_token_ids=set(eos))
    want, reasons, sync = run(runner, prompts, stop, queue_ahead=False)
    assert "eos" in reasons and sync.ahead is None
    queued = count_queued(monkeypatch)
    got, got_reasons, ahead = run(runner, prompts, stop, queue_ahead=True)
    assert ahead.ahead is not None
    assert (got, got_reasons) == (want, reasons)
    thrown = reasons.count("eos")
    assert ahead.forward_passes <= sync.forward_passes + thrown
    assert len(queued) == sync.forward_passes - 1 > 0  # every step but the first was queued
    assert ahead.cache.num_free_blocks == ahead.cache.num_blocks - 1  # only the scratch slot's block is held


def test_queued_steps_after_the_first_sequence_stops(loaded):
    """The first sequence of the batch stops while the later ones go on: the rows still running are then not a
    prefix of the batch (in the test above the last stops first, and they always were), and a queued step that
    took the batch's first rows' tokens gave the others another text."""
    runner = loaded.runner
    prompts = ragged_prompts(3, VOCAB, seed=4, max_len=12)
    free, _, _ = run(runner, prompts, StopCriteria(10), queue_ahead=False)
    eos = next(t for t in free[0][1:4] if t not in free[1] + free[2])  # stops sequence 0 alone, early
    stop = StopCriteria(10, eos_token_ids={eos})
    want, reasons, _ = run(runner, prompts, stop, queue_ahead=False)
    assert reasons[0] == "eos" and reasons[1:] == ["length", "length"]
    assert run(runner, prompts, stop, queue_ahead=True)[:2] == (want, reasons)


def test_sampled_steps_draw_what_plain_sampling_draws(loaded, monkeypatch):
    """Standard sampling from a seeded generator: a batch stopping by length, and one sequence stopping on an EOS
    (the thrown-away step draws after the last token), give the text of steps read first."""
    runner, hot = loaded.runner, SamplingConfig(do_sample=True, temperature=1.5)
    prompts = ragged_prompts(2, VOCAB, seed=9, max_len=10)
    queued = count_queued(monkeypatch)
    for batch, stop in ((prompts, StopCriteria(8)), (prompts[1:], None)):
        if stop is None:  # the 5th token of the sampled text as EOS (its first occurrence ends the text)
            first, _, _ = run(runner, batch, StopCriteria(8), queue_ahead=False, sampling=hot, seed=3)
            stop = StopCriteria(8, eos_token_ids={first[0][4]})
        want, reasons, _ = run(runner, batch, stop, queue_ahead=False, sampling=hot, seed=3)
        got, got_reasons, _ = run(runner, batch, stop, queue_ahead=True, sampling=hot, seed=3)
        assert (got, got_reasons) == (want, reasons)
    assert reasons == ["eos"] and len(set(want[0])) > 1 and queued


def test_a_step_is_not_queued_past_the_context(loaded, monkeypatch):
    """A sequence whose context ends before max_new_tokens: no step is queued at a position the model lacks."""
    short = load_model(build_tiny_model("llama-gqa-tied", VOCAB, max_position_embeddings=24), device=DEVICE)
    runner = LlamaRunner(short.model, backend="triton")
    prompts = [list(range(1, 18))]
    want, _, _ = run(runner, prompts, StopCriteria(6), queue_ahead=False)
    queued = count_queued(monkeypatch)
    got, _, engine = run(runner, prompts, StopCriteria(6), queue_ahead=True)
    assert got == want and len(want[0]) == 6
    assert len(queued) == 5  # roots at positions 17..22: the last of the 24 positions is never a root


class TightCache(PagedKVCache):
    """A pool that refuses every reservation of two positions (a queued step's), as a full pool would."""

    def reserve_many(self, num_new):
        if any(n == 2 for n in num_new.values()):
            raise CacheFullError("full")
        return super().reserve_many(num_new)


def test_a_full_pool_reads_the_step_first(loaded):
    """Where the pool has no room for a queued step's position, the unread step is read first: same tokens."""
    runner = loaded.runner
    prompts = ragged_prompts(2, VOCAB, seed=6, max_len=10)
    want, _, _ = run(runner, prompts, StopCriteria(5), queue_ahead=False)
    got, _, engine = run(runner, prompts, StopCriteria(5), queue_ahead=True, cache_cls=TightCache)
    assert got == want and engine.ahead is not None and engine.ahead.queued is None


class FillingCache(PagedKVCache):
    """A pool that takes two queued steps, then refuses every further one (as a pool filling up does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queued_room = 2

    def reserve_many(self, num_new):
        if any(n == 2 for n in num_new.values()):
            if self.queued_room == 0:
                raise CacheFullError("full")
            self.queued_room -= 1
        return super().reserve_many(num_new)


def test_a_pool_that_fills_behind_a_queued_step_reads_it_first(loaded):
    """The pool refuses the next step while one is queued: the queued step (whose position the commit before it
    had given back) is read and committed, and decoding goes on plainly, with plain decoding's tokens."""
    runner = loaded.runner
    prompts = ragged_prompts(2, VOCAB, seed=6, max_len=10)
    want, _, _ = run(runner, prompts, StopCriteria(6), queue_ahead=False)
    got, _, engine = run(runner, prompts, StopCriteria(6), queue_ahead=True, cache_cls=FillingCache)
    assert got == want and engine.cache.queued_room == 0


@pytest.mark.parametrize("batch", [2, 5], ids=["bucket", "eager"])  # buckets hold 4 sequences
def test_invalid_logits_raise_the_error_not_an_index_error(loaded, monkeypatch, batch):
    """A step whose logits are all NaN chose the id outside the vocabulary; the step queued behind it embeds a valid
    id (an embedding lookup of the vocabulary size would fail on the device), through a bucket or the eager forward,
    and the read raises InvalidLogitsError naming the step."""
    runner = loaded.runner
    calls = []
    logits = LlamaRunner.logits

    def poisoned(self, hidden):
        out = logits(self, hidden)
        calls.append(1)
        return torch.full_like(out, float("nan")) if len(calls) == 3 else out

    monkeypatch.setattr(LlamaRunner, "logits", poisoned)
    with pytest.raises(InvalidLogitsError, match="step 3"):
        run(runner, ragged_prompts(batch, VOCAB, seed=7, max_len=8), StopCriteria(8), queue_ahead=True)
    assert len(calls) == 4  # the poisoned step's successor ran (queued), and was thrown away


def test_generate_queues_plain_steps_only(loaded, monkeypatch):
    """generate() through buckets queues plain steps, with the tokens of eager decoding, also with a draft model
    the policy never asks (the target itself: a drafter never slower than plain decoding); coupled sampling, a
    drafter or log-probabilities keep each step read first."""
    from specdec.drafters.draft_model import DraftModelDrafter

    from tests.fixed_costs import fix_costs

    fix_costs(monkeypatch, {1: 1.0, 2: 1.25, 65: 17.0})  # no calibration in the interpreter (~10 s): the target
    # drafting for itself is never asked by its shape alone
    prompts = ragged_prompts(2, VOCAB, seed=8, max_len=10)
    eager = generate(loaded, prompts, max_new_tokens=6, cuda_graphs=False)
    queued = count_queued(monkeypatch)
    graphed = GraphedForward.with_cache(loaded.runner, 256, 16, CONFIG)
    assert generate(loaded, prompts, max_new_tokens=6, cuda_graphs=graphed) == eager
    assert len(queued) == 5
    itself = DraftModelDrafter(loaded, cuda_graphs=False)
    assert generate(loaded, prompts, max_new_tokens=6, cuda_graphs=graphed, drafter=itself) == eager
    assert len(queued) == 10
    for kwargs in (dict(do_sample=True, seed=0, sampler="coupled"), dict(drafter="ngram", speculation="always"),
                   dict(output_logprobs=True, return_dict=True)):
        generate(loaded, prompts, max_new_tokens=3, cuda_graphs=graphed, **kwargs)
    assert len(queued) == 10


def test_steps_without_a_bucket_run_eagerly_from_the_devices_tokens(loaded, monkeypatch):
    """A batch larger than every bucket, and a bucket whose capture fails: those queued steps run the eager forward
    on the unread step's choices, with the tokens of steps read first."""
    runner = loaded.runner
    prompts = ragged_prompts(5, VOCAB, seed=10, max_len=8)
    want, _, _ = run(runner, prompts, StopCriteria(5), queue_ahead=False)
    queued = count_queued(monkeypatch)
    got, _, engine = run(runner, prompts, StopCriteria(5), queue_ahead=True)  # 5 sequences: buckets hold 4
    assert got == want and queued and engine.graphed.replays == 0

    def failing(self, bucket):  # as on CUDA where a capture fails: the warm-up ran, then the capture raised
        self._run(bucket)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedForward, "_capture", failing)
    monkeypatch.setattr(GraphedForward, "__init__", _capturing(GraphedForward.__init__))
    got, _, engine = run(runner, prompts[:2], StopCriteria(5), queue_ahead=True)
    want, _, _ = run(runner, prompts[:2], StopCriteria(5), queue_ahead=False)
    assert got == want and engine.graphed.failed and engine.graphed.replays == 0


def _capturing(init):
    """GraphedForward.__init__ that then asks for captures, as on CUDA (the capture itself is patched)."""
    def wrapped(self, runner, cache, config=CONFIG):
        init(self, runner, cache, dataclasses.replace(config, capture=False))
        self.config = dataclasses.replace(config, capture=True)
    return wrapped


def test_steps_the_guard_holds_off_are_queued_and_it_asks_at_the_same_steps(loaded, monkeypatch):
    """Under the break-even guard, the steps where it holds every sequence off are queued as plain decoding's are
    (a drafter that reads no hidden rows), and the guard asks the drafter at the same steps as with every step read
    first: same tokens, same probes."""
    from specdec.cost_model import CostModel
    from specdec.speculation_policy import SpeculationPolicy
    from specdec.testing import RandomTreeDrafter
    from specdec.tree_sizing import TreeSizer
    from tests.fixed_costs import fix_costs

    curve = {1: 1.0, 2: 1.25, 65: 17.0}
    fix_costs(monkeypatch, curve)  # no wall time read: the guard decides alike in both runs
    # a probe costs a twentieth of a step: held off a few steps at a time (a free drafter is asked every step)
    monkeypatch.setattr(TreeSizer, "draft_cost", lambda self, batch: 0.05)
    monkeypatch.setattr(TreeSizer, "probe_cost", lambda self, batch: 0.05)
    # ... at read-back prices in both runs (timed queued steps would price drafts against themselves: elsewhere)
    monkeypatch.setattr(TreeSizer, "plain_price", lambda self, batch: 1.0)
    timed = []  # per recorded step: queued?
    record_step = TreeSizer.record_step
    monkeypatch.setattr(TreeSizer, "record_step", lambda self, seconds, n, batch, queued=False: timed.append(queued)
                        or record_step(self, seconds, n, batch, queued))
    asked = []
    propose = RandomTreeDrafter.propose

    def spy(self, seqs):
        asked.append([(s.seq_id, len(s.token_ids)) for s in seqs])
        return propose(self, seqs)

    monkeypatch.setattr(RandomTreeDrafter, "propose", spy)
    runner, prompts, stop = loaded.runner, ragged_prompts(2, VOCAB, seed=11, max_len=10), StopCriteria(20)
    queued = count_queued(monkeypatch)
    runs = {}
    for ahead in (False, True):
        asked.clear()
        timed.clear()
        s = runner.shape
        cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 48, 4, runner.dtype, runner.device,
                             runner.backend)
        config = dataclasses.replace(CONFIG, tokens_per_seq=(1, 2, 4))
        engine = Engine(runner, cache, sampling=GREEDY, stop=stop, graphed=GraphedForward(runner, cache, config),
                        drafter=RandomTreeDrafter(VOCAB, max_nodes=3, max_depth=2, seed=5),
                        policy=SpeculationPolicy(TreeSizer(CostModel({}, {1: curve}))), queue_ahead=ahead)
        seqs = engine.add(prompts)
        while engine.live:
            engine.step()
        runs[ahead] = ([q.new_tokens for q in seqs], list(asked), engine)
    assert runs[False][0] == runs[True][0]  # (the engine reading each step first gives plain greedy's: elsewhere)
    assert runs[False][1] == runs[True][1] and len(runs[True][1]) >= 3  # the guard's probes, at the same steps
    assert runs[False][2].ahead is None and runs[True][2].ahead.guarded
    assert not runs[False][2].policy.sizer.queues_held_off and runs[True][2].policy.sizer.queues_held_off
    assert len(queued) >= 3, queued  # the held-off stretches, after their first step
    assert sum(timed) == len(queued)  # each queued step timed as one, for the guard's plain price


def test_a_held_off_drafter_that_looks_back_drafts_again_once_the_text_turns(loaded, monkeypatch):
    """Where held-off steps are queued, a drafter that looks back (host-side proposals, as n-gram's) is asked for a
    held-off sequence while the device runs the next step; its trees are judged by the text that follows, never
    verified. Held off by a probe priced at breaking the queue (~45 steps of probe budget), a drafter that foresees
    the text drafts again within a few steps, and the tokens are plain decoding's."""
    from specdec.drafters.base import Drafter

    from specdec.cost_model import CostModel
    from specdec.speculation_policy import SpeculationPolicy
    from specdec.tree import DraftTree
    from specdec.tree_sizing import TreeSizer, _Guard
    from tests.fixed_costs import fix_costs

    curve = {1: 1.0, 2: 1.02, 65: 1.6}  # a GPU's flat verify
    fix_costs(monkeypatch, curve)
    monkeypatch.setattr(TreeSizer, "plain_price", lambda self, batch: 0.6)  # a queued step: 0.6 of one read back
    runner, prompt, stop = loaded.runner, [[3, 9, 4, 1, 7]], StopCriteria(24)
    plain, _, _ = run(runner, prompt, stop, queue_ahead=True)

    class Foresees(Drafter):  # proposes the next three tokens of plain decoding's text
        name, looks_back = "foresees", True

        def propose(self, seqs):
            ahead = [plain[0][len(s.token_ids) - len(prompt[0]):][:3] for s in seqs]
            return [DraftTree.chain(t, scores=torch.full((len(t),), 0.9)) for t in ahead]

    s = runner.shape
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 48, 4, runner.dtype, runner.device, runner.backend)
    graphed = GraphedForward(runner, cache, dataclasses.replace(CONFIG, tokens_per_seq=(1, 2, 4)))
    engine = Engine(runner, cache, sampling=GREEDY, stop=stop, graphed=graphed, drafter=Foresees(),
                    policy=SpeculationPolicy(TreeSizer(CostModel({}, {1: curve}))))
    seq, = engine.add(prompt)
    engine.policy.sizer.guards[seq.seq_id] = _Guard(backoff=8, price=0.45)  # held off until 0.45 of a step banked
    while engine.live:
        engine.step()
    assert seq.new_tokens == plain[0]
    drafted = [i for i, n in enumerate(seq.step_nodes) if n]
    assert drafted and drafted[0] <= 6, seq.step_nodes  # the look asked at the first queued step, decided 3 later
    assert engine.policy.sizer.paid >= 1


def test_a_guard_that_never_holds_off_times_one_queued_step_to_price_drafts_by(loaded, monkeypatch):
    """Where held-off steps are queued, a guard that never holds a step off never met a queued step, and priced every
    draft against a step read back (plain_price 1). The first plain step the cost correction asks for has the next
    step queued behind it, once: the guard then prices drafts by a queued step's time. Same tokens."""
    from specdec.cost_model import CostModel
    from specdec.online_costs import OnlineCosts
    from specdec.speculation_policy import SpeculationPolicy
    from specdec.testing import RandomTreeDrafter
    from specdec.tree_sizing import TreeSizer
    from tests.fixed_costs import fix_costs

    curve = {1: 1.0, 2: 1.01, 65: 1.3}  # verifying is nearly free: the guard never holds a sequence off
    fix_costs(monkeypatch, curve)
    due = []
    # a plain step due for the correction at the fifth step (fix_costs records no step's time to make it so)
    monkeypatch.setattr(OnlineCosts, "plain_step_due", lambda self, batch: len(due) == 5)
    step, launch = Engine.step, DecodeAhead.launch
    monkeypatch.setattr(Engine, "step", lambda self: due.append(1) or step(self))
    queued = []  # the engine step (1-based) whose call launched a step queued behind an unread one
    monkeypatch.setattr(DecodeAhead, "launch", lambda self, seqs, after, rows=None: (
        after is not None and queued.append(len(due))) or launch(self, seqs, after, rows))
    runner, prompts, stop = loaded.runner, ragged_prompts(2, VOCAB, seed=11, max_len=10), StopCriteria(16)
    plain, _, _ = run(runner, prompts, stop, queue_ahead=True)
    s = runner.shape
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 48, 4, runner.dtype, runner.device, runner.backend)
    graphed = GraphedForward(runner, cache, dataclasses.replace(CONFIG, tokens_per_seq=(1, 2, 4)))
    queued.clear()
    due.clear()
    engine = Engine(runner, cache, sampling=GREEDY, stop=stop, graphed=graphed,
                    drafter=RandomTreeDrafter(VOCAB, max_nodes=3, max_depth=2, seed=5),
                    policy=SpeculationPolicy(TreeSizer(CostModel({}, {1: curve}))))
    sizer = engine.policy.sizer
    assert sizer.queues_held_off and sizer.queued_seconds == {} and sizer.plain_price(2) == 1.0
    seqs = engine.add(prompts)
    while engine.live:
        engine.step()
    assert [q.new_tokens for q in seqs] == plain
    # the plain step due (the fifth) queued the sixth: the first step queued, the guard held nobody off before
    assert queued and queued[0] == 5, queued
    assert list(sizer.queued_seconds) == [2]  # drafts priced by it from then on (plain_price: elsewhere)


def test_the_speed_commands_rows_count_the_steps_queued(loaded):
    """benchmarks/bench_speed_gpu.py's share of a run's steps launched before the step before them was read: all but
    the first of plain decoding through buckets, none of eager decoding; the count stops with the run."""
    from tests.script_loading import load_script

    bench = load_script("bench_speed_gpu")
    graphed = GraphedForward.with_cache(loaded.runner, 64, 16, dataclasses.replace(CONFIG, batch_sizes=(1,)))
    row = bench.run_generate(loaded, [[1, 2, 3]], 5, cuda_graphs=graphed)
    assert row["steps"] == 5 and row["queued_share"] == pytest.approx(4 / 5)
    assert bench.run_generate(loaded, [[1, 2, 3]], 3, cuda_graphs=False)["queued_share"] == 0
    assert DecodeAhead.launch.__name__ == "launch"  # unpatched after each run


def test_a_closed_engine_is_freed_at_once_not_at_the_next_garbage_collection(loaded):
    """The engine and its DecodeAhead reference each other: a call's engine (and the target it runs) outlived the
    call until Python's next full collection. Closing the engine breaks the cycle."""
    runner = loaded.runner
    gc.collect()
    gc.disable()
    try:
        _, _, engine = run(runner, [[1, 2, 3]], StopCriteria(4), queue_ahead=True)
        assert engine.ahead is not None
        engine.close(failed=False)
        gone = weakref.ref(engine)
        del engine
        assert gone() is None
    finally:
        gc.enable()
