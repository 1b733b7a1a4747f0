"""The engine's side of the drafter contract: attach() once, the hidden state before the root."""
from __future__ import annotations

import torch
from specdec.drafters.base import Drafter, TargetView

from specdec.generate import generate
from specdec.testing import build_tiny_model
from specdec.tree import DraftTree


class HiddenRecorder(Drafter):
    """Proposes 2 true next tokens then a wrong one (so accepted paths of length 2 occur),
    and records, per step, the tokens and the hidden state it was given."""

    name = "hidden-recorder"
    needs_hidden_states = True

    def __init__(self, references: dict[tuple[int, ...], list[int]]) -> None:
        self.references = references  # prompt -> plain greedy continuation
        self.attached: list[TargetView] = []
        self.seen: list[tuple[list[int], torch.Tensor | None]] = []

    def attach(self, target: TargetView) -> None:
        self.attached.append(target)

    def propose(self, seqs):
        trees = []
        for v in seqs:
            self.seen.append((list(v.token_ids), v.last_hidden))
            ref = self.references[tuple(v.token_ids[: v.num_prompt_tokens])]
            done = len(v.token_ids) - v.num_prompt_tokens
            true_next = ref[done : done + 2]
            trees.append(DraftTree.chain(true_next + [(ref[done + 2] + 1) % 96] if len(ref) > done + 2 else true_next))
        return trees


def test_drafter_is_attached_once_and_sees_the_hidden_state_of_the_token_before_the_root():
    model = build_tiny_model("llama-gqa-tied")
    prompts = [[5, 9, 11, 2], [7]]
    plain = generate(model, prompts, max_new_tokens=30)
    drafter = HiddenRecorder({tuple(p): seq[len(p):] for p, seq in zip(prompts, plain, strict=True)})
    # every chain verified whole: sized by the policy, the chains were cut where the guard priced a slow propose
    # call on a loaded machine, and tau fell below what the test asks
    out = generate(model, prompts, drafter=drafter, max_new_tokens=24, return_dict=True, speculation="always")
    assert all(s.tau > 2.5 for s in out.stats)  # accepted paths really were followed
    assert len(drafter.attached) == 1
    assert drafter.attached[0].cache is not None and drafter.attached[0].sampling.do_sample is False
    assert drafter.attached[0].graphs is False  # eager verify steps (graphs are replayed on CUDA only)
    checked = 0
    for tokens, hidden in drafter.seen:
        if len(tokens) < 2:
            assert hidden is None  # a one-token prompt has nothing before its root
            continue
        with torch.no_grad():
            ref = model.model(torch.tensor([tokens[:-1]])).last_hidden_state[0, -1]
        torch.testing.assert_close(hidden, ref, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= 10


class RowsRecorder(Drafter):
    """Records every hidden-state row it is given, per sequence; proposes nothing."""

    name = "rows-recorder"
    needs_hidden_states = True

    def __init__(self) -> None:
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.tokens: dict[int, list[int]] = {}

    def propose(self, seqs):
        for v in seqs:
            if v.new_hidden is not None:
                self.rows.setdefault(v.seq_id, []).append(v.new_hidden.clone())
            self.tokens[v.seq_id] = list(v.token_ids)
        return [DraftTree.empty() for _ in seqs]


def test_a_drafter_the_guard_skipped_gets_every_row_committed_meanwhile(monkeypatch):
    """Steps decoded plainly keep their hidden states for the drafter: when next asked it gets every position
    committed since it last saw one (EAGLE catches up on them), each position once, in order."""
    from specdec.speculation_policy import SpeculationPolicy

    calls = []

    def every_third_step(self, live):  # the guard asks the drafter one step in three
        calls.append(1)
        return live if len(calls) % 3 == 1 else []

    monkeypatch.setattr(SpeculationPolicy, "who_drafts", every_third_step)
    model = build_tiny_model("llama-gqa-tied")
    drafter = RowsRecorder()
    generate(model, [[5, 9, 11, 2], [7, 3]], drafter=drafter, max_new_tokens=20, speculation="always")
    assert len(calls) >= 18 and set(drafter.rows) == {0, 1}
    for seq_id, chunks in drafter.rows.items():
        tokens = drafter.tokens[seq_id]  # as of its last call: rows of every position before its root
        assert len(chunks) >= 5
        with torch.no_grad():
            ref = model.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        torch.testing.assert_close(torch.cat(chunks), ref, atol=1e-4, rtol=1e-4)


class Mutator(Drafter):
    """A careless plugin: it edits the tokens it was shown, then proposes nothing."""

    name = "mutator"

    def __init__(self) -> None:
        self.errors: list[str] = []

    def propose(self, seqs):
        for v in seqs:
            for edit in (lambda t: t.append(5), lambda t: t.__setitem__(-1, 5), lambda t: t.extend([5, 5])):
                try:
                    edit(v.token_ids)
                except (AttributeError, TypeError) as err:
                    self.errors.append(type(err).__name__)
        return [DraftTree.empty() for _ in seqs]


def test_a_drafter_cannot_change_committed_tokens():
    model = build_tiny_model()
    prompts = [[1, 2, 3], [4, 5]]
    plain = generate(model, prompts, max_new_tokens=6)
    mutator = Mutator()
    # speculation="always": the guard would stop asking a drafter that never proposes anything
    assert generate(model, prompts, max_new_tokens=6, drafter=mutator, speculation="always") == plain
    assert mutator.errors and len(mutator.errors) == 3 * 2 * 6  # every edit, every sequence, every step refused


def test_the_target_view_says_whether_verify_steps_replay_cuda_graphs():
    """Drafters that price verify steps (the combined drafter's cost model) price them as the engine runs them."""
    from types import SimpleNamespace

    from specdec.engine import Engine
    from specdec.kv_cache import PagedKVCache
    from specdec.models.llama import LlamaRunner
    from specdec.sampling import SamplingConfig
    from specdec.stopping import StopCriteria

    runner = LlamaRunner(build_tiny_model("llama-gqa-tied"))
    s = runner.shape
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 8, 16, runner.dtype, runner.device, runner.backend)
    for capture in (True, False):
        drafter = HiddenRecorder({})
        graphed = SimpleNamespace(config=SimpleNamespace(capture=capture))  # what the engine reads of its graphs
        Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(4), drafter=drafter, graphed=graphed)
        assert drafter.attached[0].graphs is capture


