"""Building the :class:`~specdec.engine.Engine` for one generate() request.

    request = prepare(model, input_ids, drafter="ngram", max_new_tokens=64)   # specdec.generate
    engine = build_engine(request)                                             # here
    out = run(engine, request)                                                 # specdec.generate

First the drafter's checkpoint is read and checked for the target (``Drafter.load_for_target``): one made for another
model is refused before anything below is measured, and what it loaded is dropped again if the build then fails
(``Drafter.unload_for_target``: a reused drafter holds no draft model for a call that never ran; a failure of its own
is logged, never raised over the build's error). The drafter's ``feature_layers`` are checked against the target's
layers then too, before the prefill forward reads them.

What is decided here: the CPU row policy of ``linear()``; with a drafter and ``speculation="auto"``, the speculation
policy and its measured cost model (:mod:`specdec.cost_model`, cached; the first use on a machine calibrates it, once:
docs/speculation-policy.md; none for seeded standard sampling); the KV cache's size (the request's worst case, checked
against the device's memory before anything is allocated) or a reused CUDA-graph cache; the drafter's seed, the sampling
generator, the draft audit (one per drafter object, kept across the calls whose draws are fresh), the logits processors
(:mod:`specdec.logits_processing`; None when the config asks for none) and whether log-probabilities are kept. The
certificate's negative controls (:mod:`specdec.eval.negative_controls`) enter here too, and only here: a broken
acceptance rule (``rule=``) or a broken engine / cache (``fault=``), so that real callers of ``generate()`` cannot
switch them on by accident.
"""
from __future__ import annotations

import functools
import logging
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.audit import call_audit
from specdec.call_claims import CLAIMS, held_for_call
from specdec.cost_model import CalibrationConfig, ensure_row_policy, load_cost_model
from specdec.coupling import Coupling
from specdec.cuda_graphs import (
    AUTO,
    GraphConfig,
    GraphedForward,
    auto_uses_graphs,
    current_model_graphs,
    model_graphs,
)
from specdec.drafters.base import Drafter, _ObjectDrafter
from specdec.engine import Engine
from specdec.errors import InputError, InputTypeError
from specdec.generate_inputs import check_cache_fits, describe
from specdec.kv_cache import CacheFullError, PagedKVCache, blocks_for, blocks_needed, plain_blocks_needed
from specdec.logits_processing import LogitsProcessing
from specdec.models import row_policy
from specdec.rejection import EXACT, AcceptanceRule
from specdec.speculation_policy import SpeculationPolicy
from specdec.tree import MAX_TREE_NODES
from specdec.tree_sizing import TreeSizer

if TYPE_CHECKING:
    from specdec.generate import GenerateRequest
    from specdec.models.llama import LlamaRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineFault:
    """Negative controls only (see :mod:`specdec.eval.negative_controls`): deliberately broken
    :class:`Engine` / :class:`PagedKVCache` subclasses that ``build_engine(fault=...)`` builds
    instead of the real ones, so the certificate can check that it catches them. Its output is
    wrong by design; never use one to get real output."""

    name: str
    engine_cls: type[Engine] = Engine
    cache_cls: type[PagedKVCache] = PagedKVCache


def build_engine(request: "GenerateRequest", rule: AcceptanceRule = EXACT, fault: EngineFault | None = None,
                 warn: bool = True) -> Engine:
    """The engine for ``request``: the real one unless a negative control passes ``rule`` / ``fault``, which is
    logged at warning level (at info with ``warn=False``: a control its caller runs on purpose)."""
    if not isinstance(rule, AcceptanceRule):
        raise InputTypeError(f"rule must be an AcceptanceRule, got {describe(rule)}")
    if fault is not None and not isinstance(fault, EngineFault):
        raise InputTypeError(f"fault must be an EngineFault or None, got {describe(fault)}")
    level = logging.WARNING if warn else logging.INFO
    if rule is not EXACT:
        logger.log(level, "acceptance rule %r is not the exact one: the output is NOT the target's distribution",
                   rule.name)
    if fault is not None:
        logger.log(level, "engine fault %r injected: the output is deliberately WRONG (negative control)", fault.name)
    config = request.config
    if config.invariant and request.cuda_graphs and request.cuda_graphs != AUTO:
        raise InputError("invariant=True does not run through CUDA graphs: pass cuda_graphs=False (or 'auto')")
    runner = request.loaded.runner.invariant_mode(config.invariant)  # the bit-exact mode shares every weight
    processing, output_logprobs = _processing(request), _wants_logprobs(request)  # refusals before allocating
    if request.drafter is None:
        return _build(request, runner, rule, fault, processing, output_logprobs)
    try:  # its checkpoint read and checked before anything is measured (attach reuses it)
        request.drafter.load_for_target(runner, request.stop.tokenizer, request.loaded.name)
        _check_feature_layers(request.drafter, runner.shape.num_layers)  # known once loaded (an EAGLE-3 head's)
        return _build(request, runner, rule, fault, processing, output_logprobs)
    except BaseException:  # a reused drafter keeps no draft model for a call that never ran
        _unload(request.drafter)
        raise


