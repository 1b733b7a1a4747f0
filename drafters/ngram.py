"""N-gram (prompt-lookup) drafter: proposes continuations copied from earlier in the text.

The last ``n`` tokens of a sequence (prompt + everything generated) are looked up among
their earlier occurrences, longest ``n`` first; the tokens that followed each occurrence
are candidate continuations. Distinct candidates are merged into a trie (shared prefixes
share nodes) and proposed as one DETERMINISTIC draft tree. No model, no probabilities:
it shines wherever the output copies the input (summaries, code edits, chat quoting).

    drafter = get_drafter("ngram", min_ngram=1, max_nodes=24)
    trees = drafter.propose([SequenceView(0, token_ids, num_prompt_tokens)])

Every node carries ``scores``: the acceptance rate, observed in this run (``on_accept``), of nodes at
its depth drafted from a match of its length (a longer match is more reliable), so the engine's tree
sizing (:mod:`specdec.tree_sizing`) keeps what is expected to pay. The drafter proposes generously;
with ``speculation="always"`` the whole tree is verified.

Each sequence keeps an incremental index (n-gram -> end positions) that is extended only by the tokens appended
since the previous call. Keys of up to three tokens are stored: a longer key's occurrences are those of its last
three tokens that match further back, found at each lookup (a triple recurs far less than a single token or a
pair), so a prompt is indexed in about half the time that storing every key length took. A triple met
``SPLIT_FROM`` times or more (code's indentation) has its occurrences grouped by the token before each, kept
up to date, so only those after the same token are scanned. A step costs O(new tokens + occurrences scanned +
tree size); a run of one repeated token is not read whole (:meth:`NGramDrafter._longer_matches`).
Copies of a prompt (:mod:`specdec.drafters.prompt_copies`) index it once: each copy starts from a copy of its
first's index over the prompt (same keys, same positions) and indexes only its own tokens after it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from specdec.drafters.base import Drafter, SequenceView
from specdec.drafters.prompt_copies import leaders, prompt_copies

from specdec.errors import InputError, InputTypeError
from specdec.tree import MAX_TREE_NODES, DraftTree, tried_nodes

logger = logging.getLogger(__name__)
BULK_INDEX = 32  # new end positions from which _sync indexes by columns (a prompt), not position by position
STORED_KEY = 3  # the longest key the index stores (module doc); from min_ngram up, or min_ngram alone if longer
SPLIT_FROM = 16  # occurrences of the longest stored key from which they are split by the token before each


@dataclass(frozen=True)
class NGramConfig:
    # Generous by design: the engine keeps the part of the tree that its measured cost model and the
    # acceptance observed per (match length, depth) expect to pay (speculation="auto"), so these
    # bound the proposal, not what is verified.
    min_ngram: int = 1  # shortest key tried
    max_ngram: int = 6  # longest key, tried first (longer = more reliable match)
    num_draft_tokens: int = 6  # depth limit of every branch
    max_branches: int = 3  # distinct continuations merged into the tree
    max_nodes: int = 32  # total tree size (<= 64)
    max_occurrences: int = 8  # most recent occurrences scanned per n (bounds per-step work)
    # a match of >= long_match_ngram tokens is trusted with a chain of at least long_draft_tokens (0 = off)
    long_match_ngram: int = 4
    long_draft_tokens: int = 16

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InputError(f"ngram drafter: {f.name} must be an int, got {value!r}")
            low = 0 if f.name == "long_draft_tokens" else 1  # 0: no long chains
            if value < low:
                raise InputError(f"ngram drafter: {f.name} must be >= {low}, got {value}")
        if self.max_ngram < self.min_ngram:
            raise InputError(
                f"ngram drafter: max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})"
            )
        if self.max_nodes > MAX_TREE_NODES:
            raise InputError(
                f"ngram drafter: max_nodes must be <= {MAX_TREE_NODES} (the tree-mask limit), got {self.max_nodes}"
            )


class _SeqIndex:
    """Index of one sequence: its tokens, and for each stored key length n (``min_ngram`` up to ``STORED_KEY``, or
    ``min_ngram`` alone if longer) and every end position e with n - 1 <= e <= length - 2,
    ``tables[n][tuple(tokens[e-n+1:e+1])]`` contains e, the lists increasing (so the most recent occurrence is
    last). Only occurrences followed by at least one token are indexed, so the current key never matches itself.
    Longer keys are matched at each lookup (:meth:`NGramDrafter._longer_matches`); ``before[key]``, for a longest
    stored key met with ``SPLIT_FROM`` occurrences or more, holds those with a token before them, by that token (in
    increasing order too), so that a frequent key's longer matches are not looked for among all of them."""

    __slots__ = ("length", "tokens", "tables", "before")

    def __init__(self, stored: range) -> None:
        self.length = 0  # number of tokens of the sequence seen (indexed up to end length-2)
        self.tokens: list[int] = []  # the sequence's tokens seen, as ints
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in stored}
        self.before: dict[tuple[int, ...], dict[int, list[int]]] = {}  # made when first needed

    def copy(self) -> _SeqIndex:
        """An index of its own with the same content (no list shared: each sequence appends to its own); its
        ``before`` is made again where needed."""
        twin = _SeqIndex.__new__(_SeqIndex)
        twin.length, twin.tokens, twin.before = self.length, list(self.tokens), {}
        twin.tables = {n: {key: list(ends) for key, ends in table.items()} for n, table in self.tables.items()}
        return twin


