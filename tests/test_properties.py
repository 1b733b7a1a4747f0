"""Property-based tests (hypothesis) for DraftTree construction / validation, the paged KV cache under
random operation sequences, and greedy identity under random drafters (issue 24).

Every example is derived from a fixed seed (``derandomize=True``, no example database), so a failure
reproduces on every machine; the whole file runs in well under a minute on one core.
"""
from __future__ import annotations

import functools
import math
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from specdec.drafters.base import Drafter

import specdec
from specdec.errors import SpecdecError
from specdec.kv_cache import CacheFullError, PagedKVCache
from specdec.testing import build_tiny_model
from specdec.tree import MAX_TREE_NODES, DraftError, DraftMode, DraftTree


def _settings(n: int, **kw) -> settings:
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **kw)


def one_line_specdec_error(err: BaseException) -> None:
    assert isinstance(err, SpecdecError), f"{type(err).__name__} is not a SpecdecError: {err}"
    msg = str(err)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"


# ---- 1. DraftTree construction and validation ---------------------------------------------------------------------
VOCAB = 8
INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
BAD_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool]


@st.composite
def id_vectors(draw, n: int, valid: list[int]):
    """An id vector of about `n` entries in one of many forms; `valid` is a well-formed int list to start from."""
    values = draw(st.one_of(
        st.just(valid),
        st.lists(st.integers(-3, VOCAB + 3), min_size=n, max_size=n),
        st.lists(st.integers(-2**70, 2**70), min_size=n, max_size=n),
        st.lists(st.integers(-3, VOCAB + 3), min_size=0, max_size=MAX_TREE_NODES + 3),  # wrong length
    ))
    form = draw(st.sampled_from(["list", "tuple", "tensor", "numpy", "floats", "integral floats", "bools",
                                 "mixed bool", "mixed float", "2-D", "0-D", "strings", "ragged", "none",
                                 "list of 0-D tensors"]))
    small = [max(-100, min(100, v)) for v in values]  # what fits any integer dtype (mostly)
    if form == "list":
        return list(values)
    if form == "tuple":
        return tuple(values)
    if form == "tensor":
        return torch.tensor(small, dtype=draw(st.sampled_from(INT_DTYPES + BAD_DTYPES)))
    if form == "numpy":
        return np.array(small).astype(draw(st.sampled_from([np.int64, np.int32, np.uint8, np.float32, np.bool_])))
    if form == "floats":
        return [v + draw(st.sampled_from([0.5, 0.7, -0.3, math.nan, math.inf])) for v in small]
    if form == "integral floats":
        return torch.tensor(small, dtype=torch.float32) if draw(st.booleans()) else [float(v) for v in small]
    if form == "bools":
        return [bool(v % 2) for v in small]
    if form == "mixed bool" and small:
        return small[:-1] + [True]
    if form == "mixed float" and small:
        return small[:-1] + [3.7]
    if form == "2-D":
        return torch.tensor(small).reshape(1, -1)
    if form == "0-D":
        return torch.tensor(small[0]) if small else 3
    if form == "strings":
        return [str(v) for v in small]
    if form == "ragged" and small:
        return [small, [1]]
    if form == "none":
        return None
    if form == "list of 0-D tensors":
        return [torch.tensor(v, dtype=draw(st.sampled_from(INT_DTYPES[:1] + BAD_DTYPES[:1] + BAD_DTYPES[-1:])))
                for v in small]
    return list(values)