class Remembering(Drafter):
    """Keeps per-sequence history, as the contract allows, and forgets it in release()."""

    name = "remembering"

    def __init__(self) -> None:
        self.history: dict[int, int] = {}
        self.target = None

    def attach(self, target: TargetView) -> None:
        self.target = self.attached = target  # the default detach drops target; attached: the test's own hold

    def propose(self, seqs):
        for v in seqs:
            self.history[v.seq_id] = len(v.token_ids)
        return [DraftTree.chain([1]) for _ in seqs]

    def release(self, seq_id: int) -> None:
        del self.history[seq_id]


def test_a_call_that_raises_releases_its_sequences_and_frees_its_cache():
    """A call that ended on an exception (here its streamer's) never released its live sequences from the drafter,
    which met their ids again in the next call as if they were its own; and a drafter reused across calls kept the
    last call's whole KV pool alive (through its TargetView) until its next call."""
    import pytest

    model = build_tiny_model("llama-gqa-tied")
    drafter = Remembering()

    def streamer(seq, tokens):
        raise RuntimeError("the client went away")

    with pytest.raises(RuntimeError, match="the client went away"):
        generate(model, [[5, 9, 11, 2], [7, 3]], drafter=drafter, max_new_tokens=8, streamer=streamer)
    assert drafter.history == {}  # both sequences released
    assert drafter.attached.cache.num_blocks == 0 and drafter.attached.cache.kv.numel() == 0
    out = generate(model, [[5, 9, 11, 2]], drafter=drafter, max_new_tokens=8)
    assert out == generate(model, [[5, 9, 11, 2]], max_new_tokens=8) and drafter.history == {}
    assert drafter.attached.cache.kv.numel() == 0  # freed after a call that ended normally too


class Detaching(Remembering):
    """Logs its releases and its detach, where it drops its target view (the contract's end of a call)."""

    name = "detaching"

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def release(self, seq_id: int) -> None:  # the guard may have left a sequence undrafted: no history then
        self.history.pop(seq_id, None)
        self.log.append("release")

    def detach(self) -> None:
        self.log.append("detach")
        self.target = None


def test_detach_ends_every_call_after_its_releases(caplog):
    """Drafter.detach: a reused drafter kept the last call's TargetView (and with it the target model) until its
    next call. The engine now calls detach() once at the end of every call, after its releases, a raising call too;
    a plain object's detach() through its wrapper. One that raises is logged after a failed call, never raised
    over the call's own error, and raised after a call that succeeded (a drafter's bug, not to be swallowed)."""
    import pytest

    model, prompts = build_tiny_model("llama-gqa-tied"), [[5, 9, 11, 2], [7, 3]]
    drafter = Detaching()
    generate(model, prompts, drafter=drafter, max_new_tokens=8)
    assert drafter.log == ["release", "release", "detach"] and drafter.target is None and drafter.history == {}

    def streamer(seq, tokens):
        raise RuntimeError("the client went away")

    drafter.log.clear()
    with pytest.raises(RuntimeError, match="the client went away"):
        generate(model, prompts, drafter=drafter, max_new_tokens=8, streamer=streamer)
    assert drafter.log == ["release", "release", "detach"] and drafter.target is None

    class Plain:
        detached = 0

        def propose(self, seqs):
            return [DraftTree.chain([1]) for _ in seqs]

        def detach(self):
            self.detached += 1
            if self.detached >= 2:
                raise RuntimeError("detach failed")

    plain, expected = Plain(), generate(model, prompts, max_new_tokens=8)
    assert generate(model, prompts, drafter=plain, max_new_tokens=8) == expected
    with pytest.raises(RuntimeError, match="detach failed"):
        generate(model, prompts, drafter=plain, max_new_tokens=8)
    assert plain.detached == 2 and "detach() raised" not in caplog.text
    with pytest.raises(RuntimeError, match="the client went away"):
        generate(model, prompts, drafter=plain, max_new_tokens=8, streamer=streamer)
    assert plain.detached == 3 and "detach() raised" in caplog.text
    assert generate(model, prompts, max_new_tokens=8) == expected  # the pool and model as they were


