"""A whole EAGLE drafting call (catch-up, tree growth and rerank) at fixed shapes, replayed as one CUDA graph.

Eagerly, the catch-up (drafters/eagle_catch_up.py) and each level of the growth (drafters/eagle_grow.py) launch a
few dozen small kernels, which on a GPU cost more host time than device time. :class:`EagleGraphs` pads a call to
a *bucket*: its sequences to a batch size of ``batch_sizes``, their cached keys to a power of two (at least
``min_keys``) and their catch-up rows to one of ``catch_up_rows``. Per bucket it keeps static inputs (cached keys /
values; per sequence its key count, root position and noise key; the catch-up's target rows, tokens, positions and
row count, or the roots' features when the catch-up ran eagerly); per bucket, depth and form a graph of the whole
call and its static outputs: the reranked candidates (drafters/eagle_rerank.py), and for a pending proposal
(``fields=True``) also the trees' fields the verify takes, computed in the graph (a chain's depths and ancestor bits
are constants the bucket keeps, made before its first capture: the graph maps only its tokens), and the RoPE rows
the catch-up and the levels gather, from a table of the layer's ``rope()`` below twice its keys (made once per key
count; a call reaching past it runs eagerly). A call copies its
inputs in, replays, and the host reads the candidates once. In the graph the catch-up's keys join the cached ones
after each sequence's last (the columns the eager slab gives them). Padded sequences see no cached key and padded key
columns and rows are masked, so each real sequence's pool is the eager call's up to the rounding of differently
shaped products (which can only change the tree, never the output: the verifier decides).

Without a GPU, ``capture=False`` runs the same padded static call eagerly (the tests). The graphs bake in the
tree size, the sampling settings and the coupling seed: :func:`eagle_graphs` keeps one EagleGraphs per EAGLE model,
target and such settings, reused by later generate() calls, one call at a time (a concurrent one drafts eagerly).
Invariant: a kept EagleGraphs never keeps its target alive: it leaves the EAGLE model's store when the target model
is collected, and holds the target's embeddings and LM head (its ``grower``) only during a call. A call that fits no
bucket, or a capture that fails (logged once), runs eagerly.

    graphs = eagle_graphs(grower, target_model, capture=True)  # None while another generate() call holds them
    out = graphs.pool(past, h_root, depth, fields)          # growth and rerank: a Drafted or None
    out = graphs.caught_up_pool(past, rows, depth, fields)  # catch-up too: a Drafted with new_k, new_v, or None
"""
from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from specdec.drafters.eagle_catch_up import CatchUpInputs, CatchUpRows, catch_up
from specdec.drafters.eagle_grow import GrowInputs, TreeGrower
from specdec.drafters.eagle_rerank import DeviceFields, chain_kept_whole, device_fields

from specdec.call_claims import CLAIMS, held_for_call
from specdec.cuda_graphs import note_capture
from specdec.host_copy import copy_to, to_device
from specdec.pending_trees import chain_fields

logger = logging.getLogger(__name__)

_MODEL_ATTR = "_specdec_eagle_graphs"  # where an EagleModel keeps its EagleGraphs, by settings
MAX_KEPT = 4  # EagleGraphs kept per EAGLE model (each holds static buffers and graphs)


@dataclass(frozen=True)
class EagleGraphConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    min_keys: int = 64  # the smallest cached-key bucket; the others are its powers-of-two multiples
    max_keys: int = 1 << 16
    # catch-up rows per sequence (1 + the tokens a step accepted); a longer catch-up (a prompt's, or steps the
    # guard decoded plainly) runs eagerly and only the growth is replayed
    catch_up_rows: tuple[int, ...] = (8, 32)
    capture: bool = True  # False: run the padded static call eagerly (CPU tests)

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "catch_up_rows"):
            sizes = getattr(self, name)
            if not sizes or any(not isinstance(x, int) or x < 1 for x in sizes) or list(sizes) != sorted(set(sizes)):
                raise ValueError(f"{name} must be strictly increasing positive ints, got {sizes!r}")
        if not 1 <= self.min_keys <= self.max_keys:
            raise ValueError(f"need 1 <= min_keys <= max_keys, got {self.min_keys}, {self.max_keys}")