def _unload(drafter: Drafter) -> None:
    """``drafter.unload_for_target()`` after a failed build, where its own failure is logged, never raised: it would
    hide the error that failed the build."""
    try:
        drafter.unload_for_target()
    except Exception:
        logger.warning("%s: unload_for_target() failed after the call's build failed", getattr(drafter, "name", "?"),
                       exc_info=True)


def _check_feature_layers(drafter: Drafter, num_layers: int) -> None:
    """Refuse a drafter whose ``feature_layers`` are not layer ids of the target: ints in [0, num_layers], the id
    num_layers being the last layer's output (before the final norm); a bad one failed in the prefill forward."""
    value = drafter.feature_layers
    try:
        layers = tuple(value)
    except TypeError:
        raise InputTypeError(f"drafter {drafter.name!r}: feature_layers must be a tuple of target layer ids, got "
                             f"{describe(value)}") from None
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i <= num_layers]
    if bad:
        raise InputError(f"drafter {drafter.name!r}: feature_layers {list(layers)} holds {bad[0]!r}, no layer id of "
                         f"the target: it has {num_layers} layers, ids 0 to {num_layers} ({num_layers}: the last "
                         "layer's output)")


def _build(request: "GenerateRequest", runner: "LlamaRunner", rule: AcceptanceRule, fault: EngineFault | None,
           processing: LogitsProcessing | None, output_logprobs: bool) -> Engine:
    """build_engine's engine, once the drafter (if any) is loaded for ``runner``."""
    config = request.config
    # the request's worst case: no sequence can run out with a pool this large, its drafter's trees included
    needed = _worst_case_blocks(request, MAX_TREE_NODES if request.drafter is not None else 0)
    cache, graphed = _kv_cache(request, needed, fault)  # a shared graph cache: held until the call ends
    fit_free_blocks = _pool_may_run_short(request, needed)
    drafter, generator = request.drafter, request.generator
    # first, so that one draw of generator= gives the same noise with and without a drafter
    coupling = _coupling(config, generator) if config.sampler == "coupled" and config.do_sample else None
    if coupling is not None and rule is not EXACT:
        raise InputError(f"acceptance rule {rule.name!r} applies to rejection sampling; coupled sampling walks the "
                         "tree by the target's own Gumbel-max tokens and has no acceptance rule")
    # the guard and tree sizing price verify steps as this engine runs them: replayed graphs on a GPU
    graphs = graphed is not None and graphed.config.capture
    # a bucket pads every sequence to the step's largest tree: the policy caps the trees together
    policy = _policy(request, runner, rule, fault, coupling, generator, graphs, padded=graphed is not None)
    drafter_seed = config.seed  # what sampled drafts are seeded from (TargetView.seed)
    if drafter is not None and generator is not None and config.do_sample:
        drafter_seed = int(torch.randint(2**62, (), generator=generator, device=generator.device))
    if generator is None and config.seed is not None:
        generator = torch.Generator(device=runner.device).manual_seed(config.seed)  # on the logits' device
    audit = None
    if config.audit_drafts and drafter is not None and config.do_sample:  # evidence kept across calls per drafter
        audit = call_audit(drafter.obj if isinstance(drafter, _ObjectDrafter) else drafter,
                           drafter.draw_source(drafter_seed))
    ensure_row_policy(runner)  # linear()'s CPU row policy, measured on this machine (cached)
    if runner.device.type == "cpu":  # packed weight copies (CPU only) a write autograd does not count left stale
        row_policy.forget_edited(runner.multiplied_weights())
    engine_cls = Engine if fault is None else fault.engine_cls
    return engine_cls(runner, cache, sampling=config.sampling, stop=request.stop, drafter=drafter, policy=policy,
                      generator=generator, draft_seed=drafter_seed, audit=audit, rule=rule, graphed=graphed,
                      coupling=coupling, processing=processing, output_logprobs=output_logprobs,
                      fit_free_blocks=fit_free_blocks)