class FailingTwice(Remembering):
    """Its third propose raises, and so does its release: a drafter broken in its clean-up too."""

    name = "failing-twice"

    def propose(self, seqs):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("the drafter's own error")
        return super().propose(seqs)

    def release(self, seq_id: int) -> None:
        raise RuntimeError("release failed too")


def test_a_drafter_whose_release_raises_leaves_the_calls_error_and_the_streamer_ended(caplog):
    """The end of a failed call released sequences unguarded: a release() that raised skipped the streamer's end()
    (a reader iterating it waited for ever), the other sequences and the cache, and its error replaced the call's."""
    import pytest

    class Streamer:
        ended = False

        def put(self, value):
            pass

        def end(self):
            self.ended = True

    model, streamer = build_tiny_model("llama-gqa-tied"), Streamer()
    with pytest.raises(RuntimeError, match="the drafter's own error"):
        generate(model, [[5, 9, 11, 2]], drafter=FailingTwice(), max_new_tokens=8, streamer=streamer,
                 speculation="always")  # the guard may skip the drafter on a fast CPU: its 3rd propose must come
    assert streamer.ended and "release(0) raised" in caplog.text


class Refill(Drafter):
    """Builds one sampled DraftTree per sequence once and refills its tensors in place each step: the first step's
    draft is uniform, every later one all mass on token ``A`` (drawn honestly from what it writes)."""

    name = "refill"
    A = 50

    def __init__(self, vocab: int) -> None:
        self.vocab, self.trees, self.steps = vocab, {}, 0

    def propose(self, seqs):
        self.steps += 1
        out = []
        for s in seqs:
            if s.seq_id not in self.trees:  # the tree and its own buffers
                tokens, probs = torch.zeros(1, dtype=torch.long), torch.full((1, self.vocab), 1.0 / self.vocab)
                self.trees[s.seq_id] = DraftTree(tokens, torch.tensor([-1]), probs, "independent"), tokens, probs
            tree, tokens, probs = self.trees[s.seq_id]
            if self.steps > 1:
                probs.zero_()[0, self.A] = 1.0
                tokens[0] = self.A
            out.append(tree)
        return out


def test_a_tree_refilled_in_place_is_verified_with_its_new_draft_probs():
    """The engine never writes a drafter's tree: had it left its normalised copy of the first step's draft_probs
    there, later steps would verify the point-mass drafts of A against a uniform draft (acceptance ~min(1, V p(A))
    instead of p(A)): A would be a large share of the text, where the target gives it ~1%."""
    model = build_tiny_model(vocab_size=96, seed=0)
    drafter = Refill(96)
    out = generate(model, [[1, 5, 9, 11, 3]] * 48, max_new_tokens=6, drafter=drafter, do_sample=True, seed=5,
                   audit_drafts=False, speculation="always")
    new = [t for row in out for t in row[5:]]
    share = new.count(Refill.A) / len(new)
    assert drafter.steps > 2 and share < 0.1, share
    tree, _, probs = next(iter(drafter.trees.values()))
    assert tree.draft_probs is probs  # its object never written


class Keeper(Drafter):
    """Proposes a repeat of the root and tries to extend the tokens it is told were committed."""

    name = "keeper"

    def __init__(self) -> None:
        self.refused = 0

    def propose(self, seqs):
        return [DraftTree.chain([s.token_ids[-1]]) for s in seqs]

    def on_accept(self, seq_id, committed):
        try:
            committed.append(77)
        except AttributeError:
            self.refused += 1


def test_what_on_accept_is_given_is_not_the_engines_own_list():
    """The committed tokens a drafter is handed are not the list the engine streams, prices and logs: extending it
    streamed tokens that were never generated (and broke output_logprobs)."""
    model = build_tiny_model()
    prompts = [[1, 5, 9, 11, 3], [2, 7, 7, 4]]
    streamed = {}
    for drafter in (None, Keeper()):
        rows: list[list[int]] = [[], []]
        out = generate(model, prompts, max_new_tokens=12, drafter=drafter, speculation="always",
                       streamer=lambda b, tokens, rows=rows: rows[b].extend(tokens))
        streamed[drafter is None] = rows
        assert [r[len(p):] for r, p in zip(out, prompts, strict=True)] == rows
    assert streamed[True] == streamed[False] and drafter.refused > 0


def test_new_hidden_joins_every_chunk_the_drafter_has_not_seen():
    """A prefill's 2 rows then two guard-held steps' 1 row each: the drafter gets all 2 + 1 + 1 = 4 rows, in order."""
    from specdec.engine import SequenceState

    chunks = [torch.tensor([[0.0], [1.0]]), torch.tensor([[2.0]]), torch.tensor([[3.0]])]
    for n in (2, 3):
        s = SequenceState(0, [1, 2, 3], 3, hidden_chunks=list(chunks[:n]))
        assert s.new_hidden[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0][: n + 1]