@dataclass(frozen=True)
class CachedKeys:
    """The sequences' cached keys / values ([B, kv_heads, P, head_dim] each, right-padded: sequence b's first
    ``counts[b]`` columns are its own; None when P is 0), their root positions and noise keys: what every call
    reads."""

    k: torch.Tensor | None
    v: torch.Tensor | None
    counts: Sequence[int]
    root_positions: Sequence[int]
    noise_keys: Sequence[int]
    device: torch.device

    @cached_property
    def real(self) -> torch.Tensor:  # [B, P] bool: sequence b's own columns (built when the eager path asks)
        width = 0 if self.k is None else self.k.shape[2]
        return torch.arange(width, device=self.device)[None] < to_device(list(self.counts), torch.long,
                                                                        self.device)[:, None]


@dataclass(frozen=True)
class Drafted:
    """A call's static outputs (views valid until the next call), the first ``B`` sequences' via :meth:`first`."""

    rows: torch.Tensor  # [B, 4, M] reranked candidates (drafters/eagle_rerank.py)
    fields: DeviceFields | None  # their trees' tokens, depths and ancestor bits ([B, M] each), when asked
    # with a catch-up of R rows: its keys / values [B, kv_heads, R, head_dim], sequence b's first counts[b] columns
    # its own; None when the call only grew
    new_k: torch.Tensor | None = None
    new_v: torch.Tensor | None = None

    def first(self, B: int) -> "Drafted":
        f = self.fields
        return Drafted(self.rows[:B], None if f is None else DeviceFields(f.tokens[:B], f.depths[:B],
                                                                          f.ancestor_bits[:B]),
                       None if self.new_k is None else self.new_k[:B], None if self.new_v is None else self.new_v[:B])


