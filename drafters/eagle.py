"""The "eagle" drafter: one small decoder layer over the target's features grows a dynamic draft tree.

    generate(model, ids, drafter="eagle", drafter_options={"path": "eagle-smollm2/"})
    specdec generate --drafter eagle --drafter-option path=\"eagle-smollm2/\"

Each step, for all sequences together (drafters/eagle_model.py has the layer):

1. **catch up** (drafters/eagle_catch_up.py): the target's hidden states of the positions committed since the
   last step (``SequenceView.new_hidden``) paired with the tokens that follow them run through the draft layer as
   one causal block, right-padded and masked; their keys / values join the drafter's (drafters/eagle_kv.py).
   An EAGLE-3 head names its ``feature_layers``: the engine then passes the residual streams
   entering those target layers instead of the final-norm states, and the head fuses them (fc).
   The last row predicts the root's feature; its logits score depth 1.
2. **grow** (EAGLE-2, drafters/eagle_grow.py): ``depth - 1`` times, the ``top_k`` candidates of the
   newest depth with the highest cumulative draft log-probability run as queries and each adds its
   ``top_k`` best children to the candidate pool, one forward of [sequences, top_k] queries per depth.
3. **rerank** (on the device, drafters/eagle_rerank.py): the ``max_nodes`` candidates with the highest cumulative
   log-probability form the tree (ancestor-closed: a child never scores above its parent); the host reads them.
On CUDA (``cuda_graphs="auto"``) steps 1-3 are replayed as one CUDA graph of fixed shapes (drafters/eagle_graphs.py;
a prompt's catch-up, or one of more rows than every bucket's, runs eagerly, and the rest is replayed).

``depth`` is an upper bound: with ``adapt_depth`` (the default) each call drafts the depth whose expected
committed tokens best cover its draft time and verify cost on the machine at hand, learned from the run
(drafters/eagle_depth.py); the checkpoint's tree was chosen on the machine that trained it.

Candidates are chosen deterministically (``DraftMode.DETERMINISTIC``), so the exact rejection
sampler keeps greedy and every sampling mode exactly the target's. ``scores`` carry each
node's draft probability under its parent (at the target's temperature) for tree sizing.
With a reduced draft vocabulary only those tokens are ever proposed.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from specdec.drafters.base import (
    Drafter,
    SequenceView,
    TargetView,
    check_given_dtype,
    check_path_option,
    refusals_named,
    refuse_top_k_past,
)
from specdec.drafters.call_memory import memory_key
from specdec.drafters.eagle_catch_up import CatchUpInputs, CatchUpRows, catch_up
from specdec.drafters.eagle_checkpoint import EagleCheckpointError, check_fits_target, load_eagle
from specdec.drafters.eagle_depth import DepthChooser
from specdec.drafters.eagle_graphs import CachedKeys, EagleGraphs, eagle_graphs, release
from specdec.drafters.eagle_grow import GrowInputs, TreeGrower
from specdec.drafters.eagle_kv import EagleKV
from specdec.drafters.eagle_model import EagleModel
from specdec.drafters.eagle_rerank import DeviceFields, chain_kept_whole, device_fields, parents
from specdec.drafters.level_clock import LevelClock
from specdec.drafters.loaded_once import load_once
from specdec.drafters.prompt_copies import leaders, prompt_copies

from specdec.cuda_graphs import captures
from specdec.errors import InputError
from specdec.host_copy import to_device, to_host_later
from specdec.pending_trees import PendingTrees, chain_fields
from specdec.tree import MAX_TREE_NODES, DraftTree, matched_levels

if TYPE_CHECKING:
    from specdec.models.llama import LlamaRunner

logger = logging.getLogger(__name__)
# the most rows of a sequence one catch-up forward runs (EagleDrafter._run_catch_up): its attention bias holds
# rows x (cached keys + rows) entries, linear in the context
CATCH_UP_ROWS = 512


@dataclass(frozen=True)
class EagleDraftConfig:
    """Tree shape; None = the value the checkpoint was trained and measured with."""

    depth: int | None = None  # draft steps (tree depth); at most max_nodes are grown (no tree is deeper)
    top_k: int | None = None  # children per expanded node, and nodes expanded per depth
    max_nodes: int | None = None  # nodes kept after reranking
    # draft, per call, the depth (<= depth) that pays best on this machine (drafters/eagle_depth.py); False: always
    # the full depth
    adapt_depth: bool = True
    # grow the tree through CUDA graphs (drafters/eagle_graphs.py): "auto" on a CUDA device; True also elsewhere
    # (uncaptured: the padded static growth, for tests); False never
    cuda_graphs: bool | str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.adapt_depth, bool):
            raise InputError(f"adapt_depth must be True or False, got {self.adapt_depth!r}")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto"):
            raise InputError(f"cuda_graphs must be True, False or 'auto', got {self.cuda_graphs!r}")
        for name in ("depth", "top_k", "max_nodes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if self.max_nodes is not None and self.max_nodes > MAX_TREE_NODES:
            raise InputError(f"max_nodes must be <= {MAX_TREE_NODES}, got {self.max_nodes}")
        if self.top_k is not None and self.max_nodes is not None:
            refuse_top_k_past(self.top_k, self.max_nodes, "max_nodes")


class EagleDrafter(Drafter):
    options_config = EagleDraftConfig  # what **options configure (drafters.registry.option_names)
    name = "eagle"
    python_only_options = frozenset({"model"})  # not --drafter-option keys (drafters.registry)
    needs_hidden_states = True
    pending_trees = True  # propose_pending: the engine may verify the trees before the host reads them
    layer_from_target = False  # True (mtp): neither path= nor model= is needed, the layer is read from the target's

    def __init__(self, path: str | None = None, model: EagleModel | None = None, **options) -> None:
        """``path`` (a checkpoint directory) or ``model`` (an EagleModel); ``options``: EagleDraftConfig."""
        path = check_path_option(self.name, path)
        if (path is None) == (model is None) and not (self.layer_from_target and model is None):
            raise InputError(f"{self.name}: give exactly one of path= (a checkpoint directory; on the command line "
                             "--drafter-option path=DIR) or model= (an EagleModel)")
        if model is not None and not isinstance(model, EagleModel):
            raise InputError(f"{self.name}: model= must be an EagleModel, got {type(model).__name__}")
        with refusals_named(self.name):  # the config's refusals name eagle or mtp
            self.options = EagleDraftConfig(**options)
        self.path, self.model = path, model
        self.packs = model is None  # specdec's own layer gets the CUDA layout (EagleModel.pack_on_cuda)
        self.kv: EagleKV | None = None  # the layer's keys / values of every sequence's committed positions
        # seq_id -> the most probable chain of its last proposal (tokens, parents), for the depth chooser
        self._last: dict[int, tuple[list[int], list[int]]] = {}

    def load_for_target(self, runner: "LlamaRunner", tokenizer: Any = None, name: str | None = None) -> None:
        """The layer of ``path=`` read for this target (once per process: drafters/loaded_once.py), or the given
        one checked against the target's config."""
        if self.path is not None:  # the layer loaded for this target and dtype,
            # shared by the drafters of its checkpoint (drafters/loaded_once.py): taken anew per call, never moved
            target_config = runner.hf_model.config
            self.model = load_once("eagle", self.path, (target_config.to_json_string(), str(runner.dtype),
                                                        str(runner.device)),
                                   lambda: load_eagle(self.path, target_config, runner.dtype, runner.device))
        else:
            check_fits_target(self.model.config, runner.hf_model.config, "the given EagleModel")
            check_given_dtype(self.name, "model=", self.model, runner.dtype)
        self.check_top_k()

    def check_top_k(self) -> None:
        """A given ``top_k`` beyond the layer's (draft) vocabulary or its default ``max_nodes`` refused, once the
        layer is known for the target: before any cost measurement."""
        c, o = self.model.config, self.options
        vocab = len(c.draft_vocab) or c.vocab_size
        if o.top_k is not None and o.top_k > vocab:
            raise InputError(f"{self.name}: top_k={o.top_k} exceeds the draft vocabulary of {vocab} tokens")
        if o.top_k is not None and o.max_nodes is None:  # beside a given max_nodes: refused when the options were
            with refusals_named(self.name):
                refuse_top_k_past(o.top_k, min(c.max_nodes, MAX_TREE_NODES), "the layer's max_nodes")

    def attach(self, target: TargetView) -> None:
        self.target = target
        runner = target.runner
        self.load_for_target(runner, target.tokenizer)  # after build_engine's: the layer it loaded (a cache hit)
        self.model.to(device=runner.device, dtype=runner.dtype)  # its mode as given: the layer has no dropout
        if self.packs:
            self.model.pack_on_cuda()
        c, o = self.model.config, self.options
        self.kv = EagleKV(c.num_kv_heads, c.head_dim, runner.dtype, runner.device)
        vocab = len(c.draft_vocab) or c.vocab_size
        self.top_k = o.top_k or min(c.top_k, vocab)  # a given top_k fits the draft vocabulary (load_for_target)
        self.max_nodes = min(o.max_nodes or c.max_nodes, MAX_TREE_NODES)
        # levels grown: a tree of max_nodes nodes is never deeper, so levels past it would be grown and dropped
        self.depth = min(o.depth or c.depth, self.max_nodes)
        # [N] token id of each reduced logit, or None: on the device for pending trees, and on the host (read per
        # tree: no copy from the device)
        self.device_draft_ids = self.model.draft_ids
        self.draft_ids = None if self.device_draft_ids is None else self.device_draft_ids.cpu()
        self.grower = TreeGrower(self.model, runner.embed, runner.lm_head, target.sampling, target.coupling,
                                 self.top_k, runner.shape.vocab_size, self.max_nodes,
                                 runner.backend.fused if runner.backend.triton else None)
        graphs = o.cuda_graphs if o.cuda_graphs != "auto" else runner.device.type == "cuda"
        capture = runner.device.type == "cuda"
        self.graphs: EagleGraphs | None = (eagle_graphs(self.grower, runner.hf_model, capture, self.name) if graphs
                                           else None)
        if graphs and self.graphs is None:  # held by another call: its static buffers are that call's
            logger.info("%s: the EAGLE model's CUDA graphs for these settings serve another generate() call; this "
                        "one drafts eagerly", self.name)
        self.chooser = DepthChooser(self.depth)
        adapt = self.options.adapt_depth
        self.chooser.start(target.costs if adapt else None, memory_key(self, runner))
        self._last.clear()
        logger.info("%s: depth %d%s, top-k %d, %d nodes, draft vocabulary %d%s", self.name, self.depth,
                    " at most (chosen per call)" if self.chooser.active else "", self.top_k, self.max_nodes, vocab,
                    ", CUDA graphs" if self.graphs is not None and self.graphs.config.capture else "")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """EAGLE-3: the target layers whose input residual streams the engine passes as ``new_hidden``."""
        model = self.model
        return model.config.feature_layers if isinstance(model, EagleModel) and model.eagle3 else ()

    def on_accept(self, seq_id: int, committed: Sequence[int]) -> None:
        last = self._last.pop(seq_id, None)
        if last is not None:
            self.chooser.observe(*matched_levels(*last, committed))

    def release(self, seq_id: int) -> None:
        self.kv.release(seq_id)
        self._last.pop(seq_id, None)
        self.chooser.finish()

    def detach(self) -> None:
        """The call's end: its target view, the grower's hold on the target's embeddings and LM head, the layer's
        keys / values and the depth chooser's costs are dropped (the kept graphs let go of the grower too), so an
        object reused across calls keeps no dropped target alive. The layer, the chooser's records, the grower's
        settings and ``graphs`` (its buffers, kept with the EAGLE model for later calls over this target) stay."""
        grower = getattr(self, "grower", None)
        if grower is not None:
            if self.graphs is not None:
                release(self.graphs, grower)
            grower.embed = grower.lm_head = None  # the target's; the next attach makes a grower of its own
        self.target = self.kv = None
        self.chooser.end_call()  # its costs hold the target's runner
        self._last.clear()

    def cost_key(self) -> str:  # the checkpoint's path, else the given model's shape and tree settings
        return super().cost_key() + ("" if self.path is not None else "|" + repr(self.model.config))

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        call = self._draft(seqs, pending=False)
        return self._finish(call, None if call.pool is None else call.pool.cpu())  # the one read of the device

    @torch.inference_mode()
    def propose_pending(self, seqs: Sequence[SequenceView]) -> PendingTrees:
        """The call's trees left on the device (specdec/pending_trees.py): the host copy of the candidates starts
        now and is read when the engine has launched the verify."""
        call = self._draft(seqs, pending=True)
        call.clock.stop()  # the drafting's own seconds, not the host's work until the read
        if call.pool is None:
            return PendingTrees.none(len(seqs), self.target.runner.device, lambda: self._finish(call, None))
        sizes = [0] * len(seqs)
        pool = call.pool  # [L, 4, M] on the device
        # the trees' fields: a replay computed them in its graph; an eager call computes them now (a chain's depths
        # and ancestor bits in one upload)
        fields = call.fields
        if fields is None:
            chain = chain_kept_whole(self.grower.chain, call.depth, self.grower.max_nodes)
            fields = device_fields(pool, call.depth, self.device_draft_ids,
                                   chain_fields(pool.shape[0], pool.shape[2], pool.device) if chain else None)
        for i in call.live:
            sizes[i] = pool.shape[2]
        host = to_host_later(pool)  # waited for once the verify is launched: the device is verifying by then
        return PendingTrees(tuple(sizes), fields.tokens.flatten(), fields.depths.flatten(),
                            fields.ancestor_bits.flatten(), call.depth, lambda: self._finish(call, host()),
                            lambda: call.seconds, call.clock.start)

    def _finish(self, call: "_Call", pools: torch.Tensor | None) -> list[DraftTree]:
        """The call's trees from its candidates read by the host ([L, 4, M]; None: no sequence drafted), and what
        the depth chooser learns from the call."""
        trees = [DraftTree.empty() for _ in call.seqs]
        level_seconds = [0.0] * call.depth  # level 1 includes the catch-up
        if pools is not None:
            for i, tree in zip(call.live, self._trees(pools), strict=True):
                trees[i] = tree
            level_seconds = call.levels(call.clock.split())
        call.seconds = sum(level_seconds)
        for view, tree in zip(call.seqs, trees, strict=True):
            self._last[view.seq_id] = _top_chain(tree)
        self.chooser.record_seconds(level_seconds, call.catch_up)
        return trees

    def _draft(self, seqs: Sequence[SequenceView], pending: bool) -> "_Call":
        """:meth:`_launch`; a call during which a CUDA graph was captured is a one-off, as a sequence's first is:
        its time is the capture's, and prices no level (the depth chooser's, the engine's draft time)."""
        before = captures()
        call = self._launch(seqs, pending)
        call.catch_up = call.catch_up or captures() > before
        return call

    def _launch(self, seqs: Sequence[SequenceView], pending: bool) -> "_Call":
        """Draft for the sequences with a feature (a one-token prompt's first step has none): their reranked
        candidate pools on the device ([L, 4, M], drafters/eagle_rerank.py), not read: the catch-up
        (drafters/eagle_catch_up.py), its keys / values joining each sequence's cache, the growth
        (drafters/eagle_grow.py) and the rerank. With ``self.graphs`` the whole call is one replay when a bucket
        holds it, else all but the catch-up is; for a ``pending`` proposal the replay also computes the trees' fields.
        The call's clock marks its parts (drafters/level_clock.py: no wait for the device between levels); the
        call's ``levels`` turns their seconds into each level's, level 1 with the catch-up (a replay's time is
        shared evenly among its levels, the catch-up counting as one)."""
        depth = self.chooser.choose(max(len(seqs), 1))
        clock = LevelClock(self.target.runner.device)
        live = [i for i, v in enumerate(seqs) if v.new_hidden is not None]
        call = _Call(seqs, live, depth, any(v.seq_id not in self.kv for v in seqs), clock)
        if not live:
            return call
        views = [seqs[i] for i in live]
        ids = [v.seq_id for v in views]
        if self.graphs is not None and all(i in self.kv for i in ids):
            rows = self._catch_up_rows(views)
            out = self.graphs.caught_up_pool(self._cached(views), rows, depth, fields=pending)
            if out is not None:
                call.pool, call.fields = out.rows, out.fields
                self.kv.append(ids, out.new_k, out.new_v, rows.counts)
                clock.mark()
                call.levels = lambda p: [2 * p[0] / (depth + 1)] + [p[0] / (depth + 1)] * (depth - 1)
                return call
        dev = self.target.runner.device
        h_root = self._catch_up(views)
        clock.mark()
        past = self._cached(views)  # the roots' catch-up: a key each at least
        out = None if self.graphs is None else self.graphs.pool(past, h_root, depth, fields=pending)
        if out is not None:
            call.pool, call.fields = out.rows, out.fields
            clock.mark()
            call.levels = lambda p: [p[0] + p[1] / depth] + [p[1] / depth] * (depth - 1)
        else:  # eager (no bucket fits, or a capture failed)
            inputs = GrowInputs(h_root, past.k, past.v, past.real,
                                to_device(past.root_positions, torch.long, dev),
                                to_device(past.noise_keys, torch.long, dev))
            call.pool = self.grower.tree_rows(inputs, depth, lambda d: clock.mark())
            call.levels = lambda p: [p[0] + p[1]] + p[2:]
        return call

    def _catch_up(self, views: Sequence[SequenceView]) -> torch.Tensor:
        """The roots' predicted features [B, H], every view's new rows caught up eagerly and their keys / values
        appended. Copies of a prompt at their first catch-up (drafters/prompt_copies.py) run none of the prompt's
        rows (a feature at j and the token at j + 1 < prompt: the same inputs as their first's, whose hidden rows the
        engine's prefill copied): their first's keys / values of those rows are copied into their own slab rows
        (EagleKV.copy_prefix) and its predicted feature is theirs; the rows a copy has after its prompt (plain steps
        before its first draft) are caught up after the copy, over the copied keys."""
        copies = prompt_copies(views, lambda v: v.seq_id not in self.kv and v.num_prompt_tokens > 1
                               and v.new_hidden.shape[0] == len(v.token_ids) - 1)  # rows from position 0
        run = [b for b in range(len(views)) if b not in copies]
        h_root = self._run_catch_up([views[b] for b in run])
        index = {b: j for j, b in enumerate(run)}  # view -> its row of h_root
        tails = []  # copies with rows after their prompt: (index in views, the shared rows)
        for first, group in leaders(copies).items():
            shared = views[first].num_prompt_tokens - 1
            self.kv.copy_prefix(views[first].seq_id, [views[b].seq_id for b in group], shared)
            for b in group:
                if views[b].new_hidden.shape[0] == shared:
                    index[b] = index[first]
                else:
                    tails.append((b, shared))
        if tails:
            tail = [replace(views[b], new_hidden=views[b].new_hidden[n:]) for b, n in tails]
            index.update({b: len(run) + j for j, (b, _) in enumerate(tails)})
            h_root = torch.cat([h_root, self._run_catch_up(tail)])
        if not copies:
            return h_root
        return h_root[to_device([index[b] for b in range(len(views))], torch.long, h_root.device)]

    def _run_catch_up(self, views: Sequence[SequenceView]) -> torch.Tensor:
        """The catch-up over every view's ``new_hidden`` rows, their keys / values appended: the roots' predicted
        features [B, H]. At most CATCH_UP_ROWS rows of each view per forward, each block over the keys of the ones
        before it: the attention bias is [B, rows, cached keys + rows], so a prompt's first catch-up in one forward
        would build one of prompt x prompt (1 GiB in fp32 at a 16k-token prompt)."""
        rows = self._catch_up_rows(views)
        width = rows.hidden.shape[1]
        if width <= CATCH_UP_ROWS:
            return self._catch_up_block(views, rows)
        roots: list[torch.Tensor | None] = [None] * len(views)
        for start in range(0, width, CATCH_UP_ROWS):
            run = [b for b, n in enumerate(rows.counts) if n > start]  # the views with rows in this block
            end = min(start + CATCH_UP_ROWS, max(rows.counts[b] for b in run))
            hidden = rows.hidden[:, start:end]
            block = CatchUpRows(hidden if len(run) == len(views) else hidden[run],
                                [rows.tokens[b][start:end] for b in run], [rows.positions[b][start:end] for b in run],
                                [min(rows.counts[b], end) - start for b in run])
            h_root = self._catch_up_block([views[b] for b in run], block)
            for j, b in enumerate(run):
                if rows.counts[b] <= end:  # its last row, the one predicting its root, is in this block
                    roots[b] = h_root[j]
        return torch.stack(roots)

    def _catch_up_block(self, views: Sequence[SequenceView], rows: CatchUpRows) -> torch.Tensor:
        """One catch-up forward over ``rows`` of ``views``, after their cached keys; the keys / values appended."""
        past = self._cached(views)
        h_root, new_k, new_v = catch_up(self.model, self.target.runner.embed, CatchUpInputs.upload(rows), past.k,
                                        past.v, past.real, self.grower.fused)
        self.kv.append([v.seq_id for v in views], new_k, new_v, rows.counts)
        return h_root

    def _cached(self, views: Sequence[SequenceView]) -> CachedKeys:
        """The sequences' cached keys / values in the slab, right-padded (None when none has a key yet)."""
        ids = [v.seq_id for v in views]
        keys, values = self.kv.gather(ids)
        return CachedKeys(keys, values, self.kv.lengths(ids), [len(v.token_ids) - 1 for v in views],
                          [v.noise_key for v in views], self.target.runner.device)

    def _catch_up_rows(self, views: Sequence[SequenceView]) -> CatchUpRows:
        """Every sequence's newly committed (feature, next token) pairs, right-padded to the longest: the features
        ``new_hidden`` at positions j < root and the tokens t_{j+1} at positions j + 1."""
        model = self.model
        if model.eagle3 and views[0].new_hidden.shape[-1] != model.fc.in_features:
            raise InputError(f"eagle: this EAGLE-3 head reads target layers {list(model.config.feature_layers)}, but "
                             f"the engine passed final hidden states (an EAGLE-3 head cannot run inside the "
                             f"combined drafter)")
        counts = [v.new_hidden.shape[0] for v in views]
        L = max(counts)
        tokens, positions = [], []  # [B][L] each: t_{j+1} and j + 1 for the positions j < root, right-padded with 0
        for v, k in zip(views, counts, strict=True):
            root = len(v.token_ids) - 1
            tokens.append(list(v.token_ids[root - k + 1 : root + 1]) + [0] * (L - k))
            positions.append(list(range(root - k + 1, root + 1)) + [0] * (L - k))
        hidden = self._padded_hidden(views, counts, L).to(self.target.runner.dtype)
        return CatchUpRows(hidden, tokens, positions, counts)

    @staticmethod
    def _padded_hidden(views: Sequence[SequenceView], lengths: list[int], L: int) -> torch.Tensor:
        """The views' ``new_hidden`` ([k_b, F] each) right-padded with zeros into [B, L, F]: one store for all."""
        first = views[0].new_hidden
        if len(views) == 1:
            return first[None]
        hidden = first.new_zeros(len(views), L, first.shape[-1])
        rows = [b * L + j for b, k in enumerate(lengths) for j in range(k)]
        hidden.view(-1, first.shape[-1])[to_device(rows, torch.long, first.device)] = torch.cat(
            [v.new_hidden for v in views])
        return hidden

    def _trees(self, pools: torch.Tensor) -> list[DraftTree]:
        """Trees from their reranked candidates, [B, 4, M] on the host (drafters/eagle_rerank.py): reduced token
        indices, parents among them, cumulative and conditional log-probabilities. Each field is converted once for
        the whole batch: this runs between the read and the verify launch (or while the device verifies)."""
        tokens = pools[:, 0].long()
        if self.draft_ids is not None:
            tokens = self.draft_ids[tokens]
        # the draft probability under the parent (0 where NaN): in [0, 1] by construction, int64 rows of one length,
        # so the trees skip the construction checks (the engine validates each proposal's structure all the same)
        scores = pools[:, 3].float().exp().nan_to_num(0.0).clamp(0.0, 1.0)
        return [DraftTree.unchecked(t, p, scores=s) for t, p, s in zip(tokens, parents(pools), scores, strict=True)]