@st.composite
def tree_args(draw):
    """Mostly well-formed trees (so the invariants of valid trees get checked), each part broken now and then."""
    n = draw(st.integers(0, MAX_TREE_NODES + 2))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [draw(st.integers(0, VOCAB - 1)) for _ in range(n)]
    mode = draw(st.sampled_from(list(DraftMode) * 3 + [m.value for m in DraftMode] + ["greedy", 3, None]))
    if mode in (DraftMode.WITHOUT_REPLACEMENT, "without_replacement") and draw(st.integers(0, 3)):
        for i in range(n):  # distinct sibling tokens, as sampling without replacement gives (when possible)
            used = {tokens[j] for j in range(i) if parents[j] == parents[i]}
            tokens[i] = next((t for t in range(tokens[i], tokens[i] + VOCAB) if t % VOCAB not in used), 0) % VOCAB
    broken = draw(st.sampled_from(["nothing"] * 4 + ["parent", "token", "probs", "tokens form", "parents form"]))
    if n and broken == "parent":  # forward reference, self-parent, below -1
        i = draw(st.integers(0, n - 1))
        parents[i] = draw(st.sampled_from([i, i + 1, n + 5, -2, -100]))
    if n and broken == "token":
        tokens[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, -7, VOCAB, VOCAB + 5, 2**40]))
    sampled = mode not in (DraftMode.DETERMINISTIC, "deterministic")
    probs_kind = "good" if sampled else "none"
    if broken == "probs":
        probs_kind = draw(st.sampled_from(["none", "good", "negative", "nan", "inf", "unnormalised", "zero at token",
                                           "wrong rows", "wrong vocab", "1-D", "int", "bool", "float16", "bfloat16",
                                           "float64", "list"]))
    probs = _probs(probs_kind, n, tokens, draw(st.integers(0, 2**31 - 1)))
    tokens_in = draw(id_vectors(n, tokens)) if broken == "tokens form" else tokens
    parents_in = draw(id_vectors(n, parents)) if broken == "parents form" else parents
    if broken == "nothing" and draw(st.booleans()):
        tokens_in = torch.tensor(tokens, dtype=draw(st.sampled_from(INT_DTYPES)))
    return tokens_in, parents_in, probs, mode


def _probs(kind: str, n: int, tokens: list[int], seed: int):
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, VOCAB, generator=gen) * 3, -1)
    if kind == "negative" and n:
        probs[0, (tokens[0] + 1) % VOCAB] = -0.1
    elif kind == "nan" and n:
        probs[-1, 0] = math.nan
    elif kind == "inf" and n:
        probs[-1, 0] = math.inf
    elif kind == "unnormalised":
        probs = probs * 1.5
    elif kind == "zero at token" and n:
        probs[0, tokens[0]] = 0.0
    elif kind == "wrong rows":
        probs = torch.softmax(torch.randn(n + 1, VOCAB, generator=gen), -1)
    elif kind == "wrong vocab":
        probs = torch.softmax(torch.randn(n, VOCAB + 1, generator=gen), -1)
    elif kind == "1-D":
        probs = probs.flatten()
    elif kind == "int":
        probs = (probs > 0.5).long()
    elif kind == "bool":
        probs = probs > 0.5
    elif kind in ("float16", "bfloat16", "float64"):
        probs = probs.to(getattr(torch, kind))
    elif kind == "list":
        probs = probs.tolist()
    return probs


