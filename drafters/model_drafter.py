"""Drafting with a model: the tree-growing loop shared by "draft-model" and "self-draft".

A :class:`ModelDrafter` owns a LlamaRunner (a small model, or the target's first layers) and a paged KV cache
of the sequence's *committed* tokens:

1. catch up: one batched forward over the tokens committed since the last step; they are committed (copies of a
   prompt run it once: drafters/prompt_copies.py);
2. grow: one batched forward per depth over the new frontier nodes of every sequence, their K/V at scratch
   slots past the root (each node sees the committed prefix, the root and its ancestors); a static tree keeps its
   children, chosen or sampled, on the device and is read once (``_grow_static``), others once per depth; a static
   tree may stay pending (``propose_pending``, specdec/pending_trees.py), read after the verify's launch;
3. release the scratch slots: rejected drafts cost nothing to roll back; accepted ones are recomputed in the
   next catch-up.

A drafter whose layers ARE the target's first layers (self-draft, ``shares_target_cache``) keeps no cache of
its own: the target's cache already holds those layers' K/V, so step 1 shrinks to the root, written to scratch
slots that the target's verify overwrites; the drafter never changes the target's lengths or block tables.

Children (``DraftConfig.mode``): ``deterministic``: the top-``w`` tokens per node (``widths``), or with
``tree="dynamic"`` an EAGLE-2 style tree (per depth the ``beam`` best paths, until ``max_nodes``), no
draft_probs; ``independent`` / ``without_replacement``: ``w`` children *sampled* from the draft distribution
after the target's sampling transform, sent along as draft_probs (static trees only: keeping the most probable
of sampled nodes would change their law); ``auto`` (default): deterministic when greedy or dynamic, else
independent. Under coupled sampling the children are always deterministic, ranked by the shared noise.

Sampled drafts draw from a generator of their own, seeded at each ``attach`` by ``TargetView.seed`` (or a draw of
torch's RNG; greedy: a fixed seed) salted by ``DraftConfig.seed``: a seed that fixed the drafts would bias the law.
With a reduced draft vocabulary (``self.draft_vocab``) children are chosen among those N tokens and sampled
draft_probs are zero elsewhere; output stays exact.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from specdec.drafters.base import Drafter, SequenceView, TargetView
from specdec.drafters.draft_vocab import DraftVocab
from specdec.drafters.level_clock import LevelClock
from specdec.drafters.prompt_copies import leaders, prompt_copies
from specdec.drafters.top_k import top_k

from specdec.attention import BatchBuilder
from specdec.call_claims import CLAIMS, held_for_call
from specdec.coupling import perturbed_logits
from specdec.cuda_graphs import GraphedForward, auto_uses_graphs, current_model_graphs, model_graphs
from specdec.errors import InputError, InputTypeError
from specdec.generate_inputs import check_int, describe
from specdec.host_copy import to_device, to_host_later
from specdec.kv_cache import CacheFullError, PagedKVCache
from specdec.models.llama import LlamaRunner
from specdec.pending_trees import PendingTrees
from specdec.sampling import logits_to_probs, sample_each
from specdec.tree import MAX_TREE_NODES, DraftMode, DraftTree

logger = logging.getLogger(__name__)

MODES = ("auto", "deterministic", "independent", "without_replacement")


@dataclass(frozen=True)
class DraftConfig:
    num_draft_tokens: int = 4  # tree depth
    tree: str = "static"  # "static": widths per depth | "dynamic": EAGLE-2 style (deterministic candidates)
    widths: tuple[int, ...] = ()  # children per node at depth 1, 2, ...; () = a chain
    max_nodes: int | None = None  # node budget of a dynamic tree (16 by default); refused with a static one
    beam: int | None = None  # dynamic tree: nodes kept per depth and children per node (4 by default); likewise
    mode: str = "auto"
    seed: int | None = None  # for sampled drafts (refused where none are drawn); None: generate()'s seed (module doc)
    # draft-model forwards through CUDA-graph buckets (specdec.cuda_graphs) over a cache kept with the draft model:
    # "auto" where the target's verify would use them (CUDA, Triton); True also elsewhere (uncaptured, Triton
    # backend: the interpreter tests); False never. Self-draft drafts in the target's cache, always eagerly.
    cuda_graphs: bool | str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.widths, (str, bytes)) or not isinstance(self.widths, (list, tuple)):
            raise InputTypeError(f"widths must be a list of ints (children per node at each depth), got "
                                 f"{describe(self.widths)}")
        widths = tuple(check_int(f"widths[{i}]", w, minimum=1) for i, w in enumerate(self.widths))
        object.__setattr__(self, "widths", widths)
        check_int("num_draft_tokens", self.num_draft_tokens, minimum=1)
        if self.max_nodes is not None:  # None: the dynamic tree's default
            check_int("max_nodes", self.max_nodes, minimum=1, maximum=MAX_TREE_NODES)
        if self.beam is not None:
            check_int("beam", self.beam, minimum=1)
        check_int("seed", self.seed, optional=True)
        if self.tree not in ("static", "dynamic"):
            raise InputError(f"tree must be 'static' or 'dynamic', got {self.tree!r}")
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto"):
            raise InputError(f"cuda_graphs must be True, False or 'auto', got {self.cuda_graphs!r}")
        if len(self.widths) > self.num_draft_tokens:
            raise InputError(f"widths must be at most num_draft_tokens long, got {list(self.widths)} with "
                             f"num_draft_tokens={self.num_draft_tokens}")
        if self.tree == "dynamic" and self.widths:  # () is the default: these were given, and would do nothing
            raise InputError(f"widths {list(self.widths)} shape a static tree; a dynamic tree is shaped by max_nodes "
                             "and beam (drop widths, or use tree='static')")
        given = [f"{k}={getattr(self, k)}" for k in ("max_nodes", "beam") if getattr(self, k) is not None]
        if self.tree == "static" and given:  # they would do nothing
            raise InputError(f"{', '.join(given)} shape{'s' * (len(given) == 1)} a dynamic tree; a static tree is "
                             f"shaped by widths and num_draft_tokens (drop {'them' if len(given) > 1 else 'it'}, or "
                             "use tree='dynamic')")
        if self.tree == "dynamic":
            object.__setattr__(self, "max_nodes", 16 if self.max_nodes is None else self.max_nodes)
            if self.beam is not None and self.beam > self.max_nodes:  # a depth keeps at most max_nodes: as beam=max
                raise InputError(f"beam={self.beam} exceeds max_nodes={self.max_nodes}, and no depth of a dynamic "
                                 "tree keeps more than max_nodes nodes: lower beam, or raise max_nodes")
            object.__setattr__(self, "beam", 4 if self.beam is None else self.beam)
        if self.tree == "dynamic" and self.mode in ("independent", "without_replacement"):
            raise InputError("a dynamic tree picks candidates deterministically; use mode='deterministic' or 'auto'")
        if self.seed is not None and (self.mode == "deterministic" or self.tree == "dynamic"):  # it would do nothing
            drawn = "mode='deterministic'" if self.mode == "deterministic" else "a dynamic tree"
            raise InputError(f"seed={self.seed} seeds sampled drafts, but {drawn} draws none (its children are the "
                             "top-ranked tokens): drop seed, or use mode='independent' or 'without_replacement'")
        if self.tree == "static" and self.static_nodes() > MAX_TREE_NODES:
            chains = len(self.widths) < self.num_draft_tokens  # the deeper levels: one child per node
            raise InputError(f"widths {list(self.widths)} with num_draft_tokens={self.num_draft_tokens} give "
                             f"{self.static_nodes()} nodes{' (depths past the widths continue as chains)' * chains}; "
                             f"at most {MAX_TREE_NODES}: lower the widths or num_draft_tokens")

    def width(self, depth: int) -> int:  # depth is 1-based
        return self.widths[depth - 1] if depth <= len(self.widths) else 1

    def static_nodes(self) -> int:
        total, level = 0, 1
        for d in range(1, self.num_draft_tokens + 1):
            level *= self.width(d)
            total += level
        return total


@dataclass
class _Node:
    parent: int  # index in the sequence's node list, -1 = root
    token: int
    score: float  # path probability under the draft distribution (dynamic trees)
    draft_probs: torch.Tensor | None  # [vocab] distribution the token was drawn from (sampled modes)


class ModelDrafter(Drafter):
    """Base of the model-based drafters; subclasses build ``self.runner`` in ``make_runner``."""

    name = "model-drafter"
    shares_target_cache = False  # True: the runner's layers are the target's first layers (see module doc)

    def __init__(self, config: DraftConfig) -> None:
        if config.cuda_graphs is True and self.shares_target_cache:  # refused before any model loads
            raise InputError(f"cuda_graphs=True is for a draft model; {self.name} drafts in the target's cache, "
                             "eagerly")
        self.config = config
        self.runner: LlamaRunner | None = None
        self.cache: PagedKVCache | None = None
        self.generator: torch.Generator | None = None  # made by attach(), on the runner's device
        self.draft_forwards = 0  # draft-model forward passes (catch-up + one per depth)
        self.draft_vocab: DraftVocab | None = None  # set by make_runner when the runner's logits cover N tokens
        self.graphed: GraphedForward | None = None  # the draft model's graph buckets, with its cache (_own_cache)
        self.use_graphs = False  # decided at attach (DraftConfig.cuda_graphs)
        self._draft_ids: list[int] | None = None  # draft_vocab.ids as a list: logit column -> token id
        # (target, draft runner, its draft vocabulary) made by load_for_target(), until attach takes it
        self._loaded: tuple[LlamaRunner, LlamaRunner, DraftVocab | None] | None = None
        # pending static trees of a batch size: (depths, ancestor bits) of every node on the device, and the depth
        self._pending_fields: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._outgrown = False  # a sequence outgrew the draft model's context (_live): said once a call
        self._target_columns: int | None = None  # the target's vocabulary size, where a draft model's differs (attach)

    # ---- lifecycle --------------------------------------------------------------------
    def make_runner(self, runner: LlamaRunner, tokenizer: Any) -> LlamaRunner:
        """The drafter's runner for the target ``runner`` (whose tokenizer is ``tokenizer``, None if unknown);
        it may set ``self.draft_vocab``."""
        raise NotImplementedError

    def load_for_target(self, runner: LlamaRunner, tokenizer: Any = None, name: str | None = None) -> None:
        """The draft runner made (and checked: a draft model's vocabulary) for the target ``runner``, handed to the
        next ``attach`` with that target; once per target until then. Kept aside until attach takes it: the
        drafter's ``runner`` and ``draft_vocab`` are as they were until then (``unload_for_target`` drops it)."""
        if self._loaded is None or self._loaded[0] is not runner:
            self._loaded = None
            kept, self.draft_vocab = self.draft_vocab, None  # make_runner sets the new runner's, if any
            try:
                self._loaded = (runner, self.make_runner(runner, tokenizer), self.draft_vocab)
            finally:
                self.draft_vocab = kept

    def unload_for_target(self) -> None:
        self._loaded = None

    def attach(self, target: TargetView) -> None:
        self.target = target
        self.load_for_target(target.runner, target.tokenizer)  # after build_engine's: the runner it made
        _, self.runner, self.draft_vocab = self._loaded
        self._loaded = None  # the next call makes its own
        self._draft_ids = self.draft_vocab.ids.tolist() if self.draft_vocab is not None else None
        # a draft model of the target's tokenizer padded to another vocabulary size (draft_model.padded_alike): its
        # logits are cut to the target's ids or padded with -inf (drafts among the ids both have, draft_probs zero
        # past its own), and a committed id past its own is fed to it as its last id (_catch_up)
        mine, theirs = self.runner.shape.vocab_size, target.runner.shape.vocab_size
        self._target_columns = theirs if self.draft_vocab is None and mine != theirs else None
        # an own cache is made at the first propose (_own_cache): a drafter the engine never asks (its forward costs
        # a decode step: the break-even guard's never_pays) holds no second KV pool as large as the target's
        self.cache = target.cache if self.shares_target_cache else None
        self.graphed, self.use_graphs = None, self._uses_graphs()
        self._pending_fields = {}
        self._outgrown = False  # a sequence outgrew the draft model's context (_live): said once a call
        mode = self.config.mode
        if target.coupling is not None:  # candidates by the shared noise; the engine's coupled walk verifies
            mode = "deterministic"
        elif mode == "auto":
            mode = "deterministic" if target.sampling.greedy or self.config.tree == "dynamic" else "independent"
        self.mode = DraftMode(mode)
        # a static tree has its shape before its tokens: grown on the device and read once (_grow_static), unless
        # logits processors need each node's prefix on the host, or children drawn without replacement may be
        # fewer than the width (a distribution with fewer possible tokens)
        fixed_shape = self.mode is not DraftMode.WITHOUT_REPLACEMENT or all(w == 1 for w in self.config.widths)
        self.static_on_device = (self.config.tree == "static" and fixed_shape
                                 and (target.processing is None or self.draft_vocab is not None))
        own, seed = self.config.seed, target.seed
        if own is not None and seed is None and not target.sampling.greedy:
            # an unseeded call samples from torch's global RNG: its drafts must vary with it too, or every call
            # would judge the same drafts, and a draft fixed before the target's draws is not one drawn from
            # draft_probs (the output's law across calls would not be the target's)
            seed = int(torch.randint(2**62, ()))
        if seed is None and own is None and target.sampling.greedy and self.mode is not DraftMode.DETERMINISTIC:
            seed = 0  # a greedy call's sampled drafts: any stream of its own, never the caller's global one
        self.generator = None
        if seed is not None or own is not None:  # never generate()'s own stream: shared uniforms would couple
            key = seed if own is None else f"{own}:{seed}"  # drafts and acceptance; the own seed salts the call's
            digest = hashlib.blake2b(f"specdec.drafter:{key}".encode(), digest_size=8).digest()
            self.generator = torch.Generator(device=self.runner.device)
            self.generator.manual_seed(int.from_bytes(digest, "little") >> 1)

    def draw_source(self, seed: int | None) -> Hashable | None:  # what attach() seeds self.generator from
        if self.config.seed is None:
            return seed
        return None if seed is None else (self.config.seed, seed)  # None: a draw of torch's global RNG

    def _uses_graphs(self) -> bool:
        wanted = self.config.cuda_graphs
        if wanted == "auto":
            return not self.shares_target_cache and auto_uses_graphs(self.runner)
        if wanted and not self.runner.backend.triton:
            raise InputError(f"{self.name}: cuda_graphs=True needs the draft model on the Triton backend (a CUDA "
                             f"device), this one runs on {self.runner.backend.name}")
        return bool(wanted)

    def forward_seconds(self) -> float | None:
        """A decode step of the draft model, from its cost model (the target's own curve when it IS the target).
        None for self-draft (its layers are a part of the target's, so it costs less by construction) and for a
        draft model whose context is too short to time."""
        if self.runner is None or self.shares_target_cache:
            return None
        from specdec.cost_model import CalibrationConfig, load_cost_model

        graphs = self.use_graphs and self.runner.device.type == "cuda"  # priced as it runs: replayed graphs
        costs = load_cost_model(self.runner, CalibrationConfig(graphs=graphs), install_rows=False)
        return costs.decode_seconds() if costs.measured else None  # too short a context to time: the guard probes

    def release(self, seq_id: int) -> None:
        if self.cache is not None and not self.shares_target_cache and seq_id in self.cache.lengths:
            self.cache.free(seq_id)

    def detach(self) -> None:
        """The call's end: a KV cache of its own made for this call is freed (the draft model's graph cache is
        kept with that model for later calls) and the target's view dropped (with the policy's costs, whose sizer
        holds this drafter: a cycle that kept the target until Python's next full collection). A draft model's
        runner stays; one running the target's own layers (self-draft) is dropped with the target's cache, as the
        next call makes it anew from its target."""
        if self.cache is not None and not self.shares_target_cache and self.graphed is None:
            self.cache.discard()  # now, though the caller may hold it
        if self.shares_target_cache:
            self.runner = None
        if self.shares_target_cache or self.graphed is None:
            self.cache = None
        self.target = None
        self._pending_fields = {}

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        live = self._live(seqs)
        trees = {v.seq_id: DraftTree.empty() for v in seqs}
        if live:
            root_logits = self._root_logits(live)
            if self.static_on_device:
                tokens, parents, probs = self._grow_static(live, root_logits)
                grown = self._static_trees(tokens.tolist(), parents, probs)  # the one read of the device
            else:
                grown = self._grow(live, root_logits)
            for v, tree in zip(live, grown, strict=True):
                trees[v.seq_id] = tree
        return [trees[v.seq_id] for v in seqs]

    @property
    def pending_trees(self) -> bool:  # after attach: a static tree grown on the device has its shape on the host
        return getattr(self, "static_on_device", False)

    @torch.inference_mode()
    def propose_pending(self, seqs: Sequence[SequenceView]) -> PendingTrees:
        """The static trees left on the device (specdec/pending_trees.py): their shape is the config's, their tokens
        are copied to pinned memory after drafting and read once the engine has launched the verify."""
        if not self.static_on_device:
            raise NotImplementedError(f"{self.name}: only a static tree grown on the device can stay pending")
        live = self._live(seqs)
        clock = LevelClock(self.runner.device)
        dev = self.runner.device
        if not live:
            return PendingTrees.none(len(seqs), dev, lambda: [DraftTree.empty() for _ in seqs])
        tokens, parents, probs = self._grow_static(live, self._root_logits(live))  # [L, N] token ids on the device
        clock.mark()
        clock.stop()
        depths, bits, max_depth = self._static_fields(parents, len(live))
        host = to_host_later(tokens)  # waited for once the verify is launched: the device is verifying by then
        ids = {v.seq_id for v in live}

        def read() -> list[DraftTree]:
            grown = iter(self._static_trees(host().tolist(), parents, probs))
            return [next(grown) if v.seq_id in ids else DraftTree.empty() for v in seqs]

        sizes = tuple(len(parents) if v.seq_id in ids else 0 for v in seqs)
        return PendingTrees(sizes, tokens.flatten(), depths, bits, max_depth, read, lambda: sum(clock.split()),
                            clock.start)

    def _static_fields(self, parents: list[int], batch: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Depths and ancestor bits of ``batch`` static trees of this shape on the device, and their depth: the
        shape is the config's, so they are built once per batch size, not each step."""
        key = (tuple(parents), batch)
        if key not in self._pending_fields:
            tree = DraftTree(torch.zeros(len(parents), dtype=torch.long), parents)  # the shape alone
            dev = self.runner.device
            self._pending_fields[key] = (to_device(tree.depth_list * batch, torch.long, dev),
                                         to_device(tree.ancestor_bit_list * batch, torch.long, dev), tree.max_depth)
        return self._pending_fields[key]

    def _live(self, seqs: Sequence[SequenceView]) -> list[SequenceView]:
        """The sequences with a draft token to verify: the engine verifies a node (``max_depth``), and a depth-1
        node sits at position len(token_ids), below the draft model's limit (as ``_deepest`` counts it)."""
        if self.runner is None:
            raise RuntimeError(f"{self.name}: attach(target) must be called before propose()")
        max_pos = self.runner.shape.max_positions
        fits = [v for v in seqs if len(v.token_ids) < max_pos]
        if len(fits) < len(seqs) and not self._outgrown and max_pos < self.target.runner.shape.max_positions:
            self._outgrown = True  # once a call: the target goes on past the draft model's context, undrafted
            longest = max(len(v.token_ids) for v in seqs)
            logger.warning("%s: a sequence of %d tokens fills the draft model's %s: it is decoded without drafts "
                           "from here (a draft model with a longer context drafts on)",
                           self.name, longest, self.runner.shape.limit_words)
        return [v for v in fits if v.max_depth is None or v.max_depth > 0]

    def _deepest(self, live: list[SequenceView]) -> int:
        """The depth to draft to: num_draft_tokens, or less where no sequence has the positions or the tokens for
        it. A node at depth d sits at position len(token_ids) - 1 + d, which must stay below the draft model's limit
        (context, sliding window) and the target's, and no deeper than the engine verifies (``max_depth``: it cuts
        deeper nodes unverified, so drafting them is lost work)."""
        limit = min(self.runner.shape.max_positions, self.target.runner.shape.max_positions)
        room = max(min(limit - len(v.token_ids), self.config.num_draft_tokens if v.max_depth is None else v.max_depth)
                   for v in live)
        return max(1, min(self.config.num_draft_tokens, room))

    def _root_logits(self, live: list[SequenceView]) -> torch.Tensor:  # [B, vocab] logits at each root
        if self.cache is None:
            self.cache = self._own_cache()
        return self._root_forward(live) if self.shares_target_cache else self._catch_up(live)

    def _own_cache(self) -> PagedKVCache:
        """As many slots as the target's pool: committed tokens + scratch (at most MAX_TREE_NODES in the default pool;
        in a smaller explicit one a level without room ends the tree: ``_forward_nodes``); with graphs, the
        cache of the draft model's graph buckets (kept with the model and reused by later calls), held for this
        generate() call. Another drafter drafting in it meanwhile (another thread's call, a streamer's, another
        child of this call's combined drafter) would free or grow it under that one: this one then drafts eagerly."""
        tc, shape = self.target.cache, self.runner.shape
        if self.use_graphs:
            with CLAIMS:  # found and taken at once
                held = current_model_graphs(self.runner, "draft")
                if held is None or not held.serving:
                    self.graphed = model_graphs(self.runner, tc.block_size, tc.num_blocks, role="draft")
                    held_for_call(self.graphed)  # free: checked before model_graphs freed its sequences
                    return self.graphed.cache
            logger.info("%s: another drafter drafts through the draft model's CUDA graphs (in another generate() "
                        "call, or in this one); this one drafts eagerly in a cache of its own", self.name)
            self.use_graphs = False
        return PagedKVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, tc.num_blocks, tc.block_size,
                            self.runner.dtype, self.runner.device, self.runner.backend)

    def _forward(self, builder: BatchBuilder, token_ids: torch.Tensor | None = None,
                 rows: list[int] | None = None) -> torch.Tensor:
        """[rows, vocab] logits of every new token, or of the builder's rows ``rows`` only (the LM head runs on no
        other); ``token_ids`` [rows] on the device stand for the builder's (placeholder) tokens."""
        self.draft_forwards += 1
        batch = builder.build()
        if self.graphed is not None:
            out = self.graphed(batch, token_ids)
            if out is not None:  # else a prefill, or no bucket fits: eager
                return self._to_target_columns(
                    out.logits if rows is None else out.logits[to_device(rows, torch.long, out.logits.device)])
        tokens = batch.token_ids if token_ids is None else token_ids
        wanted = (torch.arange(tokens.numel(), device=tokens.device) if rows is None
                  else to_device(rows, torch.long, tokens.device))
        return self._to_target_columns(self.runner.forward(tokens, batch.positions, batch.plan, self.cache,
                                                           wanted).logits)

    def _to_target_columns(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, n] logits -> one column per target id where the draft model's vocabulary is padded to another size
        (attach): its ids past the target's cut, the target's past its own at -inf (never drafted)."""
        n = self._target_columns
        if n is None or logits.shape[-1] == n:
            return logits
        if logits.shape[-1] > n:
            return logits[:, :n]
        return torch.nn.functional.pad(logits, (0, n - logits.shape[-1]), value=float("-inf"))

    def _draft_inputs(self, token_ids: Sequence[int]) -> Sequence[int]:
        """Committed token ids as the draft model reads them: an id past a padded vocabulary of its own (one the
        target's tokenizer has no token for, so only its padding rows' logits drew it) as its last id; the drafts
        may then be rejected more, the output is the target's."""
        mine = self.runner.shape.vocab_size
        if self._target_columns is None or self._target_columns <= mine:
            return token_ids
        return [min(t, mine - 1) for t in token_ids]

    def _catch_up(self, live: list[SequenceView]) -> torch.Tensor:  # [B, vocab] logits at each root
        """A causal run over the tokens the draft model has not seen yet, committed. Copies of a prompt at their first
        catch-up (drafters/prompt_copies.py) run none of it: their first's K/V of the prompt are copied into their
        own blocks (PagedKVCache.copy_prefix) and its logits at the prompt's end are theirs; the tokens a copy has
        after its prompt (plain steps before its first draft) run in a second forward, over the copied keys."""
        cache = self.cache
        for v in live:
            if v.seq_id not in cache.lengths:
                cache.add(v.seq_id)
            if cache.lengths[v.seq_id] >= len(v.token_ids):  # history was rewritten: start over
                cache.free(v.seq_id)
                cache.add(v.seq_id)
        cache.reserve_many({v.seq_id: len(v.token_ids) - cache.lengths[v.seq_id] for v in live})
        copies = prompt_copies(live, lambda v: cache.lengths[v.seq_id] == 0)
        builder = BatchBuilder(cache, self.runner.device)
        runs: dict[int, range] = {}  # index in live -> its rows in the first forward
        for b, v in enumerate(live):
            if b not in copies:
                cached = cache.lengths[v.seq_id]
                runs[b] = builder.add(v.seq_id, self._draft_inputs(v.token_ids[cached:]),
                                      range(cached, len(v.token_ids)), num_keys=len(v.token_ids), num_visible=cached)
        # the LM head runs on each run's last row only: a root's logits are all that is read
        logits = self._forward(builder, rows=[r[-1] for r in runs.values()])
        last_rows = {b: j for j, b in enumerate(runs)}  # index in live -> its root's row of the logits
        tails = []  # copies with tokens after their prompt: (index in live, the prompt's length)
        for first, group in leaders(copies).items():
            prompt = live[first].num_prompt_tokens
            cache.copy_prefix(live[first].seq_id, [live[b].seq_id for b in group], prompt)
            for b in group:
                if len(live[b].token_ids) == prompt:  # the first's logits at the prompt's last token, its last row
                    last_rows[b] = last_rows[first]
                else:
                    tails.append((b, prompt))
        if tails:  # over the copied keys
            builder = BatchBuilder(cache, self.runner.device)
            ends = []
            for j, (b, prompt) in enumerate(tails):
                v = live[b]
                last_rows[b] = logits.shape[0] + j
                ends.append(builder.add(v.seq_id, self._draft_inputs(v.token_ids[prompt:]),
                                        range(prompt, len(v.token_ids)), num_keys=len(v.token_ids),
                                        num_visible=prompt)[-1])
            logits = torch.cat([logits, self._forward(builder, rows=ends)])
        last_rows = [last_rows[b] for b in range(len(live))]
        cache.commit({v.seq_id: range(len(v.token_ids) - cache.lengths[v.seq_id]) for v in live})
        return logits[to_device(last_rows, torch.long, logits.device)]

    def _root_forward(self, live: list[SequenceView]) -> torch.Tensor:  # [B, vocab] logits at each root
        """Shared cache: committed K/V are the target's (every token but the root, the engine's invariant); only
        the root runs, into the scratch region."""
        cache = self.cache
        cache.reserve_scratch({v.seq_id: 1 for v in live})
        builder = BatchBuilder(cache, self.runner.device)
        for v in live:
            root = cache.committed_length(v.seq_id)
            builder.add(v.seq_id, [v.token_ids[-1]], [root], num_keys=root + 1, num_visible=root)
        return self._forward(builder)

    def _grow(self, live: list[SequenceView], root_logits: torch.Tensor) -> list[DraftTree]:
        cfg, cache = self.config, self.cache
        nodes: list[list[_Node]] = [[] for _ in live]
        # frontier: per sequence, (node index or -1, logits row) of the nodes whose children come next
        frontier = [[(-1, root_logits[b], 1.0)] for b in range(len(live))]
        budget = cfg.max_nodes if cfg.tree == "dynamic" else MAX_TREE_NODES
        deepest = self._deepest(live)
        for depth in range(1, deepest + 1):
            self._process_frontier(live, nodes, frontier)
            new_per_seq = [self._children(nodes[b], frontier[b], depth, budget, self._noise(v, depth))
                           for b, v in enumerate(live)]
            if depth == deepest or not any(new_per_seq):
                break
            logits = self._forward_nodes(live, nodes, new_per_seq, depth)
            if logits is None:  # no room for this level's scratch: the tree grown so far
                break
            row = 0
            for b, new in enumerate(new_per_seq):
                frontier[b] = [(i, logits[row + j], nodes[b][i].score) for j, i in enumerate(new)]
                row += len(new)
        if not self.shares_target_cache:  # drop the scratch K/V of the draft nodes
            cache.commit({v.seq_id: [] for v in live})
        return [self._tree(ns) for ns in nodes]

    def _grow_static(self, live: list[SequenceView], root_logits: torch.Tensor
                     ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """A static tree (a chain by default) for every sequence: its shape is the config's, so each depth's
        children (chosen or drawn per frontier node, as ``_children`` does) stay on the device and run through the
        next forward as device token ids. Sampled children are drawn for every sequence at once, in ``_children``'s
        order (sequence by sequence), and keep their rows' draft_probs. Returns the [B, nodes] token ids on the
        device (not read), the shape's parents, and (sampled) the [B, nodes, vocab] draft_probs."""
        cfg, B, dev = self.config, len(live), root_logits.device
        ids = None if self.draft_vocab is None else to_device(self.draft_vocab.ids, torch.long, dev)
        parents: list[int] = []  # the tree's shape, the same for every sequence
        frontier = [-1]  # its newest nodes (-1: the root)
        logits = root_logits  # [B * len(frontier), n], sequence-major
        chosen, drawn_from = [], []  # per depth [B, new nodes] token ids, and (sampled) [B, new nodes, vocab]
        deepest = self._deepest(live)
        for depth in range(1, deepest + 1):
            width = cfg.width(depth)
            noise = None
            if self.target.coupling is not None:  # [B * frontier, n]: a sequence's noise for all its frontier
                noise = torch.stack([self._noise(v, depth) for v in live]).repeat_interleave(len(frontier), 0)
            if self.mode is DraftMode.DETERMINISTIC:
                top = top_k(self._ranking(logits, noise), min(width, logits.shape[-1]))[1]  # [B * F, w]
                tokens = (top if ids is None else ids[top]).reshape(B, -1)  # [B, frontier * w]
            else:
                draft_probs = self._draft_probs(logits)  # [B * frontier, vocab]
                # a row with no law (NaN / zero draft_probs) draws no child without replacement (-1): kept in range
                # for the verify's inputs, the read's draft_probs checks then refuse the tree
                tokens = self._draw(draft_probs, width).clamp_(min=0).reshape(B, -1)
                drawn_from.append(draft_probs.repeat_interleave(width, 0).reshape(B, tokens.shape[1], -1))
            new = list(range(len(parents), len(parents) + tokens.shape[1]))
            parents += [p for p in frontier for _ in range(tokens.shape[1] // len(frontier))]
            chosen.append(tokens)
            frontier = new
            if depth == deepest:
                break
            nodes = [[_Node(p, 0, 1.0, None) for p in parents] for _ in live]  # tokens: the device's
            logits = self._forward_nodes(live, nodes, [new] * B, depth, tokens.reshape(-1))
            if logits is None:  # no room for this level's scratch: the levels chosen so far
                break
        if not self.shares_target_cache:  # drop the scratch K/V of the draft nodes
            self.cache.commit({v.seq_id: [] for v in live})
        return torch.cat(chosen, dim=1), parents, torch.cat(drawn_from, dim=1) if drawn_from else None

    def _static_trees(self, rows: list[list[int]], parents: list[int], probs: torch.Tensor | None
                      ) -> list[DraftTree]:
        """The static trees from their token ids read by the host ([B][nodes]), with their draft_probs if sampled."""
        if probs is None:
            return [DraftTree(row, parents) for row in rows]
        return [DraftTree(row, parents, probs[b], self.mode) for b, row in enumerate(rows)]

    def _process_frontier(self, live: list[SequenceView], nodes: list[list[_Node]], frontier) -> None:
        """The target's logits processors (TargetView.processing) on each frontier node's logits, with that node's
        prefix, so drafts follow the processed target (acceptance only: the engine processes the target's logits
        itself). Full vocabulary only: processors index logits by token id."""
        processing = self.target.processing
        if processing is None or self.draft_vocab is not None:
            return
        prefixes = []
        for b, v in enumerate(live):
            base = torch.tensor(list(v.token_ids), dtype=torch.long)
            for parent, _, _ in frontier[b]:
                path = []
                while parent != -1:
                    path.append(nodes[b][parent].token)
                    parent = nodes[b][parent].parent
                prefixes.append((base, path[::-1], v.num_prompt_tokens))
        if not prefixes:
            return
        raw = torch.stack([f[1] for fr in frontier for f in fr])
        processed = processing.process_prefixes(prefixes, raw)
        # a row the processors made NaN or +inf (an overflowing decay penalty, a caller's processor) is a prefix
        # they leave no law to draw from: no token, so no children (as for a row they masked whole). A row NaN
        # before them stays: the draft model's own fault, which the draft_probs checks report
        def lawless(rows: torch.Tensor) -> torch.Tensor:  # [R] bool
            return (rows.isnan() | (rows == float("inf"))).any(-1)

        processed = processed.masked_fill((lawless(processed) & ~lawless(raw))[:, None], float("-inf"))
        row = 0
        for b, fr in enumerate(frontier):
            frontier[b] = [(i, processed[row + j], score) for j, (i, _, score) in enumerate(fr)]
            row += len(fr)

    def _noise(self, v: SequenceView, depth: int) -> torch.Tensor | None:
        """Coupled sampling: the Gumbel noise [n] of the position of this depth's children, over the runner's
        logit columns (the draft vocabulary's token ids when reduced); None otherwise."""
        coupling = self.target.coupling
        if coupling is None:
            return None
        columns = None if self.draft_vocab is None else self.draft_vocab.ids
        return coupling.draft_noise(v.noise_key, [len(v.token_ids) - 1 + depth], self.target.runner.shape.vocab_size,
                                    self.runner.device, columns)[0]

    def _children(self, nodes: list[_Node], frontier, depth: int, budget: int,
                  noise: torch.Tensor | None = None) -> list[int]:
        """Choose the children of this depth; append them to ``nodes``; return their indices. ``noise`` [n]:
        coupled sampling ranks each node's candidates by its perturbed logits (a Gumbel-top-k sample)."""
        cfg = self.config
        start = len(nodes)
        if not frontier:  # this sequence's tree ended at the last depth while another's grows on
            return []
        if noise is not None or self.mode is DraftMode.DETERMINISTIC:
            k = cfg.beam if cfg.tree == "dynamic" else cfg.width(depth)
            ids = self._draft_ids  # None: logit column == token id
            probs = self._ranking(torch.stack([logits for _, logits, _ in frontier]), noise)  # [frontier, n]
            values, columns = (t.tolist() for t in top_k(probs, min(k, probs.shape[-1])))  # one read per depth
            cands = [(score * p, parent, t if ids is None else ids[t])
                     for (parent, _, score), row_p, row_t in zip(frontier, values, columns, strict=True)
                     for p, t in zip(row_p, row_t, strict=True)]
            if cfg.tree == "dynamic":
                cands = sorted(cands, key=lambda c: -c[0])[: min(cfg.beam, budget - len(nodes))]
            for score, parent, token in cands:
                nodes.append(_Node(parent, token, score, None))
        else:  # every frontier node's children drawn at once: one read of the device per depth
            rows = torch.stack([logits for _, logits, _ in frontier])  # [frontier, n], processed
            draft_probs = self._draft_probs(rows)  # [frontier, vocab]
            picks = self._draw(draft_probs, cfg.width(depth))
            # the logits processors left a node's prefix no token (a draft path plain decoding may never take): no
            # child. A NaN row is no such node: its draws stay, and the draft_probs checks refuse the tree
            picks = picks.masked_fill_((rows == float("-inf")).all(-1, keepdim=True), -1).tolist()
            for (parent, _, score), probs, row in zip(frontier, draft_probs, picks, strict=True):
                nodes.extend(_Node(parent, t, score, probs) for t in row if t >= 0)
        return list(range(start, len(nodes)))

    def _draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Frontier nodes' [F, n] logits -> [F, vocab] the distributions their sampled children are drawn from (and
        sent as draft_probs): the target's sampling transform, zero outside a reduced draft vocabulary."""
        probs = logits_to_probs(logits.float(), self.target.sampling)
        return probs if self.draft_vocab is None else self.draft_vocab.expand(probs)

    def _draw(self, draft_probs: torch.Tensor, width: int) -> torch.Tensor:
        """[F, vocab] -> [F, width] sampled children per row in draw order, -1 = none: independent draws, or draws
        without replacement as the ``width`` largest of log-probability + Gumbel noise (Gumbel-top-k: the same law
        as drawing one at a time and renormalising). A token of probability 0 is never drawn, so a row with fewer
        tokens than ``width`` gets fewer children."""
        if self.mode is DraftMode.INDEPENDENT:  # a row with no law (NaN): a token the draft_probs checks refuse
            F, n = draft_probs.shape
            u = torch.rand(F, width, generator=self.generator, dtype=torch.float64, device=draft_probs.device)
            return sample_each(draft_probs, u).clamp_(max=n - 1)
        u = torch.rand(draft_probs.shape, generator=self.generator, dtype=torch.float64, device=draft_probs.device)
        gumbel = -(-u.clamp_(2.0**-60, 1.0 - 2.0**-53).log()).log()  # finite: u kept inside (0, 1)
        values, indices = top_k(draft_probs.double().log() + gumbel, min(width, draft_probs.shape[-1]))
        return torch.where(values > float("-inf"), indices, -1)

    def _ranking(self, logits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Frontier nodes' [.., n] logits -> [.., n] probabilities that rank their candidate children: the draft
        distribution, or under coupled sampling the softmax of the logits perturbed by the position's noise (the
        chance each is the coupled choice given that noise: its top-k is a Gumbel-top-k sample)."""
        sampling = self.target.sampling
        if noise is not None:
            return perturbed_logits(logits, sampling, noise).softmax(-1)
        return logits.float().softmax(-1) if sampling.greedy else logits_to_probs(logits.float(), sampling)

    def _forward_nodes(self, live, nodes, new_per_seq, depth, token_ids: torch.Tensor | None = None
                       ) -> torch.Tensor | None:  # [sum(new), vocab]; token_ids [sum(new)] stand for the nodes'
        """The logits of a level's new nodes; None where the cache (an explicit num_blocks) has no room for their
        scratch K/V: the drafter then proposes the levels chosen so far (their children need no forward), where the
        CacheFullError made the engine's step plain for every sequence. A decision from block counts, never from a
        token drawn."""
        cache = self.cache
        # node i lives at position len(tokens) + i: right after the root (committed, or scratch when shared)
        try:
            cache.reserve_scratch({v.seq_id: len(v.token_ids) + len(nodes[b]) - cache.committed_length(v.seq_id)
                                   for b, v in enumerate(live) if new_per_seq[b]})
        except CacheFullError:  # all-or-nothing: nothing of this level was reserved
            logger.debug("%s: no KV blocks free for draft level %d: the tree ends at depth %d", self.name, depth + 1,
                         depth)
            return None
        builder = BatchBuilder(cache, self.runner.device)
        for b, v in enumerate(live):
            new = new_per_seq[b]
            if not new:
                continue
            committed = len(v.token_ids)  # keys every node sees: the committed prefix and the root
            bits = []  # over the scratch nodes 0 .. new[-1]: a node sees itself and its ancestors among them
            for i in new:
                word = 0
                while i != -1:
                    word |= 1 << i
                    i = nodes[b][i].parent
                bits.append(word - (1 << 64) if word >= 1 << 63 else word)  # as int64 (bit 63 is the sign)
            builder.add(v.seq_id, [nodes[b][i].token for i in new], [committed - 1 + depth] * len(new),
                        num_keys=committed + new[-1] + 1, num_visible=committed,
                        ancestor_bits=torch.tensor(bits, dtype=torch.long))
        return self._forward(builder, token_ids)

    def _tree(self, nodes: list[_Node]) -> DraftTree:
        if not nodes:
            return DraftTree.empty()
        tokens = [n.token for n in nodes]
        parents = [n.parent for n in nodes]
        if self.mode is DraftMode.DETERMINISTIC:
            return DraftTree(tokens, parents)
        return DraftTree(tokens, parents, torch.stack([n.draft_probs for n in nodes]), self.mode)
