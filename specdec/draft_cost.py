"""A drafter's cost per propose call, measured once per machine and drafter and cached: what seeded sampling
sizes its trees with.

    seconds, profile = load_draft_seconds(costs, drafter, prompt, runner, sampling)   # engine_setup: seeded only

Why: under standard (rejection) sampling a tree of another shape draws other random numbers, so a seeded call
reproduces its text only if every sizing decision is the same in every run. The tree sizer's usual draft cost
is this run's wall time (:class:`specdec.tree_sizing.TreeSizer`), which is not. Seeded calls size with this
cached value instead, the verify costs of the cached cost model and acceptance learned from tokens only, so
the same seed gives the same text (on the same machine and cache) and the guard still keeps the drafter from
slowing decoding down.

The measurement: a few engine steps of ``drafter`` on the request's first prompt (cut to its last ``CONTEXT``
tokens), sampling as the request does, with its own KV cache and no sizer; the median time of one propose call
for one sequence, warm-up steps excluded. Steps draw no random numbers from the caller's generator nor torch's
global one (a generator of its own; the drafter seeded with a fixed seed first, re-seeded by generate()
afterwards). A batch of B sequences is priced at B times that (the n-gram and EAGLE drafters propose one
sequence at a time; drafters that batch their own forwards are over-priced, which only keeps less of their
trees).

With the seconds the drafter's :meth:`~specdec.drafters.base.Drafter.cost_profile` after those steps is kept: the
per-part seconds (EAGLE's levels, the combined drafter's children) of a drafter that decides per call how much to
draft, so that under a seed it decides from them (``TargetView.cost_profile``). The calibration drafts every part
(no sizer, so those decisions are off).

Cached as JSON beside the cost model's file (``verify-<key>-drafters.json``), one entry per
:meth:`~specdec.drafters.base.Drafter.cost_key` (type, name, settings, the model it loads), written once: a
later measurement never replaces it, since that would change seeded outputs.
``DRAFT_CALIBRATIONS`` counts the measurements this process ran (tests).
"""
from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec.cost_model import CostModel, read_cache, write_cache
from specdec.kv_cache import PagedKVCache, blocks_needed
from specdec.sampling import SamplingConfig
from specdec.stopping import StopCriteria
from specdec.tree import MAX_TREE_NODES

if TYPE_CHECKING:
    from specdec.drafters.base import Drafter

logger = logging.getLogger(__name__)

DRAFT_CALIBRATIONS = {"draft": 0}
CONTEXT = 96  # prompt tokens the measurement keeps (the last ones)
STEPS = 12  # engine steps measured, after WARMUP
WARMUP = 2
_CALIBRATION_SEED = 0x5EED


def drafter_key(drafter: "Drafter") -> dict:
    """What a drafter's cost depends on besides the machine and the target (:meth:`Drafter.cost_key`); ``format``
    2: entries with a cost profile (format-1 entries, without one, are measured again once)."""
    return {"name": drafter.name, "cost_key": drafter.cost_key(), "format": 2}


def _file(costs: CostModel):
    return None if costs.file is None else costs.file.with_name(costs.file.stem + "-drafters.json")


def load_draft_seconds(costs: CostModel, drafter: "Drafter", prompt: Sequence[int], runner, sampling: SamplingConfig,
                       tokenizer=None) -> tuple[float, dict | None]:
    """Seconds of one propose call for one sequence and the drafter's cost profile: cached for (``costs``' key,
    :func:`drafter_key`), else measured now on ``prompt`` (and cached)."""
    key = drafter_key(drafter)
    entry = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    file = _file(costs)
    data = (read_cache(file) if file is not None else None) or {}
    if data.get("key") == costs.key and entry in data.get("drafters", {}):
        return _cached(data["drafters"][entry])
    seconds, profile = measure_draft_seconds(drafter, prompt, runner, sampling, tokenizer)
    if file is not None:
        data = read_cache(file) or {}  # again: another process may have written meanwhile; its value wins
        if data.get("key") != costs.key:
            data = {"key": costs.key, "drafters": {}}
        if entry in data["drafters"]:
            return _cached(data["drafters"][entry])
        data["drafters"][entry] = {"drafter": key, "seconds": seconds, "profile": profile}
        write_cache(file, data)
    return seconds, profile


def _cached(entry: dict) -> tuple[float, dict | None]:
    profile = entry.get("profile")
    return float(entry["seconds"]), profile if isinstance(profile, dict) else None


def measure_draft_seconds(drafter: "Drafter", prompt: Sequence[int], runner, sampling: SamplingConfig,
                          tokenizer=None) -> tuple[float, dict | None]:
    """Median seconds of one propose call for one sequence over ``STEPS`` engine steps on ``prompt``, sampling
    as ``sampling`` says (drafters that sample cost more than greedy ones) from a generator of its own; and the
    drafter's cost profile after those steps."""
    from specdec.engine import Engine

    DRAFT_CALIBRATIONS["draft"] += 1
    t0 = time.perf_counter()
    prompt = list(prompt)[-CONTEXT:]
    room = runner.shape.max_positions - STEPS - WARMUP - MAX_TREE_NODES - 2
    prompt = prompt[-max(room, 1):]
    steps = WARMUP + STEPS
    block_size = 16
    cache = PagedKVCache(runner.shape.num_layers, runner.shape.num_kv_heads, runner.shape.head_dim,
                         blocks_needed([len(prompt)], steps, block_size, MAX_TREE_NODES), block_size,
                         runner.dtype, runner.device, runner.backend)
    drafter.seed_from_generate(_CALIBRATION_SEED)  # generate() seeds it again for the real call
    generator = torch.Generator(device=runner.device).manual_seed(_CALIBRATION_SEED)  # never the caller's
    engine = Engine(runner, cache, sampling, StopCriteria(steps, tokenizer=tokenizer), drafter, generator)
    engine.add([prompt])
    per_call = []
    with torch.inference_mode():
        while engine.live:
            before = engine.seconds["draft"]
            engine.step()
            per_call.append(engine.seconds["draft"] - before)
    measured = per_call[WARMUP:] or per_call
    seconds = statistics.median(measured)
    profile = drafter.cost_profile()
    logger.info("%s: one propose call measured at %.2f ms (median of %d steps, %.1f s)%s", drafter.name,
                seconds * 1e3, len(measured), time.perf_counter() - t0, f", profile {profile}" if profile else "")
    return seconds, profile