def _top_chain(tree: DraftTree) -> tuple[list[int], list[int]]:
    """The tree's most probable chain (at each level the child with the highest score), as (tokens, parents) lists:
    the depth chooser prices a depth as a chain of that many nodes, so it measures a chain's acceptance (a match
    anywhere among eight candidates per level made deep levels look better than the engine's pruned trees were)."""
    if tree.num_nodes == 0:
        return [], []
    tokens, parents, scores = tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()
    best: dict[int, int] = {}  # node (-1: the root) -> its child of the highest score, the first on ties
    for i, p in enumerate(parents):
        if p not in best or scores[i] > scores[best[p]]:
            best[p] = i
    chain, node = [], -1
    while node in best:
        node = best[node]
        chain.append(tokens[node])
    return chain, list(range(-1, len(chain) - 1))


@dataclass
class _Call:
    """One propose call between its drafting and the host's read of its candidates."""

    seqs: Sequence[SequenceView]
    live: list[int]  # indices of the sequences that drafted (those with a feature)
    depth: int  # levels drafted, chosen for this call
    catch_up: bool  # a one-off: a sequence's first call (its prompt's catch-up), or one that captured a CUDA graph
    clock: LevelClock
    pool: torch.Tensor | None = None  # [len(live), 4, M] reranked candidates on the device
    fields: DeviceFields | None = None  # their trees' device fields, when a CUDA-graph replay computed them
    levels: Callable[[list[float]], list[float]] = list  # the clock's parts -> seconds per level
    seconds: float = 0.0  # the drafting's, once the pool is read


__all__ = ["EagleDrafter", "EagleDraftConfig", "EagleCheckpointError"]
