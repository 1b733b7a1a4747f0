"""EAGLE's tree growth at fixed shapes, replayed as CUDA graphs.

Eagerly, each level of the growth (drafters/eagle_grow.py) launches a few dozen small kernels, which on a GPU cost
more host time than device time. :class:`EagleGraphs` pads a call to a *bucket*: its sequences to a batch size of
``batch_sizes`` and their cached keys to a power of two (at least ``min_keys``). Per bucket it keeps static inputs
(root features, cached keys / values, and per sequence its key count, root position and noise key); per bucket
and depth a graph of the whole growth and its static pool. A call copies its inputs in, replays, and the host reads
the pool once. Padded sequences see no cached key and padded key columns are masked, so each real sequence's pool
is the eager growth's up to the rounding of differently shaped products (which can only change the tree, never
the output: the verifier decides).

Without a GPU, ``capture=False`` runs the same padded static growth eagerly (the tests). The graphs bake in the
sampling settings and the coupling seed: :func:`eagle_graphs` keeps one EagleGraphs per EAGLE model and such
settings, reused by later generate() calls. A call that fits no bucket, or a capture that fails (logged once),
runs eagerly.

    graphs = eagle_graphs(grower, capture=True)
    pool = graphs.pool(past_k, past_v, key_counts, h_root, root_positions, noise_keys, depth)  # [B, 4, S] or None
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from specdec.drafters.eagle_grow import GrowInputs, TreeGrower

from specdec.host_copy import to_device

logger = logging.getLogger(__name__)

_MODEL_ATTR = "_specdec_eagle_graphs"  # where an EagleModel keeps its EagleGraphs, by settings
MAX_KEPT = 4  # EagleGraphs kept per EAGLE model (each holds static buffers and graphs)


@dataclass(frozen=True)
class EagleGraphConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    min_keys: int = 64  # the smallest cached-key bucket; the others are its powers-of-two multiples
    max_keys: int = 1 << 16
    capture: bool = True  # False: run the padded static growth eagerly (CPU tests)

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or any(not isinstance(x, int) or x < 1 for x in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"batch_sizes must be strictly increasing positive ints, got {sizes!r}")
        if not 1 <= self.min_keys <= self.max_keys:
            raise ValueError(f"need 1 <= min_keys <= max_keys, got {self.min_keys}, {self.max_keys}")


@dataclass
class _Bucket:
    inputs: GrowInputs  # static; real is computed in the growth from ``meta``
    meta: torch.Tensor  # [3, batch] int64: key count, root position, noise key per sequence
    pools: dict[int, torch.Tensor] = field(default_factory=dict)  # depth -> static [batch, 4, S] output
    graphs: dict[int, object] = field(default_factory=dict)  # depth -> torch.cuda.CUDAGraph


class EagleGraphs:
    """One grower's buckets and graphs (module doc)."""

    def __init__(self, grower: TreeGrower, config: EagleGraphConfig = EagleGraphConfig()) -> None:
        self.grower, self.config = grower, config
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if config.capture else None
        self.failed = False  # a capture failed: every later call runs eagerly
        self.replays = 0

    def bucket_for(self, num_seqs: int, num_keys: int) -> tuple[int, int] | None:
        """The smallest (batch, keys) bucket holding the call, None when none does."""
        b = bisect.bisect_left(self.config.batch_sizes, num_seqs)
        keys = self.config.min_keys
        while keys < num_keys:
            keys *= 2
        if b == len(self.config.batch_sizes) or keys > self.config.max_keys:
            return None
        return self.config.batch_sizes[b], keys

    def pool(self, past_k: torch.Tensor, past_v: torch.Tensor, key_counts: Sequence[int], h_root: torch.Tensor,
             root_positions: Sequence[int], noise_keys: Sequence[int], depth: int) -> torch.Tensor | None:
        """The sequences' pools ([B, 4, S], a view of a static output valid until the next call) from their cached
        keys / values ([B, kv_heads, P, head_dim] each, right-padded; sequence b's first ``key_counts[b]`` columns
        are real), root features [B, H], root positions and noise keys; None when the call fits no bucket or
        capture failed (the caller grows eagerly)."""
        key = None if self.failed else self.bucket_for(len(key_counts), past_k.shape[2])
        if key is None:
            return None
        bucket = self.buckets.get(key) or self._new_bucket(*key, past_k, h_root)
        self._load(bucket, past_k, past_v, key_counts, h_root, root_positions, noise_keys)
        if not self.config.capture:
            bucket.pools[depth] = self._grow(bucket, depth)
        elif depth not in bucket.graphs:
            try:
                self._capture(bucket, depth)
            except Exception as error:  # noqa: BLE001 - any capture failure: draft eagerly, say so once
                self.failed = True
                logger.warning("eagle: CUDA-graph capture failed (%s: %s); drafting eagerly", type(error).__name__,
                               error)
                return None
        else:
            bucket.graphs[depth].replay()
        self.replays += 1
        return bucket.pools[depth][: len(key_counts)]

    # ---- internals ----------------------------------------------------------------------
    def _new_bucket(self, batch: int, keys: int, like_k: torch.Tensor, like_h: torch.Tensor) -> _Bucket:
        _, kv_heads, _, head_dim = like_k.shape
        dev = like_k.device
        past_k = like_k.new_zeros(batch, kv_heads, keys, head_dim)
        meta = torch.zeros(3, batch, dtype=torch.long, device=dev)
        inputs = GrowInputs(h_root=like_h.new_zeros(batch, like_h.shape[-1]), past_k=past_k,
                            past_v=torch.zeros_like(past_k), real=torch.zeros(batch, keys, dtype=torch.bool,
                                                                              device=dev),
                            root_pos=meta[1], noise_keys=meta[2])
        bucket = self.buckets[batch, keys] = _Bucket(inputs, meta)
        return bucket

    def _load(self, bucket: _Bucket, past_k, past_v, key_counts, h_root: torch.Tensor, root_positions,
              noise_keys) -> None:
        x, (B, _, P, _) = bucket.inputs, past_k.shape
        x.h_root[:B].copy_(h_root)
        x.h_root[B:].zero_()
        x.past_k[:B, :, :P].copy_(past_k)  # columns past a sequence's keys (stale, finite) are masked
        x.past_v[:B, :, :P].copy_(past_v)
        meta = torch.zeros(3, bucket.meta.shape[1], dtype=torch.long)  # padded sequences: no keys, position 0
        meta[0, :B] = torch.tensor(list(key_counts))
        meta[1, :B] = torch.tensor(list(root_positions))
        meta[2, :B] = torch.tensor(list(noise_keys))
        bucket.meta.copy_(to_device(meta, torch.long, bucket.meta.device))  # a device-to-device copy: no sync

    def _grow(self, bucket: _Bucket, depth: int) -> torch.Tensor:
        x = bucket.inputs
        columns = torch.arange(x.real.shape[1], device=x.real.device)
        torch.lt(columns[None], bucket.meta[0][:, None], out=x.real)  # the real key columns, on the device
        return self.grower.pool(x, depth)

    def _capture(self, bucket: _Bucket, depth: int) -> None:
        # warm-up on a side stream, as torch.cuda.graph asks; it grows the loaded call for real, and so does the
        # capture's first replay, whose pool the caller reads
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._grow(bucket, depth)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            bucket.pools[depth] = self._grow(bucket, depth)
        graph.replay()
        bucket.graphs[depth] = graph
        batch, keys = bucket.meta.shape[1], bucket.inputs.past_k.shape[2]
        logger.info("eagle: captured a CUDA graph for %d sequences x %d cached keys, depth %d", batch, keys, depth)


def eagle_graphs(grower: TreeGrower, capture: bool) -> EagleGraphs:
    """The EagleGraphs of ``grower``'s model under its settings, kept on the model (at most MAX_KEPT, the oldest
    dropped first) and reused by later calls: the graphs read the model's weights and the target's embeddings and
    LM head in their memory, and bake in the sampling settings and the coupling seed."""
    model = grower.model
    key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (grower.embed, grower.lm_head, *model.parameters()))
    key += (grower.sampling, grower.coupling, grower.top_k, capture)
    kept: dict = model.__dict__.setdefault(_MODEL_ATTR, {})
    if key not in kept:
        while len(kept) >= MAX_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = EagleGraphs(grower, EagleGraphConfig(capture=capture))
    else:
        kept[key].grower = grower  # same tensors and settings; the newest drafter's view of them
    return kept[key]