class NGramDrafter(Drafter):
    options_config = NGramConfig  # what **options configure (drafters.registry.option_names)
    name = "ngram"
    looks_back = True  # its proposals are host-side lookups: a held-off sequence is asked in hindsight
    python_only_options = frozenset({"config"})  # not --drafter-option keys (drafters.registry)

    def __init__(self, config: NGramConfig | None = None, **options: int) -> None:
        if config is not None and options:
            raise InputError("ngram drafter: pass either config= or keyword options, not both")
        if config is not None and not isinstance(config, NGramConfig):
            raise InputTypeError(f"ngram drafter: config must be an NGramConfig, got {type(config).__name__}")
        if config is None:
            known = {f.name for f in fields(NGramConfig)}
            unknown = sorted(set(options) - known)
            if unknown:
                raise InputError(f"ngram drafter: unknown option(s) {unknown}; valid: {sorted(known)}")
            config = NGramConfig(**options)
            # given by name, a long match no key can reach is a mistake (long_draft_tokens=0 turns chains off); a
            # default long_match_ngram above a small max_ngram just leaves them off (docs/drafters/ngram.md)
            long, most = config.long_match_ngram, config.max_ngram
            if "long_match_ngram" in options and config.long_draft_tokens and long > most:
                raise InputError(f"ngram drafter: long_match_ngram={long} exceeds max_ngram={most}, so long chains "
                                 "could never start; raise max_ngram, or pass long_draft_tokens=0 to turn them off")
            chain, depth = config.long_draft_tokens, config.num_draft_tokens
            if "long_draft_tokens" in options and 0 < chain <= depth:  # a long match drafts max(chain, depth) deep
                raise InputError(f"ngram drafter: long_draft_tokens={chain} is not above num_draft_tokens={depth}, so "
                                 "a long match would draft no deeper than any match; raise it, or pass 0 to turn long "
                                 "chains off")
            if "long_match_ngram" in options and not chain:
                raise InputError(f"ngram drafter: long_match_ngram={long} starts long chains, which "
                                 "long_draft_tokens=0 turns off; drop one of them")
        self.config = config
        # the key lengths the index stores (module doc); longer keys are matched from the longest stored one
        self._stored = range(config.min_ngram, min(config.max_ngram, max(config.min_ngram, STORED_KEY)) + 1)
        self._index: dict[int, _SeqIndex] = {}
        # instrumentation (tests, profiling): n-gram insertions and occurrences scanned, ever
        self.index_updates = 0
        self.occurrences_scanned = 0
        # acceptance observed in this run: (match length, depth) -> [accepted, tried], for every sequence
        self.acceptance: dict[tuple[int, int], list[float]] = {}
        self._pending: dict[int, tuple[list[int], list[int], list[tuple[int, int]]]] = {}  # seq -> proposed tree

    # ---- Drafter API ----------------------------------------------------------------------
    def attach(self, target) -> None:
        """A new run: what was learned from earlier runs' text is forgotten, so an instance reused across
        generate() calls drafts as a fresh one would (a seed gives one text whatever ran before)."""
        super().attach(target)
        self._index.clear()
        self._pending.clear()
        self.acceptance.clear()

    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        self._index_prompt_copies(seqs)
        return [self._propose_one(s) for s in seqs]

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
        self._pending.pop(seq_id, None)

    def on_accept(self, seq_id: int, committed: Sequence[int]) -> None:
        """Learn from the tree proposed for ``seq_id`` (whatever part of it was verified): a node was tried when
        its parent's path equals the committed tokens, accepted when its own token is the next one."""
        pending = self._pending.pop(seq_id, None)
        if pending is None:
            return
        tokens, parents, keys = pending
        for i, accepted in tried_nodes(tokens, parents, committed):
            entry = self.acceptance.setdefault(keys[i], [0.0, 0.0])
            entry[0] += accepted
            entry[1] += 1.0

    def score(self, match: int, depth: int) -> float:
        """Estimated P(accepted | parent accepted) of a node at ``depth`` drafted from a ``match``-token match:
        the rate observed so far, behind two pseudo-observations of a prior that grows with the match."""
        return self._rate(self._key(match, depth))

    def _rate(self, key: tuple[int, int]) -> float:  # score() of a (match, capped depth) key
        acc, tried = self.acceptance.get(key, (0.0, 0.0))
        prior = min(0.9, 0.2 + 0.1 * key[0])
        return (acc + 2.0 * prior) / (tried + 2.0)

    @staticmethod
    def _key(match: int, depth: int) -> tuple[int, int]:
        return (match, min(depth, 8))

    # ---- internals --------------------------------------------------------------------------
    def _index_prompt_copies(self, seqs: Sequence[SequenceView]) -> None:
        """Copies of a prompt never indexed before: the first indexes the prompt, the others copy its index (module
        doc); each then indexes its own tokens after the prompt in :meth:`_sync`."""
        copies = prompt_copies(seqs, lambda v: v.seq_id not in self._index)
        for first, group in leaders(copies).items():
            seq = seqs[first]
            prompt = self._sync(seq.seq_id, seq.token_ids[: seq.num_prompt_tokens])
            for i in group:
                self._index[seqs[i].seq_id] = prompt.copy()

    def _sync(self, seq_id: int, tokens: Sequence[int]) -> _SeqIndex:
        """Bring the index of `seq_id` up to date with `tokens`, touching only new tokens."""
        cfg = self.config
        idx = self._index.get(seq_id)
        length = len(tokens)
        if idx is not None:
            start = max(idx.length - cfg.max_ngram - 1, 0)
            # O(max_ngram) check: a shorter history or a changed tail means a different sequence
            if length < idx.length or [int(t) for t in tokens[start : idx.length]] != idx.tokens[start:]:
                logger.debug("ngram: history of seq %d changed; rebuilding its index", seq_id)
                idx = None
        if idx is None:
            idx = self._index[seq_id] = _SeqIndex(self._stored)
        if length == idx.length:
            return idx
        # new end positions e in [old_length - 1, length - 2]; each needs tokens e-n+1..e
        first_e = max(idx.length - 1, cfg.min_ngram - 1)
        idx.tokens += [int(t) for t in tokens[idx.length : length]]
        if length - 1 - first_e >= BULK_INDEX:  # a prompt (the first step): each n's keys at once
            self._index_bulk(idx, first_e, length)
            idx.before.clear()  # made again where needed, with these ends
        else:  # a step's few tokens: a plain loop costs less than building columns
            toks, base = idx.tokens, self._stored[-1]
            for e in range(first_e, length - 1):
                for n, table in idx.tables.items():
                    if e - n + 1 < 0:
                        continue
                    key = tuple(toks[e - n + 1 : e + 1])
                    table.setdefault(key, []).append(e)
                    self.index_updates += 1
                    if n == base and e >= base and key in idx.before:
                        idx.before[key].setdefault(toks[e - base], []).append(e)
        idx.length = length
        return idx

    def _index_bulk(self, idx: _SeqIndex, first_e: int, length: int) -> None:
        """:meth:`_sync`'s indexing of end positions first_e .. length - 2 for many of them: per n, every key
        tokens[e-n+1 .. e] from n shifted columns zipped (loops in C), about half the time of the per-position loop
        over a long prompt, which is indexed in the first step, on the host's critical path."""
        toks = idx.tokens
        for n, table in idx.tables.items():
            start = max(first_e, n - 1)  # this n's new end positions: start .. length - 2
            if start >= length - 1:
                continue
            columns = [toks[start - n + 1 + i : length - n + i] for i in range(n)]
            get = table.get
            for e, key in zip(range(start, length - 1), zip(*columns, strict=True), strict=True):
                found = get(key)
                if found is None:
                    table[key] = [e]
                else:
                    found.append(e)
            self.index_updates += length - 1 - start

    def _longer_matches(self, idx: _SeqIndex, length: int, longest: int) -> list[tuple[int, int]]:
        """(e, m), most recent first, for occurrences e of the sequence's last ``base`` tokens (the longest stored
        key) that match further back: m (> base, <= ``longest``) of its last tokens end at e, so a key of n > base
        tokens occurs at e where m >= n, as a stored table of n would have it. The scan stops once
        ``max_occurrences`` ends match ``longest`` tokens: every n's most recent ``max_occurrences`` are then
        among those seen (a run of one repeated token is not read whole at every step)."""
        base, most = self._stored[-1], self.config.max_occurrences
        toks = idx.tokens
        key = tuple(toks[length - base :])
        ends = idx.tables[base].get(key, ())
        if len(ends) >= SPLIT_FROM:  # a frequent key: only its ends after the same token can match further back
            split = idx.before.get(key)
            if split is None:
                split = idx.before[key] = {}
                for e in ends:
                    if e >= base:
                        split.setdefault(toks[e - base], []).append(e)
            ends = split.get(toks[length - 1 - base], ())
        out, whole = [], 0
        for e in reversed(ends):
            m = base
            while m < longest and e - m >= 0 and toks[e - m] == toks[length - 1 - m]:
                m += 1
            if m > base:
                out.append((e, m))
                whole += m == longest
                if whole == most:
                    break
        return out

    def _propose_one(self, seq: SequenceView) -> DraftTree:
        cfg = self.config
        tokens = seq.token_ids
        idx = self._sync(seq.seq_id, tokens)
        length = len(tokens)
        toks, base = idx.tokens, self._stored[-1]
        longest = min(cfg.max_ngram, length - 1)
        longer = self._longer_matches(idx, length, longest) if longest > base else []
        # the trie: node i has token node_tokens[i], parent node_parents[i]; children[p+1]
        # maps token -> child node of p (p = -1 is the root), so siblings are distinct
        node_tokens: list[int] = []
        node_parents: list[int] = []
        children: list[dict[int, int]] = [{}]
        node_match: list[int] = []  # match length of the branch that added each node
        branches = 0
        # an end position met again under a shorter key: its continuation is in the trie already, as deep (a
        # shorter match never drafts deeper), and would add no node
        inserted: set[int] = set()
        for n in range(longest, cfg.min_ngram - 1, -1):
            if n > base:  # the most recent max_occurrences ends first
                recent = [e for e, m in longer if m >= n][: cfg.max_occurrences]
            else:
                recent = reversed(idx.tables[n].get(tuple(toks[length - n :]), [])[-cfg.max_occurrences :])
            for e in recent:
                if e in inserted:
                    continue
                inserted.add(e)
                self.occurrences_scanned += 1
                depth = cfg.num_draft_tokens
                if cfg.long_draft_tokens and n >= cfg.long_match_ngram:
                    depth = max(depth, cfg.long_draft_tokens)
                added = self._insert(toks, length, e + 1, depth, node_tokens, node_parents, children)
                node_match += [n] * added
                branches += added > 0  # a duplicate (or prefix) of an earlier branch is free
                if branches >= cfg.max_branches or len(node_tokens) >= cfg.max_nodes:
                    break
            if branches >= cfg.max_branches or len(node_tokens) >= cfg.max_nodes:
                break
        if not node_tokens:
            self._pending.pop(seq.seq_id, None)
            return DraftTree.empty()
        depths: list[int] = []
        for p in node_parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        keys = [self._key(n, d) for n, d in zip(node_match, depths, strict=True)]
        self._pending[seq.seq_id] = (node_tokens, node_parents, keys)
        rates = {key: self._rate(key) for key in set(keys)}  # nodes share a few (match, depth) keys
        scores = torch.tensor([rates[key] for key in keys], dtype=torch.float32)
        # well formed where it is made (a trie of ints, parents first, at most max_nodes, rates in [0, 1]): built
        # without the construction checks, which cost more than the drafting (the engine validates every proposal)
        return DraftTree.unchecked(torch.tensor(node_tokens, dtype=torch.long),
                                   torch.tensor(node_parents, dtype=torch.long), scores=scores)

    def _insert(self, tokens, length, start, depth, node_tokens, node_parents, children) -> int:
        """Walk/extend the trie with the continuation starting at `start`; return nodes added.

        Past the end of the history the continuation copies itself with period
        length - start (the text "abcab" continues "cabca..."), so a match near the end still
        yields a full-depth branch."""
        cfg = self.config
        drafted = tokens[start : min(start + depth, length)]  # one slice of the history (ints: the index's copy)
        period = length - start
        parent, added = -1, 0
        for k in range(depth):
            if k >= len(drafted):
                drafted.append(drafted[k - period])
            tok = drafted[k]
            child = children[parent + 1].get(tok)
            if child is None:
                if len(node_tokens) >= cfg.max_nodes:
                    break
                child = len(node_tokens)
                node_tokens.append(tok)
                node_parents.append(parent)
                children.append({})
                children[parent + 1][tok] = child
                added += 1
            parent = child
        return added
