"""The "eagle" drafter: one small decoder layer over the target's features grows a dynamic draft tree.

    generate(model, ids, drafter="eagle", drafter_options={"path": "eagle-smollm2/"})
    specdec generate --drafter eagle --drafter-option path=\"eagle-smollm2/\"

Each step, per sequence (drafters/eagle_model.py has the layer):

1. **catch up**: the target's hidden states of the positions committed since the last step
   (``SequenceView.new_hidden``) paired with the tokens that follow them run through the draft
   layer as one causal block; their keys / values join the drafter's own per-sequence cache.
   An EAGLE-3 head names its ``feature_layers``: the engine then passes the residual streams
   entering those target layers instead of the final-norm states, and the head fuses them (fc).
   The last row predicts the root's feature; its logits score depth 1.
2. **grow** (EAGLE-2): ``depth - 1`` times, the ``top_k`` candidates of the newest depth with the
   highest cumulative draft log-probability run as queries (each sees the cache, its ancestors
   and itself) and each adds its ``top_k`` best children to the candidate pool.
3. **rerank**: the ``max_nodes`` candidates with the highest cumulative log-probability form the
   tree (ancestor-closed: a child never scores above its parent).

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
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from specdec.drafters.base import Drafter, SequenceView, TargetView, check_path_option
from specdec.drafters.call_memory import memory_key
from specdec.drafters.eagle_checkpoint import EagleCheckpointError, check_fits_target, load_eagle
from specdec.drafters.eagle_depth import DepthChooser
from specdec.drafters.eagle_model import EagleModel
from specdec.drafters.loaded_once import load_once
from torch.nn import functional as F

from specdec.coupling import perturbed_logits
from specdec.errors import InputError
from specdec.tree import MAX_TREE_NODES, DraftTree, matched_levels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EagleDraftConfig:
    """Tree shape; None = the value the checkpoint was trained and measured with."""

    depth: int | None = None  # draft steps (tree depth)
    top_k: int | None = None  # children per expanded node, and nodes expanded per depth
    max_nodes: int | None = None  # nodes kept after reranking
    # draft, per call, the depth (<= depth) that pays best on this machine (drafters/eagle_depth.py); False: always
    # the full depth
    adapt_depth: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.adapt_depth, bool):
            raise InputError(f"eagle: adapt_depth must be True or False, got {self.adapt_depth!r}")
        for name in ("depth", "top_k", "max_nodes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InputError(f"eagle: {name} must be a positive integer, got {value!r}")
        if self.max_nodes is not None and self.max_nodes > MAX_TREE_NODES:
            raise InputError(f"eagle: max_nodes must be <= {MAX_TREE_NODES}, got {self.max_nodes}")


@dataclass
class _SeqCache:
    k: torch.Tensor  # [1, kv_heads, P, head_dim] keys of the committed (feature, token) pairs
    v: torch.Tensor  # [1, kv_heads, P, head_dim]


class EagleDrafter(Drafter):
    name = "eagle"
    needs_hidden_states = True

    def __init__(self, path: str | None = None, model: EagleModel | None = None, **options) -> None:
        """``path`` (a checkpoint directory) or ``model`` (an EagleModel); ``options``: EagleDraftConfig."""
        check_path_option("eagle", path)
        if (path is None) == (model is None):
            raise InputError("eagle: give exactly one of path= (a checkpoint directory) or model= (EagleModel)")
        if model is not None and not isinstance(model, EagleModel):
            raise InputError(f"eagle: model= must be an EagleModel, got {type(model).__name__}")
        self.options = EagleDraftConfig(**options)
        self.path, self.model = path, model
        self.caches: dict[int, _SeqCache] = {}
        # seq_id -> the most probable chain of its last proposal (tokens, parents), for the depth chooser
        self._last: dict[int, tuple[list[int], list[int]]] = {}

    def attach(self, target: TargetView) -> None:
        self.target = target
        runner = target.runner
        if self.model is None:
            target_config = runner.hf_model.config
            self.model = load_once("eagle", self.path, (target_config.to_json_string(), str(runner.dtype),
                                                        str(runner.device)),
                                   lambda: load_eagle(self.path, target_config, runner.dtype, runner.device))
        else:
            check_fits_target(self.model.config, runner.hf_model.config, "the given EagleModel")
        self.model.to(device=runner.device, dtype=runner.dtype).eval()
        c, o = self.model.config, self.options
        self.depth, self.top_k = o.depth or c.depth, o.top_k or c.top_k
        self.max_nodes = min(o.max_nodes or c.max_nodes, MAX_TREE_NODES)
        self.draft_ids = self.model.draft_ids  # [N] or None
        vocab = len(c.draft_vocab) or c.vocab_size
        if self.top_k > vocab:
            raise InputError(f"eagle: top_k={self.top_k} exceeds the draft vocabulary of {vocab} tokens")
        self.chooser = DepthChooser(self.depth)
        adapt = self.options.adapt_depth
        self.chooser.start(target.costs if adapt else None, memory_key(self, runner))
        self._last.clear()
        logger.info("eagle: depth %d%s, top-k %d, %d nodes, draft vocabulary %d", self.depth,
                    " at most (chosen per call)" if self.chooser.active else "", self.top_k, self.max_nodes, vocab)

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
        self.caches.pop(seq_id, None)
        self._last.pop(seq_id, None)
        self.chooser.finish()


    def cost_key(self) -> str:  # the checkpoint's path, else the given model's shape and tree settings
        return super().cost_key() + ("" if self.path is not None else "|" + repr(self.model.config))

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        depth = self.chooser.choose(max(len(seqs), 1))
        catch_up = any(v.seq_id not in self.caches for v in seqs)
        level_seconds = [0.0] * depth  # summed over the sequences: level 1 includes the catch-up
        trees = []
        for view in seqs:
            tree = self._propose_one(view, depth, level_seconds)
            self._last[view.seq_id] = _top_chain(tree)
            trees.append(tree)
        self.chooser.record_seconds(level_seconds, catch_up)
        return trees

    def _token_logp(self, features: torch.Tensor, view: SequenceView, depth: int) -> torch.Tensor:
        """[R, H] predicted features of nodes whose children sit at ``depth`` -> [R, N] draft log-probabilities
        at the target's temperature; under coupled sampling, the log-softmax of the logits perturbed by that
        position's shared noise (their top-k is a Gumbel-top-k sample coupled to the target's choice)."""
        logits = self.model.logits(features, self.target.runner.lm_head).float()
        s, coupling = self.target.sampling, self.target.coupling
        if coupling is not None:
            noise = coupling.draft_noise(view.noise_key, [len(view.token_ids) - 1 + depth],
                                         self.target.runner.shape.vocab_size, logits.device, self.draft_ids)
            return perturbed_logits(logits, s, noise).log_softmax(-1)
        if s.do_sample and s.temperature != 1.0:
            logits = logits / s.temperature
        return F.log_softmax(logits, dim=-1)

    def _catch_up(self, view: SequenceView) -> torch.Tensor | None:
        """Run the newly committed (feature, next token) pairs; the root's predicted feature [H], or None."""
        hidden = view.new_hidden
        if hidden is None:
            return None
        runner, model = self.target.runner, self.model
        root = len(view.token_ids) - 1
        k = hidden.shape[0]
        tokens = torch.tensor(view.token_ids[root - k + 1 : root + 1], device=runner.device)  # t_{j+1}, j < root
        positions = torch.arange(root - k + 1, root + 1, device=runner.device)
        cache = self.caches.get(view.seq_id)
        past = 0 if cache is None else cache.k.shape[2]
        mask = torch.ones(1, k, past + k, dtype=torch.bool, device=runner.device)
        mask[0, :, past:] = torch.ones(k, k, dtype=torch.bool, device=runner.device).tril()
        embeds = F.embedding(tokens, runner.embed)[None]
        if model.eagle3 and hidden.shape[-1] != model.fc.in_features:
            raise InputError(f"eagle: this EAGLE-3 head reads target layers {list(model.config.feature_layers)}, but "
                             f"the engine passed final hidden states (an EAGLE-3 head cannot run inside the "
                             f"combined drafter)")
        out, new_k, new_v = model(embeds, model.fuse(hidden[None].to(runner.dtype)), positions, mask,
                                  None if cache is None else cache.k, None if cache is None else cache.v)
        if cache is None:
            self.caches[view.seq_id] = _SeqCache(new_k, new_v)
        else:
            cache.k, cache.v = torch.cat([cache.k, new_k], dim=2), torch.cat([cache.v, new_v], dim=2)
        return out[0, -1]

    def _propose_one(self, view: SequenceView, max_depth: int, level_seconds: list[float]) -> DraftTree:
        """``level_seconds[j]`` gains the wall time of level j + 1 (host lists read at each level: synced)."""
        t0 = time.perf_counter()
        h_root = self._catch_up(view)
        if h_root is None:  # a one-token prompt's first step: no feature yet
            return DraftTree.empty()
        runner, model = self.target.runner, self.model
        dev, K = runner.device, self.top_k
        cache = self.caches[view.seq_id]
        past = cache.k.shape[2]
        root_pos = len(view.token_ids) - 1
        # candidate pool (host lists): reduced token index, parent pool index (-1 = root), cumulative logp, logp
        tok: list[int] = []
        parent: list[int] = []
        cum: list[float] = []
        cond: list[float] = []
        logp = self._token_logp(h_root[None], view, 1)[0]
        top = torch.topk(logp, K)
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            tok.append(t), parent.append(-1), cum.append(lp), cond.append(lp)
        t1 = time.perf_counter()
        level_seconds[0] += t1 - t0
        frontier = list(range(K))  # pool indices expanded next
        feature_of = {-1: h_root}  # pool index -> the predicted feature its children's queries read
        tree_k = tree_v = None  # [1, kv_heads, E, head_dim] keys / values of the expanded nodes
        expanded: list[int] = []  # pool index of each tree key row
        for depth in range(2, max_depth + 1):
            n = len(frontier)
            ids = torch.tensor([tok[i] for i in frontier], device=dev)
            full = ids if self.draft_ids is None else self.draft_ids[ids]
            embeds = F.embedding(full, runner.embed)[None]  # [1, n, H]
            feats = torch.stack([feature_of[parent[i]] for i in frontier])[None]
            positions = torch.full((n,), root_pos + depth - 1, device=dev)
            E = len(expanded)
            mask = torch.zeros(1, n, past + E + n, dtype=torch.bool, device=dev)
            mask[0, :, :past] = True
            for r, i in enumerate(frontier):  # ancestors among the expanded nodes, then itself
                a = parent[i]
                while a >= 0:
                    mask[0, r, past + expanded.index(a)] = True
                    a = parent[a]
                mask[0, r, past + E + r] = True
            keys_k = cache.k if tree_k is None else torch.cat([cache.k, tree_k], dim=2)
            keys_v = cache.v if tree_v is None else torch.cat([cache.v, tree_v], dim=2)
            out, nk, nv = model(embeds, feats.to(runner.dtype), positions, mask, keys_k, keys_v)
            tree_k = nk if tree_k is None else torch.cat([tree_k, nk], dim=2)
            tree_v = nv if tree_v is None else torch.cat([tree_v, nv], dim=2)
            expanded.extend(frontier)
            for r, i in enumerate(frontier):
                feature_of[i] = out[0, r]
            child = torch.topk(self._token_logp(out[0], view, depth), K)  # [n, K]
            base = torch.tensor([cum[i] for i in frontier], device=child.values.device)[:, None]
            child_cum = (base + child.values).flatten().tolist()
            child_tok, child_lp = child.indices.flatten().tolist(), child.values.flatten().tolist()
            first = len(tok)
            for j in range(n * K):
                tok.append(child_tok[j]), parent.append(frontier[j // K]), cum.append(child_cum[j])
                cond.append(child_lp[j])
            order = sorted(range(n * K), key=lambda j: -child_cum[j])[:K]
            frontier = [first + j for j in sorted(order)]
            t0, t1 = t1, time.perf_counter()
            level_seconds[depth - 1] += t1 - t0
        return self._rerank(tok, parent, cum, cond, dev)

    def _rerank(self, tok, parent, cum, cond, dev) -> DraftTree:
        """The max_nodes best candidates by cumulative log-probability, parents before children."""
        keep = sorted(range(len(tok)), key=lambda i: (-cum[i], i))[: self.max_nodes]
        chosen = set(keep)
        for i in list(keep):  # ties could drop an ancestor: keep the tree closed (never exceeds the pool)
            a = parent[i]
            while a >= 0 and a not in chosen:
                chosen.add(a)
                a = parent[a]
        order = sorted(chosen)  # pool order is topological (parents are created first)
        while len(order) > self.max_nodes:  # drop the worst leaves added for closure
            leaves = [i for i in order if not any(parent[j] == i for j in order)]
            order.remove(min(leaves, key=lambda i: (cum[i], -i)))
        new_index = {p: n for n, p in enumerate(order)}
        ids = torch.tensor([tok[i] for i in order], dtype=torch.long)
        if self.draft_ids is not None:
            ids = self.draft_ids.cpu()[ids]
        parents = torch.tensor([new_index[parent[i]] if parent[i] >= 0 else -1 for i in order], dtype=torch.long)
        scores = torch.tensor([cond[i] for i in order], dtype=torch.float32).exp().clamp(0.0, 1.0)
        return DraftTree(ids, parents, scores=scores)


def _top_chain(tree: DraftTree) -> tuple[list[int], list[int]]:
    """The tree's most probable chain (at each level the child with the highest score), as (tokens, parents) lists:
    the depth chooser prices a depth as a chain of that many nodes, so it measures a chain's acceptance (a match
    anywhere among eight candidates per level made deep levels look better than the engine's pruned trees were)."""
    if tree.num_nodes == 0:
        return [], []
    tokens, parents, scores = tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()
    chain, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        if not kids:
            return chain, list(range(-1, len(chain) - 1))
        node = max(kids, key=lambda i: (scores[i], -i))
        chain.append(tokens[node])


__all__ = ["EagleDrafter", "EagleDraftConfig", "EagleCheckpointError"]