def _policy(request: "GenerateRequest", runner: "LlamaRunner", rule: AcceptanceRule, fault: EngineFault | None,
            coupling: Coupling | None, generator: torch.Generator | None, graphs: bool = False,
            padded: bool = False) -> SpeculationPolicy:
    """The speculation policy: tree sizing and the break-even guard (speculation="auto"), or none: verify every
    proposal whole.

    None for negative controls, whose broken rule must meet the drafts it is meant to mishandle. Seeded standard
    sampling keeps only what reads no measurement: there a tree of another shape draws other random numbers, so a
    seed gives one text only if no decision reads this machine's measurements (which a deleted cache or a
    recalibration changes); its trees are verified whole, and a drafter that can never pay by its shapes alone is
    never asked. Coupled sampling needs no such care: its text does not depend on the trees at all. ``runner``: the
    call's (the bit-exact mode's prices its own steps, under a key of its own)."""
    config, drafter = request.config, request.drafter
    if drafter is None or config.speculation != "auto" or rule is not EXACT or fault is not None:
        return SpeculationPolicy()
    if config.do_sample and (config.seed is not None or generator is not None) and coupling is None:
        _warn_seeded_standard_sampling()
        return SpeculationPolicy(auto=True)
    costs = load_cost_model(runner, CalibrationConfig(graphs=graphs), batch=len(request.prompts))
    # the guard remembers across calls per target cost curve, as measured, and drafter (specdec.remembered); what it
    # learned on a curve since measured again is not carried over. cost_key() names a drafter's checkpoint too, so
    # two EAGLE or Medusa checkpoints keep apart backoffs
    return SpeculationPolicy(TreeSizer(costs, memory=(str(costs.file), costs.measured_id(), drafter.cost_key()),
                                       calibrated_scores=drafter.calibrated_scores, padded=padded))


@functools.cache  # once a process: the rule holds for every call
def _warn_seeded_standard_sampling() -> None:
    logger.warning("seeded standard sampling verifies every draft tree whole, so the seed's text does not depend on "
                   "this machine's measured costs: a drafter that does not pay here is not held off and can decode "
                   "slower than no drafter; sampler='coupled' keeps one text per seed and sizes trees")


def _processing(request: "GenerateRequest") -> LogitsProcessing | None:
    if request.config.logits_processor and len({len(p) for p in request.prompts}) > 1:
        _warn_unpadded_rows()
    return LogitsProcessing.from_config(request.config, sorted(request.stop.eos_token_ids),
                                        request.loaded.runner.shape.vocab_size, request.prompt_width,
                                        request.loaded.runner.device)


@functools.cache  # once a process: the rule holds for every call
def _warn_unpadded_rows() -> None:
    logger.warning("your logits processors see each row of a batch without its left padding, as if decoded alone "
                   "(transformers gives them the padded rows): one that counts from the padded batch's "
                   "input_ids.shape[-1], as RepetitionPenaltyLogitsProcessor(prompt_ignore_length=...) or "
                   "MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=...) built for the batch do, acts "
                   "later on its shorter rows: give prompts of other lengths separate calls")


def _wants_logprobs(request: "GenerateRequest") -> bool:
    """output_logprobs=True needs return_dict (they come back in GenerateOutput.logprobs); transformers'
    output_scores=True asks for them too, and like transformers' is a no-op without return_dict_in_generate."""
    config = request.config
    if config.output_logprobs and not request.return_dict:
        raise InputError("output_logprobs=True needs return_dict=True (or return_dict_in_generate=True): the "
                         "log-probabilities come back in GenerateOutput.logprobs")
    return request.return_dict and (config.output_logprobs or config.output_scores)


def _coupling(config, generator: torch.Generator | None) -> Coupling:
    """The call's shared noise: from ``seed``, else one draw of ``generator``, else of torch's global RNG."""
    if config.seed is not None:
        return Coupling(config.seed)
    draw = torch.randint(2**62, (), generator=generator, device=generator.device if generator is not None else "cpu")
    return Coupling(int(draw))


def _worst_case_blocks(request: "GenerateRequest", tree_budget: int) -> int:
    """The blocks with which no sequence of the request can run out, with trees of ``tree_budget`` nodes."""
    return blocks_needed(map(len, request.prompts), request.config.max_new_tokens, request.config.block_size,
                         tree_budget)