@dataclass
class _Bucket:
    inputs: GrowInputs  # static; ``real`` and (with a catch-up) ``h_root`` are computed in the call
    # [batch, 3 + (2 R + 1 with a catch-up of R rows)] int64: per sequence its key count, root position and noise
    # key, then the catch-up's tokens, positions and row count
    meta: torch.Tensor
    catch: CatchUpInputs | None  # static (views of ``meta`` and a hidden buffer); None: the bucket only grows
    outputs: dict[tuple[int, bool], Drafted] = field(default_factory=dict)  # (depth, fields) -> static outputs
    graphs: dict[tuple[int, bool], object] = field(default_factory=dict)  # (depth, fields) -> torch.cuda.CUDAGraph
    # depth -> a chain's constant depths and ancestor bits ([batch, depth] each, specdec.pending_trees.chain_fields):
    # made before the first capture that reads them and kept, unchanged, as long as its graphs
    chain_fields: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class EagleGraphs:
    """One grower's buckets and graphs (module doc)."""

    def __init__(self, grower: TreeGrower, config: EagleGraphConfig = EagleGraphConfig(), name: str = "eagle") -> None:
        # the grower of the call drafting in it (the target's embeddings and LM head); None between calls (release)
        self.grower: TreeGrower | None = grower
        self.config = config
        self.gone_with_target: weakref.finalize | None = None  # drops it from its store (eagle_graphs)
        self.name = name  # the drafter's, in its logs (mtp runs on EAGLE's machinery)
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.rope_tables: dict[int, torch.Tensor] = {}  # a bucket's keys -> the RoPE table its calls gather from
        self.graph_pool = torch.cuda.graph_pool_handle() if config.capture else None
        self.failed = False  # a capture failed: every later call runs eagerly
        self.serving = False  # a generate() call drafts in it (specdec.call_claims.held_for_call)
        self.replays = 0

    def bucket_for(self, num_seqs: int, num_keys: int, rows: int = 0) -> tuple[int, int, int] | None:
        """The smallest (batch, keys, catch-up rows) bucket holding the call (``rows`` 0: growth only; the keys
        then include the catch-up's), None when none does."""
        b = bisect.bisect_left(self.config.batch_sizes, num_seqs)
        r = bisect.bisect_left(self.config.catch_up_rows, rows) if rows else -1
        if b == len(self.config.batch_sizes) or r == len(self.config.catch_up_rows):
            return None
        rows = self.config.catch_up_rows[r] if rows else 0
        keys = self.config.min_keys
        while keys < num_keys + rows:
            keys *= 2
        if keys > self.config.max_keys:
            return None
        return self.config.batch_sizes[b], keys, rows

    def pool(self, past: CachedKeys, h_root: torch.Tensor, depth: int, fields: bool = False) -> Drafted | None:
        """The sequences' reranked pools, with ``fields`` their trees' fields too (views of static outputs valid until
        the next call), grown from their root features ``h_root`` [B, H]; None when the call fits no bucket or
        capture failed (the caller grows eagerly)."""
        key = None if self.failed else self.bucket_for(len(past.counts), past.k.shape[2])
        if key is None or not self._fits_rope(key, past, depth):
            return None
        bucket = self.buckets.get(key) or self._new_bucket(key, past.k, h_root.shape[-1], None)
        self._load(bucket, past)
        B = h_root.shape[0]
        bucket.inputs.h_root[:B].copy_(h_root)
        bucket.inputs.h_root[B:].zero_()
        out = self._call(bucket, (depth, fields))
        return None if out is None else out.first(B)

    def caught_up_pool(self, past: CachedKeys, rows: CatchUpRows, depth: int, fields: bool = False
                       ) -> Drafted | None:
        """The catch-up, the growth and the rerank in one call: the pools (with ``fields`` their trees' fields) and
        the catch-up's keys and values (sequence b's first ``rows.counts[b]`` columns its own, which the caller adds
        to its cache), views of static outputs valid until the next call; None when the call fits no bucket or
        capture failed (the caller catches up and grows eagerly)."""
        B, L = len(past.counts), rows.hidden.shape[1]
        key = None if self.failed else self.bucket_for(B, past.k.shape[2], L)
        if key is None or not self._fits_rope(key, past, depth):
            return None
        bucket = self.buckets.get(key) or self._new_bucket(key, past.k, self.grower.model.config.hidden_size,
                                                           rows.hidden)
        self._load(bucket, past, rows)
        bucket.catch.hidden[:B, :L].copy_(rows.hidden)  # rows past a sequence's own are masked (module doc)
        out = self._call(bucket, (depth, fields))
        return None if out is None else out.first(B)

    # ---- internals ----------------------------------------------------------------------
    @staticmethod
    def _fits_rope(key: tuple[int, int, int], past: CachedKeys, depth: int) -> bool:
        """Whether the RoPE table of the bucket ``key`` (positions below twice its keys) holds the call's positions:
        the catch-up's rows up to each root, the levels' up to root + depth - 1. A sequence's root sits about its
        cached keys and new rows from the start, so this fails only for a bucket-sized tree."""
        return max(past.root_positions, default=0) + depth <= 2 * key[1]

    def _new_bucket(self, key: tuple[int, int, int], like_k: torch.Tensor, hidden_size: int,
                    like_rows: torch.Tensor | None) -> _Bucket:
        batch, keys, rows = key
        _, kv_heads, _, head_dim = like_k.shape
        dev = like_k.device
        past_k = like_k.new_zeros(batch, kv_heads, keys, head_dim)
        meta = torch.zeros(batch, 3 + (2 * rows + 1 if rows else 0), dtype=torch.long, device=dev)
        # made once, before any capture, by the layer's own rope(): a call gathers its positions' rows (_fits_rope)
        if keys not in self.rope_tables:
            self.rope_tables[keys] = self.grower.model.rope_table(2 * keys, like_k.dtype, dev)
        table = self.rope_tables[keys]
        inputs = GrowInputs(h_root=like_k.new_zeros(batch, hidden_size), past_k=past_k,
                            past_v=torch.zeros_like(past_k), real=torch.zeros(batch, keys, dtype=torch.bool,
                                                                              device=dev),
                            root_pos=meta[:, 1], noise_keys=meta[:, 2], rope_table=table)
        catch = None
        if rows:
            catch = CatchUpInputs(like_rows.new_zeros(batch, rows, like_rows.shape[-1]), meta[:, 3 : 3 + rows],
                                  meta[:, 3 + rows : 3 + 2 * rows], meta[:, 3 + 2 * rows], table)
        bucket = self.buckets[key] = _Bucket(inputs, meta, catch)
        return bucket

    def _load(self, bucket: _Bucket, past: CachedKeys, rows: CatchUpRows | None = None) -> None:
        x, (B, _, P, _) = bucket.inputs, past.k.shape
        x.past_k[:B, :, :P].copy_(past.k)  # columns past a sequence's keys (stale, finite) are masked
        x.past_v[:B, :, :P].copy_(past.v)
        batch, width = bucket.meta.shape
        fields = zip(past.counts, past.root_positions, past.noise_keys, strict=True)
        if rows is None:
            meta = [list(f) for f in fields]
        else:
            meta = [[*f, *r] for f, r in zip(fields, rows.packed(bucket.catch.tokens.shape[1]), strict=True)]
        meta += [[0] * width] * (batch - B)  # padded sequences: no keys or rows, position 0
        copy_to(bucket.meta, meta)

    def _run(self, bucket: _Bucket, form: tuple[int, bool]) -> Drafted:
        """The padded call of ``form`` (depth, fields) on the bucket's static tensors: what is captured, and run
        eagerly without capture."""
        x, meta, c = bucket.inputs, bucket.meta, bucket.catch
        batch, keys = x.real.shape
        columns = torch.arange(keys, device=x.real.device)
        torch.lt(columns[None], meta[:, :1], out=x.real)  # the cached key columns, on the device
        if c is None:
            return self._drafted(bucket, *form)
        h_root, new_k, new_v = catch_up(self.grower.model, self.grower.embed, c, x.past_k, x.past_v, x.real,
                                        self.grower.fused)
        x.h_root.copy_(h_root)
        # the catch-up's keys join each sequence's cached ones after its last: columns count .. count + R - 1
        rows = c.tokens.shape[1]
        cols = meta[:, :1] + torch.arange(rows, device=columns.device)[None]  # [batch, R]
        seqs = torch.arange(batch, device=columns.device)[:, None].expand(batch, rows)
        x.past_k[seqs, :, cols] = new_k.transpose(1, 2)
        x.past_v[seqs, :, cols] = new_v.transpose(1, 2)
        torch.lt(columns[None], (meta[:, 0] + c.counts)[:, None], out=x.real)
        return self._drafted(bucket, *form, new_k, new_v)

    def _drafted(self, bucket: _Bucket, depth: int, fields: bool, new_k: torch.Tensor | None = None,
                 new_v: torch.Tensor | None = None) -> Drafted:
        rows = self.grower.tree_rows(bucket.inputs, depth)
        if not fields:
            return Drafted(rows, None, new_k, new_v)
        return Drafted(rows, device_fields(rows, depth, self.grower.draft_ids, bucket.chain_fields.get(depth)),
                       new_k, new_v)

    def _call(self, bucket: _Bucket, form: tuple[int, bool]) -> Drafted | None:
        """Run the loaded bucket in ``form`` (depth, fields), capturing its graph the first time -> its static
        outputs, or None when a capture failed."""
        depth, fields = form
        g = self.grower
        if fields and chain_kept_whole(g.chain, depth, g.max_nodes) and depth not in bucket.chain_fields:
            bucket.chain_fields[depth] = chain_fields(bucket.meta.shape[0], depth, bucket.meta.device)  # not captured
        if not self.config.capture:
            bucket.outputs[form] = self._run(bucket, form)
        elif form not in bucket.graphs:
            try:
                self._capture(bucket, form)
            except Exception as error:  # noqa: BLE001 - any capture failure: draft eagerly, say so once
                self.failed = True
                logger.warning("%s: CUDA-graph capture failed (%s: %s); drafting eagerly", self.name,
                               type(error).__name__, error)
                return None
        else:
            bucket.graphs[form].replay()
        self.replays += 1
        return bucket.outputs[form]

    def _capture(self, bucket: _Bucket, form: tuple[int, bool]) -> None:
        note_capture()
        # warm-up on a side stream, as torch.cuda.graph asks: it runs the loaded call for real, but the capture's
        # first replay runs it again from the inputs (the warm-up's catch-up keys land in masked columns) and
        # its outputs are what the caller reads
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(bucket, form)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            bucket.outputs[form] = self._run(bucket, form)
        graph.replay()
        bucket.graphs[form] = graph
        batch, keys, rows = bucket.meta.shape[0], bucket.inputs.past_k.shape[2], 0 if bucket.catch is None else (
            bucket.catch.tokens.shape[1])
        logger.info("%s: captured a CUDA graph for %d sequences x %d cached keys, %s, depth %d%s", self.name, batch,
                    keys, f"{rows} catch-up rows" if rows else "no catch-up", form[0],
                    ", the trees' fields" if form[1] else "")


