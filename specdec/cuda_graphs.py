"""Verify forwards at fixed shapes, replayed as CUDA graphs: the GPU engine's decode/verify path.

A CUDA graph replays a forward's many small kernel launches from one launch, on fixed shapes and memory, so
:class:`GraphedForward` pads each verify step up to a *bucket* (at most ``batch`` sequences of at most
``tokens_per_seq`` new tokens each) and keeps, per bucket:

* static inputs (:mod:`specdec.kernels.graph_metadata`): token ids, positions, cache write slots and the
  tree-attention metadata, written from the host values of the step's :class:`~specdec.attention.ForwardBatch`
  and moved by one asynchronous copy per step. The step's real tokens come first; the rows after them hold
  token 0 at position 0 and write their K/V into one reserved *scratch slot* that no sequence ever reads; in
  the kernel, padded rows and padded sequences read no keys and write nothing;
* on CUDA, the captured graph and its static output: the final hidden states of every row (and, in buckets of
  their own, the input streams of an EAGLE-3 head's ``feature_layers``). The LM head runs after the replay on the
  step's real rows only, so padding costs no ``rows x vocab`` logits.

Rows meet only in attention: the real rows get the eager forward's values (to the rounding of a product over
another row count; padded rows are never read). The returned hidden states are views of the bucket's static
output, valid until the next call. Without a GPU, ``capture=False`` runs the same padded static forward eagerly
(the tests, in the Triton interpreter).

    graphed = GraphedForward(runner, cache, GraphConfig())
    out = graphed(builder.build())  # None when no bucket fits (builder: a BatchBuilder over graphed.cache)

A step that fits no bucket runs the eager forward; so does every step after a capture that failed (logged once).

``generate(cuda_graphs="auto")`` (the default) uses graphs on CUDA with the Triton backend, through one
GraphedForward per loaded model (:func:`model_graphs`, freed with the model or by :func:`release_model_graphs`),
captured once, serving one generate() at a time; elsewhere (CPU) "auto" is eager. A draft-model drafter keeps
buckets of its own on its model (``model_graphs(..., role="draft")``, apart from the target's even when the models
are one), also one call at a time (specdec.call_claims: a drafter that finds them serving drafts eagerly)."""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import InputError, InputTypeError
from specdec.generate_inputs import check_bool, check_int, describe, is_int
from specdec.kv_cache import CacheFullError, PagedKVCache, blocks_needed
from specdec.models.llama import ForwardOutput, LlamaRunner
from specdec.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)

AUTO = "auto"
# a prefill runs through the buckets in at most PREFILL_REPLAYS replays of PREFILL_CHUNK tokens per sequence
# (GraphedForward.prefill_chunk): on a GPU an eager forward of a short prompt waits for its host's launches, while a
# replay of a 64-token bucket costs about a verify step of 64 tokens (docs/gpu-speed.md)
PREFILL_CHUNK = 64
PREFILL_REPLAYS = 4
# where a loaded model keeps its GraphedForward (model_graphs): as the target, and as a draft model (which may be the
# target itself, drafting in a cache of its own)
_MODEL_ATTRS = {"target": "_specdec_graphed_forward", "draft": "_specdec_graphed_forward_draft"}
SCRATCH_SEQ_ID = -1  # the cache "sequence" owning the scratch slot; engine ids are >= 0
# the largest step a sequence verifies: its root and a tree of MAX_TREE_NODES nodes (the root is visible to every query,
# so a tree-mode query's ancestor mask covers the nodes alone: one 64-bit word in the kernel)
MAX_TOKENS_PER_SEQ = 1 + MAX_TREE_NODES
_CAPTURES = [0]  # CUDA-graph captures attempted in this process, by GraphedForward and by EAGLE's graphs (captures)


def captures() -> int:
    """How many CUDA-graph captures this process has attempted (verify and draft-model buckets, EAGLE's drafting
    calls). A call during which the count grew paid a capture (~0.1-1 s on a GPU, with its warm-up and
    synchronisations): a one-off, whose time must not price a drafter's step or a verify."""
    return _CAPTURES[0]