def _pool_may_run_short(request: "GenerateRequest", needed: int) -> bool:
    """Whether an explicit num_blocks is below ``needed``, the request's worst case with the drafter's trees: the
    engine then cuts each tree to the blocks free for it (exact). Below what plain decoding can hold, a warning: the
    call may raise CacheFullError (at or above it, it never does: the trees are cut); below what the prompts'
    prefill and first step hold (no token could come), that CacheFullError now."""
    num_blocks = request.config.num_blocks
    if num_blocks is None:
        return False
    block_size = request.config.block_size
    # Engine.add prefills all but the last token, which the first step writes (every sequence is live then)
    first = sum(blocks_for(len(p), block_size) for p in request.prompts)
    if num_blocks < first:  # refused before any work, not warned about and then raised at the prefill or first step
        raise CacheFullError(f"KV cache too small for the prompts: their prefill and first step need {first} blocks of "
                             f"{block_size} tokens, num_blocks={num_blocks}. Pass a larger num_blocks, or fewer / "
                             "shorter prompts.")
    plain = plain_blocks_needed(map(len, request.prompts), request.config.max_new_tokens, request.config.block_size)
    if num_blocks < plain:
        logger.warning("num_blocks=%d is below the %d blocks of %d tokens that the prompts and max_new_tokens=%d "
                       "can need: the call may raise CacheFullError (with the tokens generated so far in its "
                       "new_tokens)", num_blocks, plain, request.config.block_size, request.config.max_new_tokens)
    return request.drafter is not None and num_blocks < needed


def _kv_cache(request: "GenerateRequest", needed: int, fault: EngineFault | None
              ) -> tuple[PagedKVCache, GraphedForward | None]:
    """The call's KV cache (``needed`` blocks, the request's worst case, unless num_blocks says otherwise) and its
    CUDA graphs, if any."""
    runner, config = request.loaded.runner, request.config
    shape, block_size = runner.shape, config.block_size
    graphs = request.cuda_graphs
    if isinstance(graphs, GraphedForward):  # its own cache and graphs, reused call after call
        with CLAIMS:  # checked and taken at once: another thread's call sees it serving
            cache = _graphed_cache(graphs, request, needed, fault)
            held_for_call(graphs)  # free: _graphed_cache refuses one that serves
        return cache, graphs
    if graphs == AUTO:  # on CUDA: the model's own graph cache, reused by later calls; else eager
        graphs = fault is None and not config.invariant and auto_uses_graphs(runner)  # the bit-exact mode: eager
        if graphs and config.num_blocks is None:
            def check_fits(blocks: int) -> None:
                check_cache_fits(shape, blocks, block_size, runner.dtype, runner.device, explicit=False)

            with CLAIMS:  # checked and taken at once: two threads' calls must never both take it
                held = current_model_graphs(runner)
                if held is None or not held.serving:
                    # its cache emptied, of this block size and enough blocks, its model unchanged (or it is new):
                    # model_graphs checked what cache_for checks of a GraphedForward passed in
                    graphed = model_graphs(runner, block_size, needed, check_fits)
                    held_for_call(graphed)  # free: checked before model_graphs freed its sequences
                    return graphed.cache, graphed
            # a call from inside another's (a streamer's), or beside it (another thread's)
            logger.info("cuda_graphs=auto: the model's graph cache serves another generate() call; this one runs "
                        "eagerly")
            graphs = False
    if graphs and not runner.backend.triton:  # CPU tests run uncaptured graphs on the Triton interpreter
        if runner.device.type == "cuda":
            raise InputError(f"cuda_graphs=True needs the Triton attention backend, and the model runs on the "
                             f"{runner.backend.name} one: load it with backend='auto' (Triton on CUDA) or pass "
                             "cuda_graphs=False")
        raise InputError(f"cuda_graphs=True needs a CUDA device, and the model runs on {runner.device}: pass "
                         "cuda_graphs='auto' (the default: graphs on CUDA, eager elsewhere) or False")
    blocks = needed if config.num_blocks is None else config.num_blocks
    blocks += int(graphs)  # the graphs' scratch slot holds one block
    check_cache_fits(shape, blocks, block_size, runner.dtype, runner.device, explicit=config.num_blocks is not None)
    cache_cls = PagedKVCache if fault is None else fault.cache_cls
    cache = cache_cls(shape.num_layers, shape.num_kv_heads, shape.head_dim, blocks, block_size, runner.dtype,
                      runner.device, runner.backend)  # one backend per engine: the runner's
    graphed = GraphedForward(runner, cache, GraphConfig(capture=cache.kv.is_cuda)) if graphs else None
    if graphed is not None:
        graphed.shared = False  # this call's alone
    return cache, graphed


def _graphed_cache(graphed: GraphedForward, request: "GenerateRequest", blocks_needed: int,
                   fault: EngineFault | None) -> PagedKVCache:
    if fault is not None or request.config.num_blocks is not None:
        raise InputError("cuda_graphs=GraphedForward(...) brings its own KV cache: num_blocks and engine faults "
                         "cannot be combined with it")
    return graphed.cache_for(request.loaded.runner, request.config.block_size, blocks_needed)