def eagle_graphs(grower: TreeGrower, target: object, capture: bool, name: str = "eagle") -> EagleGraphs | None:
    """The EagleGraphs of ``grower``'s model over the target model ``target`` (whose embeddings and LM head the
    grower reads) under its settings, kept on the EAGLE model (at most MAX_KEPT, the oldest dropped first) and reused
    by later calls: the graphs read the model's weights and the target's embeddings and LM head in their memory, and
    bake in the tree size, the sampling settings and the coupling seed. An entry leaves when ``target`` is collected,
    so a dropped target is freed (the module doc's invariant; the drafter hands the grower back with :func:`release`
    at the call's end). ``name``: the drafter's, for the logs. Held for the generate() call running on this thread
    (specdec.call_claims); None when another call holds it (its static buffers are that call's): the caller drafts
    eagerly."""
    model = grower.model
    ids = [] if grower.draft_ids is None else [grower.draft_ids]  # the reduced vocabulary's, read by address too
    reads = [grower.embed, grower.lm_head, *model.parameters(), *ids]
    key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in reads)
    key += (grower.sampling, grower.coupling, grower.top_k, grower.max_nodes, grower.fused is not None, capture)
    with CLAIMS:  # found and taken at once
        kept: dict = model.__dict__.setdefault(_MODEL_ATTR, {})
        graphs = kept.get(key)
        if graphs is None:
            while len(kept) >= MAX_KEPT:  # a call still drafting in the one dropped keeps it to its end
                dropped = kept.pop(next(iter(kept)), None)  # None: its target went meanwhile (_forget)
                if dropped is not None:
                    dropped.gone_with_target.detach()
            graphs = kept[key] = EagleGraphs(grower, EagleGraphConfig(capture=capture), name)
            # the entry holds the target's tensors (and its graphs read them): it goes when the target does. The
            # callback holds neither the EAGLE model nor the entry (a weak reference and the key)
            graphs.gone_with_target = weakref.finalize(target, _forget, weakref.ref(model), key)
        if not held_for_call(graphs):
            return None
        graphs.grower, graphs.name = grower, name  # same tensors and settings; the newest drafter's view of them
        return graphs


def release(graphs: EagleGraphs, grower: TreeGrower) -> None:
    """The end of the call that drafted in ``graphs`` with ``grower``: the graphs let go of the grower (the target's
    embeddings and LM head, kept by the next call's), so a drafter object reused across calls that keeps its graphs
    keeps no dropped target's tensors."""
    if graphs.grower is grower:
        graphs.grower = None


def _forget(model_ref: weakref.ref, key: tuple) -> None:
    """The target of the EagleGraphs ``key`` was collected: the EAGLE model (if alive) drops it. An atomic pop, no
    lock: this runs inside the collector, possibly on a thread that holds CLAIMS."""
    model = model_ref()
    if model is not None:
        model.__dict__.get(_MODEL_ATTR, {}).pop(key, None)