def note_capture() -> None:
    """Count one capture attempt (:func:`captures`)."""
    _CAPTURES[0] += 1


@dataclass(frozen=True)
class GraphConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # root + tree nodes per sequence; the last holds the largest tree, a 64-token bucket stays for the steps below it
    # (a 65-row bucket runs one more attention tile per sequence, which re-reads the cached keys)
    tokens_per_seq: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, MAX_TOKENS_PER_SEQ)
    capture: bool = True  # False: run the padded static forward eagerly (CPU, interpreter tests)

    def __post_init__(self) -> None:
        """Each field checked: a one-line InputTypeError / InputError naming it; the sizes kept as tuples of ints."""
        for name in ("batch_sizes", "tokens_per_seq"):
            sizes = getattr(self, name)
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not all(map(is_int, sizes)):
                raise InputTypeError(f"GraphConfig: {name} must be a tuple of ints, got {describe(sizes)}")
            sizes = tuple(int(x) for x in sizes)
            if not sizes or sizes[0] < 1 or list(sizes) != sorted(set(sizes)):
                raise InputError(f"GraphConfig: {name} must be strictly increasing positive ints, got {sizes!r}")
            object.__setattr__(self, name, sizes)
        if self.tokens_per_seq[-1] > MAX_TOKENS_PER_SEQ:
            raise InputError(f"GraphConfig: tokens_per_seq may not exceed {MAX_TOKENS_PER_SEQ} (the root and a tree "
                             f"of {MAX_TREE_NODES} nodes), got {self.tokens_per_seq[-1]}")
        check_bool("GraphConfig: capture", self.capture)


@dataclass(frozen=True)
class StaticPlan:
    """What the model forward reads from a plan on the Triton path, in buffers that never move."""

    write_slots: torch.Tensor  # [batch * tokens_per_seq] int32 cache slot per row; padding -> the scratch slot
    kernel_metadata: object  # TreeAttentionMetadata over views of the shared static buffers
    rope_table: tuple[torch.Tensor, torch.Tensor]  # cos, sin [max_keys, 1, head_dim] of every position a bucket sees


@dataclass
class _Bucket:
    batch: int
    tokens_per_seq: int
    inputs: object  # specdec.kernels.graph_metadata.BucketInputs: views of the shared static buffer
    plan: StaticPlan
    feature_layers: tuple[int, ...] = ()  # the layers whose input streams its forward returns (an EAGLE-3 head's)
    output: ForwardOutput | None = None  # static output of the last run / of the capture
    graph: object = None  # torch.cuda.CUDAGraph once captured

    @property
    def rows(self) -> int:
        return self.batch * self.tokens_per_seq