def _as_int_list(value) -> list[int] | None:
    """The ids a caller meant, as Python ints, if `value` is a plain 1-D (or 0-D) collection of integers."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.reshape(-1).shape[0] == 0:
            return []  # an empty tensor of any dtype is the empty tree: nothing to truncate
        if value.dtype in (torch.bool, np.bool_) or value.ndim > 1:
            return None
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            return None
        if isinstance(value, np.ndarray) and value.dtype.kind not in "iu":
            return None
        return [int(x) for x in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple)):
        out = []
        for x in value:
            if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_floating_point() and x.dtype != torch.bool:
                x = int(x)
            if isinstance(x, bool) or not isinstance(x, int):
                return None
            out.append(x)
        return out
    return None


def check_valid_tree(tree: DraftTree, tokens_in, parents_in) -> None:
    n = tree.num_nodes
    assert tree.tokens.dtype == torch.long and tree.tokens.dim() == 1
    assert tree.parents.dtype == torch.long and tree.parents.shape == (n,)
    assert n <= MAX_TREE_NODES
    # nothing was truncated or wrapped: the tree holds exactly the integer ids it was given
    assert _as_int_list(tokens_in) == tree.tokens.tolist(), (tokens_in, tree.tokens)
    assert _as_int_list(parents_in) == tree.parents.tolist(), (parents_in, tree.parents)
    assert all(0 <= t < VOCAB for t in tree.tokens.tolist())
    parents = tree.parents.tolist()
    depths = tree.depths.tolist()
    mask, all_bits = tree.ancestor_mask.tolist(), tree.ancestor_bits().tolist()
    for i, p in enumerate(parents):
        assert -1 <= p < i
        assert depths[i] == (1 if p < 0 else depths[p] + 1)
        anc, j = {i}, i
        while (j := parents[j]) >= 0:
            anc.add(j)
        assert {k for k in range(n) if mask[i][k]} == anc
        assert {k for k in range(n) if all_bits[i] >> k & 1} == anc
    paths = tree.paths()
    assert {i for path in paths for i in path} == set(range(n))  # every node lies on a root-to-leaf path
    assert all(parents[path[0]] == -1 and all(parents[b] == a for a, b in pairwise(path)) for path in paths)
    if tree.mode is DraftMode.DETERMINISTIC:
        assert tree.draft_probs is None
    else:
        probs = tree.draft_probs
        assert probs is not None and probs.shape == (n, VOCAB) and probs.is_floating_point()
        assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
        assert torch.allclose(probs.double().sum(-1), torch.ones(n, dtype=torch.float64), atol=1e-6)
        assert bool((probs.gather(1, tree.tokens[:, None]) > 0).all())
    if tree.mode is DraftMode.WITHOUT_REPLACEMENT:
        pairs = list(zip(parents, tree.tokens.tolist(), strict=True))
        assert len(pairs) == len(set(pairs))


@_settings(300)
@given(tree_args())
def test_draft_tree_validates_or_raises_one_line_draft_error(args):
    tokens, parents, probs, mode = args
    try:
        tree = DraftTree(tokens, parents, probs, mode)
    except Exception as err:  # noqa: BLE001 -- the property: only DraftError, one line
        one_line_specdec_error(err)
        assert isinstance(err, DraftError)
        event("refused at construction")
        return
    try:
        tree.validate(VOCAB, drafter="prop")
    except Exception as err:  # noqa: BLE001
        one_line_specdec_error(err)
        assert isinstance(err, DraftError) and str(err).startswith("prop: "), err
        event("refused by validate")
        return
    event(f"valid {tree.mode.value} tree")
    check_valid_tree(tree, tokens, parents)
    tree.validate(VOCAB, drafter="prop")  # validation is idempotent on a valid tree


# ---- 2. the paged KV cache under random operation sequences -------------------------------------------------------
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 2


class CacheMachine(RuleBasedStateMachine):
    """Random add / reserve / write / commit / free / scribble sequences against a reference model kept here:
    per live sequence its committed K/V (dense), how far it has reserved, and how many blocks it holds (those its
    positions need, and after a commit at most one spare, given back when a reservation runs short)."""

    @initialize(block_size=st.sampled_from([1, 2, 3, 4, 16]), num_blocks=st.integers(1, 24))
    def setup(self, block_size, num_blocks):
        self.bs, self.num_blocks = block_size, num_blocks
        self.cache = PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, num_blocks=num_blocks, block_size=block_size)
        self.committed: dict[int, torch.Tensor] = {}  # seq -> [layers, 2, length, heads, dim]
        self.reserved: dict[int, int] = {}  # seq -> end of its writable positions (>= its length)
        self.held: dict[int, int] = {}  # seq -> blocks it holds
        self.next_id = 0
        self.counter = 0.0  # every written value is distinct, so any misplaced K/V shows
        for _ in range(3):
            self.add()

    # ---- helpers ----
    def _blocks(self, positions: int) -> int:
        return -(-positions // self.bs)

    def _pick(self, data, k_max: int) -> list[int]:
        if not self.committed:  # every rule stays enabled (filtered rules make hypothesis give up on examples)
            self.add()
        live = sorted(self.committed)
        return data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=min(k_max, len(live)), unique=True))

    def _fresh(self, n: int) -> torch.Tensor:  # [layers, 2, n, heads, dim] of values never written before
        size = LAYERS * 2 * n * KV_HEADS * HEAD_DIM
        out = torch.arange(self.counter, self.counter + size).reshape(LAYERS, 2, n, KV_HEADS, HEAD_DIM)
        self.counter += size
        return out

    def _snapshot(self):
        c = self.cache
        return (c.kv.clone(), {s: list(t) for s, t in c.block_tables.items()}, dict(c.lengths), list(c._free))

    def _assert_unchanged(self, snap) -> None:
        kv, tables, lengths, free = snap
        assert torch.equal(self.cache.kv.nan_to_num(), kv.nan_to_num()), "a failed operation wrote K/V"
        assert self.cache.block_tables == tables and self.cache.lengths == lengths and self.cache._free == free

    def _expect_full(self, num_new: dict[int, int]) -> bool:
        """Whether reserve_many(num_new) must run out of blocks, from the reference model alone."""
        owned = sum(self._blocks(r) for r in self.reserved.values())
        need = sum(max(0, self._blocks(self.committed[s].shape[2] + n) - self._blocks(self.reserved[s]))
                   for s, n in num_new.items())
        return need > self.num_blocks - owned

    def _reserve(self, num_new: dict[int, int]) -> bool:
        full, snap = self._expect_full(num_new), self._snapshot()
        try:
            self.cache.reserve_many(num_new)
        except CacheFullError as err:
            one_line_specdec_error(err)
            assert full, "CacheFullError although the blocks were free"
            event("out of blocks")
            self._assert_unchanged(snap)  # all-or-nothing: nothing reserved, nothing written
            return False
        assert not full, "reserve_many handed out more blocks than exist"
        need = sum(max(0, self._blocks(self.committed[s].shape[2] + n) - self.held[s]) for s, n in num_new.items())
        if need > self.num_blocks - sum(self.held.values()):  # short: every spare is given back first
            for s in self.held:
                self.held[s] = min(self.held[s], self._blocks(max(self.reserved[s],
                                                                  self.committed[s].shape[2] + num_new.get(s, 0))))
        for s, n in num_new.items():
            self.reserved[s] = max(self.reserved[s], self.committed[s].shape[2] + n)
            self.held[s] = max(self.held[s], self._blocks(self.reserved[s]))
        return True

    # ---- rules ----
    @rule()
    def add(self):
        if len(self.committed) >= 6:
            return
        self.cache.add(self.next_id)
        self.committed[self.next_id] = torch.zeros(LAYERS, 2, 0, KV_HEADS, HEAD_DIM)
        self.reserved[self.next_id] = self.held[self.next_id] = 0
        self.next_id += 1

    @rule(data=st.data())
    def free(self, data):
        (s,) = self._pick(data, 1)
        self.cache.free(s)
        del self.committed[s], self.reserved[s], self.held[s]

    @rule(data=st.data())
    def reserve(self, data):
        seqs = self._pick(data, 3)
        self._reserve({s: data.draw(st.integers(0, 20)) for s in seqs})

    @rule(data=st.data())
    def speculative_step(self, data):
        """Reserve root + tree slots for some sequences, write them, commit an accepted path for each at once."""
        seqs = self._pick(data, 4)
        num_new = {s: data.draw(st.integers(1, 2 * self.bs + 3)) for s in seqs}
        if not self._reserve(num_new):
            return
        keep, written = {}, {}
        for s, n in num_new.items():
            length = self.committed[s].shape[2]
            written[s] = self._fresh(n)
            slots = self.cache.slots(s, length, length + n)
            for layer in range(LAYERS):
                self.cache.write(layer, slots, written[s][layer, 0], written[s][layer, 1])
            keep[s] = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
        self.cache.commit(keep)
        if any(off != j for offsets in keep.values() for j, off in enumerate(offsets)):
            event("commit moved K/V")
        for s, offsets in keep.items():
            self.committed[s] = torch.cat([self.committed[s], written[s][:, :, offsets]], dim=2)
            self.reserved[s] = self.committed[s].shape[2]
            self.held[s] = min(self.held[s], self._blocks(self.reserved[s]) + 1)  # keeps a spare

    @rule(data=st.data())
    def scribble_scratch(self, data):
        """Write garbage into a sequence's reserved-but-uncommitted slots (a verify whose tree is never kept)."""
        (s,) = self._pick(data, 1)
        length, end = self.committed[s].shape[2], self.reserved[s]
        if end > length:
            slots = self.cache.slots(s, length, end)
            junk = self._fresh(end - length)
            for layer in range(LAYERS):
                self.cache.write(layer, slots, junk[layer, 0], junk[layer, 1])

    @rule(data=st.data())
    def bad_commit(self, data):
        """A commit naming offsets that were never reserved or are not increasing fails and changes nothing."""
        seqs = self._pick(data, 3)
        keep = {}
        for s in seqs:
            room = self.reserved[s] - self.committed[s].shape[2]
            keep[s] = sorted(data.draw(st.sets(st.integers(0, room - 1), max_size=room))) if room else []
        bad = data.draw(st.sampled_from(seqs))
        room = self.reserved[bad] - self.committed[bad].shape[2]
        end_of_blocks = self._blocks(self.reserved[bad]) * self.bs - self.committed[bad].shape[2]
        keep[bad] = data.draw(st.sampled_from([[1, 0], [0, 0], [-1], [end_of_blocks], [0, end_of_blocks + 3]]))
        snap = self._snapshot()
        try:
            self.cache.commit(keep)
        except (ValueError, IndexError):
            self._assert_unchanged(snap)
            return
        raise AssertionError(f"commit({keep}) accepted offsets outside the {room} reserved slots")

    # ---- invariants after every step ----
    @invariant()
    def blocks_are_conserved_and_owned_once(self):
        if not hasattr(self, "cache"):
            return
        owned = [b for t in self.cache.block_tables.values() for b in t]
        free = self.cache._free
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(free) == len(set(free)) and not set(free) & set(owned), "a free block is also owned / listed twice"
        assert sorted(owned + free) == list(range(self.num_blocks)), "blocks lost or invented"
        assert self.cache.num_free_blocks == self.num_blocks - sum(self.held.values())

    @invariant()
    def sequences_match_the_reference(self):
        if not hasattr(self, "cache"):
            return
        assert set(self.cache.block_tables) == set(self.committed) == set(self.cache.lengths)
        for s, ref in self.committed.items():
            length = ref.shape[2]
            assert self.cache.lengths[s] == length
            assert len(self.cache.block_tables[s]) == self.held[s] <= self._blocks(self.reserved[s]) + 1, \
                "waste beyond the reservation and one spare"
            got = self.cache.kv[:, :, self.cache.slots(s, 0, length)]
            assert torch.equal(got, ref), f"committed K/V of sequence {s} differ from the reference"

    @invariant()
    def slots_follow_the_block_tables(self):
        # slots() serves a kept slot row (grown on reserve, cut when blocks go): it must equal the block-table
        # formula for every reserved position, and refuse one past them (a spare block's too, until reserved)
        if not hasattr(self, "cache"):
            return
        for s, table in self.cache.block_tables.items():
            reserved = self.reserved[s]
            want = [table[p // self.bs] * self.bs + p % self.bs for p in range(reserved)]
            assert self.cache.slots(s, 0, reserved).tolist() == want, f"slot map of sequence {s} is stale"
            if reserved:
                assert self.cache.slots(s, reserved - 1, reserved).tolist() == want[-1:]
            with pytest.raises(IndexError):
                self.cache.slots(s, 0, reserved + 1)


CacheMachine.TestCase.settings = _settings(60, stateful_step_count=40)
test_kv_cache_random_operations = CacheMachine.TestCase


# ---- 3. greedy identity under random drafters ---------------------------------------------------------------------
GREEDY_VOCAB = 24


@functools.cache
def _greedy_model():
    return build_tiny_model("llama-gqa-tied", vocab_size=GREEDY_VOCAB, seed=3)


class HypothesisDrafter(Drafter):
    """Draws every draft tree from hypothesis: random shapes, tokens either random or the target's own greedy
    continuation at that depth (so whole paths get accepted now and then), in one draft mode; sampled modes
    carry random (positive) draft_probs rows."""

    name = "hypothesis"

    def __init__(self, data, plain: list[list[int]], mode: DraftMode) -> None:
        self.data, self.plain, self.mode = data, plain, mode
        self.proposed = self.follow = 0

    def _tree(self, seq) -> DraftTree:
        draw = self.data.draw
        cont = self.plain[seq.seq_id][len(seq.token_ids):]  # what plain greedy emits next
        n = draw(st.integers(0, 12), label="nodes")
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        for i in range(n):
            parent = draw(st.integers(-1, i - 1), label="parent")
            depth = 1 if parent < 0 else depths[parent] + 1
            if draw(st.booleans(), label="follow greedy") and depth <= len(cont):
                token = cont[depth - 1]
                self.follow += 1
            else:
                token = draw(st.integers(0, GREEDY_VOCAB - 1), label="token")
            if self.mode is DraftMode.WITHOUT_REPLACEMENT:  # siblings distinct
                used = {tokens[j] for j in range(i) if parents[j] == parent}
                token = next(t % GREEDY_VOCAB for t in range(token, token + GREEDY_VOCAB)
                             if t % GREEDY_VOCAB not in used)
            tokens.append(token)
            parents.append(parent)
            depths.append(depth)
        self.proposed += n
        if self.mode is DraftMode.DETERMINISTIC or not n:
            return DraftTree(tokens, parents) if n else DraftTree.empty()
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="draft_probs seed"))
        draft_probs = torch.softmax(torch.randn(n, GREEDY_VOCAB, generator=gen) * 2, -1)  # > 0 everywhere
        return DraftTree(tokens, parents, draft_probs, self.mode)

    def propose(self, seqs):
        return [self._tree(s) for s in seqs]


@_settings(15)
@given(data=st.data())
def test_greedy_output_under_random_drafters_equals_plain_greedy(data):
    model = _greedy_model()
    prompts = data.draw(st.lists(st.lists(st.integers(1, GREEDY_VOCAB - 1), min_size=1, max_size=12),
                                 min_size=1, max_size=3), label="prompts")
    max_new_tokens = data.draw(st.integers(1, 24), label="max_new_tokens")
    eos = data.draw(st.none() | st.integers(0, GREEDY_VOCAB - 1), label="eos_token_id")
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    mode = data.draw(st.sampled_from(list(DraftMode)), label="mode")
    plain = specdec.generate(model, prompts, max_new_tokens=max_new_tokens, eos_token_id=eos)
    drafter = HypothesisDrafter(data, plain, mode)
    out = specdec.generate(model, prompts, max_new_tokens=max_new_tokens, eos_token_id=eos, drafter=drafter,
                           block_size=block_size, return_dict=True)
    assert out.sequences == plain
    accepted = sum(sum(s.depth_accepted) for s in out.stats)
    event("drafts accepted" if accepted else "no draft accepted")