class GraphedForward:
    """The engine's verify forward through fixed-shape buckets (see the module docstring)."""

    def __init__(self, runner: LlamaRunner, cache: PagedKVCache, config: GraphConfig = GraphConfig()) -> None:
        _check_runner(runner, "GraphedForward")
        if not isinstance(cache, PagedKVCache):
            raise InputTypeError(f"GraphedForward: cache must be a specdec.kv_cache.PagedKVCache, got "
                                 f"{type(cache).__name__} (GraphedForward.with_cache builds one)")
        if not isinstance(config, GraphConfig):
            raise InputTypeError(f"GraphedForward: config must be a GraphConfig, got {describe(config)}")
        if not cache.backend.triton:
            raise InputError("CUDA graphs need the Triton attention backend: a CUDA device (SPECDEC_ATTENTION auto "
                             "or triton), or SPECDEC_ATTENTION=triton with TRITON_INTERPRET=1 on CPU, when the "
                             f"runner and cache are built; this cache's backend is {cache.backend.name}")
        if config.capture and not cache.kv.is_cuda:
            raise InputError(f"capture=True needs a CUDA device, the cache is on {cache.kv.device}: pass "
                             "GraphConfig(capture=False) to run the buckets eagerly")
        from specdec.kernels.graph_metadata import StaticInputs

        self.runner, self.cache, self.config = runner, cache, config
        self.weights = weights_key(runner)  # where the weights its graphs read were when they were built (_serves)
        device = cache.kv.device
        cache.add(SCRATCH_SEQ_ID)
        cache.reserve(SCRATCH_SEQ_ID, 1)  # one block, held for the engine's lifetime
        self.scratch_slot = int(cache.slots(SCRATCH_SEQ_ID, 0, 1)[0])
        max_rows = config.batch_sizes[-1] * config.tokens_per_seq[-1]
        self.max_keys = min(runner.shape.max_positions, cache.num_blocks * cache.block_size)
        # one input buffer for all buckets, each laid out from its start
        self.inputs = StaticInputs(config.batch_sizes[-1], config.tokens_per_seq[-1], self.max_keys,
                                   cache.block_size, self.scratch_slot, device)
        self.logits_rows = torch.arange(max_rows, device=device)
        # RoPE of every position a bucket can see, computed once by the eager forward's own function (the same
        # values): a replay gathers its rows instead of recomputing them (about 9 launches per forward)
        self.rope_table = runner.rope(torch.arange(self.max_keys, device=device))
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if config.capture else None  # shared by all graphs
        self.failed = False  # a capture failed: every later step runs the eager forward
        self.told_eager = False  # a decode step fitting no bucket was logged at info level (_note_eager)
        self.discarded = False  # its cache and graphs were freed (discard): any later use is an error
        # its cache serves call after call (the model's, a caller's); False: made for one generate() call, whose end
        # frees its cache (specdec.engine_setup, cuda_graphs=True)
        self.shared = True
        # a generate() call runs in it (the target's or a draft model's): held until that call ends
        # (specdec.call_claims.held_for_call)
        self.serving = False
        self.replays = 0  # verify steps through a bucket
        self.prefill_replays = 0  # prefill chunks through a bucket (Engine.add)

    @classmethod
    def with_cache(cls, runner: LlamaRunner, max_tokens: int, block_size: int = 16,
                   config: GraphConfig = GraphConfig()) -> "GraphedForward":
        """Over a KV cache of its own (``max_tokens`` tokens plus the scratch block), for
        ``generate(..., cuda_graphs=graphed)`` call after call: each bucket is captured once."""
        _check_runner(runner, "GraphedForward.with_cache")
        max_tokens = check_int("GraphedForward.with_cache: max_tokens", max_tokens, minimum=1)
        block_size = check_int("GraphedForward.with_cache: block_size", block_size, minimum=1)
        s = runner.shape
        blocks = -(-max_tokens // block_size) + 1
        cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, blocks, block_size, runner.dtype,
                             runner.device, runner.backend)
        return cls(runner, cache, config)

    def discard(self) -> None:
        """Free the KV cache and the graphs now (the model's graph cache grew or was released), though a caller may
        still hold this object or its cache: using either afterwards is a one-line error, never a write into freed
        memory."""
        self.cache.discard()
        self.buckets.clear()
        self.discarded = True

    def _check_live(self) -> None:
        if self.discarded:
            raise InputError("this GraphedForward was released (its model's graph cache grew or was released): "
                             "take the model's current one (specdec.cuda_graphs.model_graphs)")

    def release_sequences(self) -> None:
        """Free every sequence in the cache except the scratch slot's (before a new generation)."""
        for seq_id in [i for i in self.cache.lengths if i != SCRATCH_SEQ_ID]:
            self.cache.free(seq_id)

    def cache_for(self, runner: LlamaRunner, block_size: int, blocks_needed: int) -> PagedKVCache:
        """This object's KV cache for a new generation by ``runner``, emptied of any earlier call's sequences
        (left over only if that call raised mid-generation); a one-line InputError if it cannot serve it."""
        self._check_live()
        if self.serving:
            raise InputError("this GraphedForward is serving another generate() call (one at a time: a call made "
                             "from a streamer, or from another thread, needs cuda_graphs=False or its own "
                             "GraphedForward)")
        if self.runner.hf_model is not runner.hf_model:
            raise InputError("cuda_graphs: this GraphedForward was built for another model")
        stale = self.changed()
        if stale is not None:
            raise InputError(f"cuda_graphs: this GraphedForward's model was changed since it was built ({stale}): "
                             "build a new GraphedForward")
        if self.cache.block_size != block_size:
            raise InputError(f"block_size={block_size}, but the GraphedForward's cache uses {self.cache.block_size}")
        self.release_sequences()
        if blocks_needed > self.cache.num_free_blocks:
            raise InputError(f"this request may need {blocks_needed} KV blocks of {block_size} tokens; the "
                             f"GraphedForward's cache has {self.cache.num_free_blocks}: build it with a larger "
                             "max_tokens")
        return self.cache

    def changed(self) -> str | None:
        """What of its model changed since it was built, None if nothing: its runner's :meth:`LlamaRunner.stale`
        (its forward is its own runner's, which a call's check does not rebuild), or a weight given other memory,
        which captured graphs would read where it was."""
        stale = self.runner.stale()
        if stale is None and self.weights != weights_key(self.runner):
            stale = "a weight was given other memory (param.data = ..., a move)"
        return stale

    def bucket_for(self, num_seqs: int, max_new: int) -> tuple[int, int] | None:
        """The smallest (batch, tokens_per_seq) bucket holding the step, None if none does."""
        b = bisect.bisect_left(self.config.batch_sizes, num_seqs)
        t = bisect.bisect_left(self.config.tokens_per_seq, max_new)
        if b == len(self.config.batch_sizes) or t == len(self.config.tokens_per_seq):
            return None
        return self.config.batch_sizes[b], self.config.tokens_per_seq[t]

    def fits(self, num_seqs: int, max_new: int, max_keys: int) -> bool:
        """Whether a step of ``num_seqs`` sequences, at most ``max_new`` new tokens and ``max_keys`` keys each,
        runs through a bucket (no prefill among them)."""
        return not self.failed and self._holds(num_seqs, max_new, max_keys)

    def _holds(self, num_seqs: int, max_new: int, max_keys: int) -> bool:
        """Whether some bucket holds the step, its graph captured or not."""
        return max_keys <= self.max_keys and self.bucket_for(num_seqs, max_new) is not None

    def prefill_chunk(self, rows: Sequence[int]) -> int | None:
        """The prompt rows per replay for a prefill of sequences of ``rows`` rows each through the buckets
        (Engine.add: each chunk a causal run after the ones before it), or None where it runs the eager forward: the
        largest bucket of at most PREFILL_CHUNK tokens per sequence, where every prompt takes at most
        PREFILL_REPLAYS replays. Decided by the sizes alone, never by what earlier calls captured (a chunk captures
        its bucket as a verify step does): a prompt's K/V do not depend on the calls before its own."""
        sizes = [t for t in self.config.tokens_per_seq if t <= PREFILL_CHUNK]
        longest = max(rows, default=0)
        if self.failed or not sizes or not 1 <= longest <= self.max_keys or self.bucket_for(len(rows), 1) is None:
            return None
        return sizes[-1] if -(-longest // sizes[-1]) <= PREFILL_REPLAYS else None

    def __call__(self, batch, token_ids: torch.Tensor | None = None, nodes=None,
                 feature_layers: tuple[int, ...] = (), with_logits: bool = True,
                 prefill: bool = False) -> ForwardOutput | None:
        """Logits and hidden states of the real rows of a verify step (``batch``: a ForwardBatch built over this
        object's cache; [num_tokens, ...]), or None when the step fits no bucket (the caller then runs the eager
        forward). ``token_ids`` [num_tokens] on the device stand for the batch's tokens (a drafter's choices that
        the host has not read; an id past the vocabulary, a row with no law, runs as the last id); ``nodes``
        (specdec.pending_trees.NodeRows) for some rows' tokens, positions and ancestor bits (trees the host has not
        read): such a step, checked by :meth:`fits`, always runs here.
        ``feature_layers``: those layers' input streams come back too (``ForwardOutput.features``, an EAGLE-3
        head's), from buckets of their own. ``with_logits=False``: no LM head (``logits`` None). ``prefill``: a
        chunk of a prefill sized by :meth:`prefill_chunk` (a prompt's first chunk runs here only then)."""
        self._check_live()
        if batch.cache is not self.cache:
            raise ValueError("this step was built over another KV cache than the CUDA graphs' own")
        seqs = batch.plan.seqs
        max_new, max_keys = max(s.num_new for s in seqs), max(s.key_slots.numel() for s in seqs)
        if prefill:  # sized by prefill_chunk; after a failed capture the bucket's static forward runs it uncaptured
            fits = self._holds(len(seqs), max_new, max_keys)
        else:
            fits = not any(s.prefill for s in seqs) and self.fits(len(seqs), max_new, max_keys)
        if not fits:
            if nodes is not None or prefill:
                raise ValueError("a step with pending trees or a prefill chunk must fit a CUDA-graph bucket "
                                 "(GraphedForward.fits, prefill_chunk)")
            self._note_eager(seqs, max_new)
            return None
        key = _bucket_key(*self.bucket_for(len(seqs), max_new), feature_layers)
        bucket = self.buckets.get(key) or self._new_bucket(key)
        n = len(batch.tokens)
        self.inputs.load_(bucket.inputs, batch)
        if token_ids is not None:  # copied and clamped in one launch
            torch.clamp(token_ids, max=self.runner.shape.vocab_size - 1, out=bucket.inputs.token_ids[:n])
        if nodes is not None:  # after the load's copy, on the same stream
            bucket.inputs.token_ids.index_copy_(0, nodes.rows, nodes.tokens)
            bucket.inputs.positions.index_copy_(0, nodes.rows, nodes.positions)
            bucket.inputs.metadata.q_bits.index_copy_(0, nodes.rows, nodes.ancestor_bits)
        if self.config.capture and bucket.graph is None and not self.failed:
            captured = self._captured(bucket)
            if not captured and nodes is None and not prefill:
                return None  # the warm-up may have written this step's K/V: the eager forward rewrites the same values
        # uncaptured, or after a failed capture pending trees' inputs (they live only here) or a prefill's chunk
        if bucket.graph is None:
            bucket.output = self._run(bucket)
        else:
            bucket.graph.replay()
        if prefill:
            self.prefill_replays += 1
        else:
            self.replays += 1
        hidden = bucket.output.hidden[:n]
        features = None if bucket.output.features is None else bucket.output.features[:n]
        return ForwardOutput(self.runner.logits(hidden) if with_logits else None, hidden, features)

    def _note_eager(self, seqs, max_new: int) -> None:
        """Say that a decode step runs the eager forward: once at info level (on a GPU it is several times slower,
        and nothing else shows it), then at debug level. A prefill, or any step after a failed capture (warned
        then), is expected to."""
        if self.failed or any(s.prefill for s in seqs):
            return
        say = logger.debug if self.told_eager else logger.info
        self.told_eager = True
        say("a forward of %d sequences x %d new tokens (%d keys) fits no CUDA-graph bucket (at most %d x %d, %d keys): "
            "eager forwards for such steps", len(seqs), max_new, max(s.key_slots.numel() for s in seqs),
            self.config.batch_sizes[-1], self.config.tokens_per_seq[-1], self.max_keys)

    def warm_up(self, num_seqs: int, feature_layers: tuple[int, ...] = ()) -> int:
        """Build every bucket of up to ``num_seqs`` sequences (rounded up to a bucket) and run each once on padding
        alone, which writes only the scratch slot; on CUDA that run is the capture. A step that meets a new bucket
        otherwise captures it inside its own time (~0.1-1 s on a GPU): measurements warm up first. Returns how many
        buckets were new; stops at a failed capture (logged, eager from then on)."""
        self._check_live()
        top = self.bucket_for(num_seqs, 1)
        if top is None:
            raise InputError(f"no bucket holds {num_seqs} sequences (at most {self.config.batch_sizes[-1]})")
        new = 0
        for key in [_bucket_key(b, t, feature_layers) for b in self.config.batch_sizes if b <= top[0]
                    for t in self.config.tokens_per_seq]:
            if self.failed:
                break
            if key in self.buckets:
                continue
            bucket = self._new_bucket(key)
            self.inputs.pad_(bucket.inputs)
            if self.config.capture:
                self._captured(bucket)
            else:
                bucket.output = self._run(bucket)
            new += 1
        return new

    # ---- internals ----------------------------------------------------------------------
    def _captured(self, bucket: _Bucket) -> bool:
        """Capture ``bucket``'s graph; a capture that raises (an unsupported op, out of memory) costs the graphs,
        not the generation: every later step runs eagerly, said once."""
        try:
            self._capture(bucket)
            return True
        except Exception as error:  # noqa: BLE001 - any capture failure
            self.failed = True
            logger.warning("CUDA-graph capture failed (%s: %s); verifying with eager forwards from now on",
                           type(error).__name__, error)
            return False

    def _new_bucket(self, key: tuple) -> _Bucket:
        """``key``: (batch, tokens_per_seq), and the feature layers where a step asks for some."""
        batch, tokens_per_seq, *feature_layers = key
        inputs = self.inputs.bucket(batch, tokens_per_seq)
        bucket = _Bucket(batch, tokens_per_seq, inputs, StaticPlan(inputs.write_slots, inputs.metadata,
                                                                   self.rope_table), *feature_layers)
        self.buckets[key] = bucket
        return bucket

    def _run(self, bucket: _Bucket) -> ForwardOutput:
        rows, inputs = bucket.rows, bucket.inputs
        return self.runner.forward(inputs.token_ids, inputs.positions, bucket.plan, self.cache,
                                   self.logits_rows[:rows], with_logits=False, feature_layers=bucket.feature_layers)

    def _capture(self, bucket: _Bucket) -> None:
        note_capture()
        # warm-up on a side stream, as torch.cuda.graph asks: compiles the kernels, copies the tile lists to
        # the device. It runs the loaded step for real; the replay that follows rewrites the same K/V.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.output = self._run(bucket)
        bucket.graph = graph
        streams = f", with the input streams of layers {list(bucket.feature_layers)}" if bucket.feature_layers else ""
        logger.info("captured a CUDA graph for %d sequences x %d tokens%s", bucket.batch, bucket.tokens_per_seq,
                    streams)


def _check_runner(runner: Any, where: str) -> None:
    """A one-line InputTypeError where ``runner`` is not a LlamaRunner (a LoadedModel or a transformers model passed
    in its place names where the runner is)."""
    if not isinstance(runner, LlamaRunner):
        raise InputTypeError(f"{where}: runner must be a LlamaRunner (a loaded model's .runner: "
                             f"specdec.load_model(...).runner), got {type(runner).__name__}")


def _bucket_key(batch: int, tokens_per_seq: int, feature_layers: tuple[int, ...] = ()) -> tuple:
    """A bucket's key in ``GraphedForward.buckets``: its shape, and the feature layers its forward returns, if any
    (an EAGLE-3 head's buckets are kept apart from the plain ones)."""
    return (batch, tokens_per_seq) + ((tuple(feature_layers),) if feature_layers else ())


def auto_uses_graphs(runner: LlamaRunner) -> bool:
    """cuda_graphs="auto": graphs where they can be captured, a CUDA device with the Triton backend."""
    return runner.device.type == "cuda" and runner.backend.triton


def weights_key(runner: LlamaRunner) -> tuple:
    """Where each of the model's weights is (address, dtype, device): captured graphs read them there."""
    return tuple((p.data_ptr(), p.dtype, p.device) for p in runner.hf_model.parameters())


def _serves(graphed: GraphedForward, runner: LlamaRunner, block_size: int, blocks_needed: int) -> bool:
    """Whether a model's GraphedForward still serves this request: same weights in the same memory, same backend
    and block size, and enough blocks once the earlier call's sequences are freed. A model moved to another device or
    dtype keeps its Parameter objects and swaps their storage, which its graphs would read freed: the addresses are
    compared, not the tensors."""
    old = graphed.runner
    same = (old.hf_model is runner.hf_model and graphed.changed() is None
            and old.backend.name == runner.backend.name and graphed.cache.block_size == block_size)
    return same and graphed.cache.num_blocks - 1 >= blocks_needed  # one block is the scratch slot's


def current_model_graphs(runner: LlamaRunner, role: str = "target") -> GraphedForward | None:
    """The model's GraphedForward in ``role``, if it has one, as it is: nothing is freed, built or grown."""
    return runner.hf_model.__dict__.get(_MODEL_ATTRS[role])


def model_graphs(runner: LlamaRunner, block_size: int, blocks_needed: int,
                 check_fits: Callable[[int], None] = lambda blocks: None,
                 config: GraphConfig | None = None, role: str = "target") -> GraphedForward:
    """The loaded model's own GraphedForward (its KV cache emptied), built or grown when this request needs it.

    A request that outgrows the cache gets a new one of twice the old blocks (fewer rebuilds, each recapturing the
    buckets) when that many fit, else exactly what it needs; the old cache's memory is freed first (a drafter
    reused across calls still holds the last call's view of it) and its graphs dropped. ``check_fits(blocks)``
    raises CacheFullError when ``blocks`` do not fit.
    ``config``: a new cache's buckets (default: captured on CUDA; uncaptured elsewhere, the interpreter tests).
    ``role``: "target" (the engine's verify) or "draft" (a draft-model drafter's forwards): each its own cache."""
    model: Any = runner.hf_model
    attr = _MODEL_ATTRS[role]
    graphed = model.__dict__.get(attr)
    if graphed is not None and _serves(graphed, runner, block_size, blocks_needed):
        graphed.release_sequences()
        return graphed
    grown = 0 if graphed is None else 2 * (graphed.cache.num_blocks - 1)
    if graphed is not None:  # its KV memory is free for the new cache even where an old TargetView holds the cache
        graphed.discard()
    model.__dict__.pop(attr, None)
    del graphed
    blocks = blocks_needed
    if grown > blocks_needed:
        try:
            check_fits(grown + 1)
            blocks = grown
        except CacheFullError:
            pass
    check_fits(blocks + 1)  # + the scratch block
    config = config or GraphConfig(capture=runner.device.type == "cuda")
    graphed = GraphedForward.with_cache(runner, blocks * block_size, block_size, config)
    model.__dict__[attr] = graphed  # a cycle model -> graphs -> runner -> model, collected with the model
    logger.info("cuda_graphs=auto: a graph cache of %d KV blocks for this model as %s, reused by later calls", blocks,
                role)
    return graphed


def warm_up_model_graphs(runner: LlamaRunner, batches: Iterable[Sequence[int]], max_new_tokens: int,
                         block_size: int = 16) -> GraphedForward | None:
    """For measurements: where ``cuda_graphs="auto"`` replays graphs, the model's graph cache sized once for the
    largest of ``batches`` (each the prompt lengths of one generate() call, a drafter's whole tree on top) and its
    buckets of up to that many sequences captured (:meth:`GraphedForward.warm_up`), so that no timed call grows
    the cache or captures a graph. None where "auto" runs eagerly."""
    if not auto_uses_graphs(runner):
        return None
    batches = [list(lengths) for lengths in batches]
    if not batches or not all(batches):
        raise InputError("warm_up_model_graphs needs at least one batch of at least one prompt")
    from specdec.generate_inputs import check_cache_fits

    needed = max(blocks_needed(lengths, max_new_tokens, block_size, MAX_TREE_NODES) for lengths in batches)
    graphed = model_graphs(runner, block_size, needed,  # refused in one line where generate() would refuse it
                           lambda blocks: check_cache_fits(runner.shape, blocks, block_size, runner.dtype,
                                                           runner.device, explicit=False))
    graphed.warm_up(min(max(map(len, batches)), graphed.config.batch_sizes[-1]))  # larger steps run eagerly
    return graphed


def release_model_graphs(model: Any) -> bool:
    """Drop a loaded model's GraphedForwards (as target and as draft model: KV caches and graphs), True if it had
    any."""
    from specdec.models.loader import LoadedModel

    model = model.model if isinstance(model, LoadedModel) else model
    released = [model.__dict__.pop(attr, None) for attr in _MODEL_ATTRS.values()]
    for graphed in released:
        if graphed is not None:  # freed now, though a drafter reused across calls may still hold its cache
            graphed.discard()
    return any(graphed is not None for graphed in released)
