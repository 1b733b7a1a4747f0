"""The acceptance / speed suite behind ``specdec eval acceptance``.

For every (drafter, category) cell it runs the category's prompts through specdec with that drafter and records
tau, acceptance per depth, the accepted-length histogram, tokens/s, the time split between drafting and
verification and the mean draft-tree size; per category it also runs specdec plain decoding and (greedy only)
transformers' ``generate()`` on the same batches. Where the target replays CUDA graphs, its graph cache is sized
and every bucket captured before the first cell (``warm_up_model_graphs``), so no timed cell pays a capture.

Definitions (documented in the report): accepted length of a step = draft tokens accepted in it (every step
commits accepted + 1); tau = committed tokens per target forward; acceptance at depth d = P(a node at depth d
is accepted | its parent was accepted), accepted / tried summed over steps. Predicted speedup, from costs
measured apart from the run it predicts::

    predicted = tau * c_plain / (c_draft + mean over steps of c_verify(1 + nodes of that step))

``c_verify(n)`` is the median seconds of an engine verify step of n query tokens for a batch like the cell's, at
its mean decoding context, timed after the cell at every tree size the cell used (``specdec.verify_cost``,
``specdec.eval.pricing``); ``c_plain = c_verify(1)``; ``c_draft`` the drafter's draft time per step in the cell.
It models decoding only; the JSON also gives the decode-only measured speedup (prefill taken out).

Each finished cell is written at once to ``<out>/cells/<drafter>__<category>[.rank<r>].json`` with its schema, the
digest of its settings and a SHA-256 of its content, so a crashed run resumes where it stopped (``resume=True``).
``settings.json`` records the model and the drafters' checkpoints by their content and the speed conditions (device,
threads, torch); it is written once every row's checkpoint has loaded for the target (:func:`load_drafters`). Before
measuring, a resume refuses (``ResumeError`` naming each file) any finished cell that is unreadable, of another
schema, edited, measured under other settings or conditions, or without a checksum (``specdec.eval.resume``). Under
``accelerate launch`` every process takes its share of the prompts and the main process merges the rank files.
Multi-turn records (``specdec.eval.conversations``) give one cell row per turn. Cells of older runs are still read by
:func:`read_cell` for their reports, never reused by a resume.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from specdec.drafters.base import Drafter, refusals_named
from specdec.drafters.registry import get_drafter
from specdec.eval.pricing import calibration_sizes, predicted_speedup, size_chunks
from specdec.eval.resume import (
    OLDER_CELL_SCHEMAS,
    ResumeError,
    cell_problem,
    check_cells,
    check_resumable,
    load_json,
    model_identity,
    open_cell,
    run_settings,
    seal_cell,
    settings_digest,
    settings_record,
    speed_conditions,
)

from specdec.atomic_write import write_json
from specdec.cuda_graphs import auto_uses_graphs, warm_up_model_graphs
from specdec.generate import generate
from specdec.output import acceptance_rates
from specdec.sampling import SamplingConfig
from specdec.sigterm import sigterm_ends_at_once
from specdec.verify_cost import calibration_need, measure_verify_costs, repeats_that_fit

logger = logging.getLogger(__name__)

BASELINES = ("plain", "hf-greedy")
NO_OUTPUTS = hashlib.sha256(b"").hexdigest()  # Cell.output_sha256 before any sequence


def chain_outputs(digest: str, new_tokens: list[list[int]]) -> str:
    """``digest`` extended by each sequence's new tokens, in order: equal for two cells exactly when they committed
    the same tokens for the same prompts (however the prompts were batched)."""
    for tokens in new_tokens:
        digest = hashlib.sha256(f"{digest}{json.dumps([int(t) for t in tokens])}".encode()).hexdigest()
    return digest


@dataclass(frozen=True)
class SuiteConfig:
    drafters: tuple[tuple[str, dict], ...]  # (row label, options); "plain" is always measured
    categories: tuple[str, ...]
    prompts_per_category: int = 20
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    batch_size: int = 1
    hf_baseline: bool = True  # transformers' greedy generate(), greedy runs only
    seed: int = 0
    calibration_repeats: int = 5  # timed verify steps per query size; 0 = no predicted speedup
    sampler: str = "standard"  # sampling only: "standard" rejection sampling or "coupled" (specdec.coupling)
    # rows whose label is not the drafter's registry name, (label, name): two checkpoints of one drafter side by side
    renamed: tuple[tuple[str, str], ...] = ()
    # "always": every proposal verified whole, so a cell's acceptance depends on no wall time; "auto": the default
    # policy (tree sizing and the break-even guard, timed on this machine): what users get, but a rerun may differ
    speculation: str = "always"

    def __post_init__(self) -> None:
        if self.prompts_per_category < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("prompts per category, max_new_tokens and batch_size must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:  # nan is not < 0
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not self.drafters or not self.categories:
            raise ValueError("give at least one drafter and one category")
        if self.sampler not in ("standard", "coupled"):
            raise ValueError(f"sampler must be 'standard' or 'coupled', got {self.sampler!r}")
        if self.speculation not in ("always", "auto"):
            raise ValueError(f"speculation must be 'always' or 'auto', got {self.speculation!r}")
        if self.calibration_repeats < 0:
            raise ValueError(f"calibration_repeats must be >= 0, got {self.calibration_repeats}")
        clash = [name for name, _ in self.drafters if name in BASELINES]
        if clash:
            raise ValueError(f"{', '.join(clash)} is a baseline the suite always runs, not a drafter")
        labels = [name for name, _ in self.drafters]
        twice = sorted({name for name in labels if labels.count(name) > 1})
        if twice:
            raise ValueError(f"row label(s) {', '.join(twice)} given twice; name each row: LABEL=DRAFTER")
        joined = [label for label in labels if "__" in cell_stem(label)]
        if joined:  # "x" + category "y__z" and "x__y" + "z" would write one cell file
            raise ValueError(f"row label(s) {', '.join(map(repr, joined))} hold '__', which cell file names put "
                             "between a row label and its category; rename them")
        stems: dict[str, str] = {}
        for label in self.labels:  # "a/b" and "a_b" would write one cell file
            other = stems.setdefault(cell_stem(label), label)
            if other != label:
                raise ValueError(f"row labels {other!r} and {label!r} would write the same cell files "
                                 f"({cell_stem(label)}__<category>.json); rename one")
        stray = [label for label, _ in self.renamed if label not in labels]
        if stray:
            raise ValueError(f"renamed row(s) {', '.join(stray)} are not among the drafters")

    def drafter_name(self, label: str) -> str:
        """The registry name of the drafter a row runs (its label unless the row was renamed)."""
        return dict(self.renamed).get(label, label)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature > 0, self.temperature or 1.0)

    @property
    def generate_kwargs(self) -> dict:
        """generate()'s sampling arguments for every call of the suite: its temperature over the full distribution
        (top_k=0, not generate()'s transformers default), its seed and sampler."""
        return dict(self.sampling.generate_kwargs(), seed=self.seed, sampler=self.sampler)

    @property
    def labels(self) -> list[str]:
        """Row labels in report order: plain, the drafters, then hf-greedy when it runs."""
        hf = ["hf-greedy"] if self.hf_baseline and self.temperature == 0 else []
        return ["plain"] + [name for name, _ in self.drafters] + hf


@dataclass
class Cell:
    drafter: str
    category: str
    prompts: int = 0
    new_tokens: int = 0
    steps: int = 0  # sequence steps: one per sequence per target forward it took part in
    forward_passes: int = 0  # engine steps (one batched target forward each), prefill excluded
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    drafts: int = 0  # draft trees proposed (one per sequence step asked; under auto, hindsight looks too)
    draft_nodes: int = 0  # nodes in those trees (before the engine trims them to the token budget)
    depth_tried: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    accepted_histogram: list[int] = field(default_factory=list)  # index = draft tokens accepted in one step
    step_nodes_histogram: list[int] = field(default_factory=list)  # index = tree nodes a sequence step verified
    # one entry per process: {"query_tokens", "plain_seconds", "verify_seconds", "batch", "context_tokens", "repeats"}
    calibration: list[dict] = field(default_factory=list)
    # the same, one entry per query size the cell's steps verified (specdec.eval.pricing), of every process
    size_calibration: list[dict] = field(default_factory=list)
    output_sha256: str = NO_OUTPUTS  # chain_outputs over every prompt's new tokens, in prompt order

    def add(self, out: Any, seconds: float, drafts: int = 0, draft_nodes: int = 0,
            step_nodes: list[int] | None = None) -> None:
        """``step_nodes``: nodes of every tree proposed in the run (the stats' own per-step sizes win where the engine
        records them); sequence steps without a proposal count as 0 nodes."""
        self.prompts += len(out.stats)
        self.seconds += seconds
        self.prefill_seconds += out.prefill_seconds
        self.draft_seconds += out.draft_seconds
        self.verify_seconds += out.verify_seconds
        self.forward_passes += out.forward_passes
        self.drafts += drafts
        self.draft_nodes += draft_nodes
        self.output_sha256 = chain_outputs(self.output_sha256, out.new_tokens)
        for s in out.stats:
            self.new_tokens += s.new_tokens
            self.steps += s.steps
            _add_into(self.depth_tried, s.depth_tried)
            _add_into(self.depth_accepted, s.depth_accepted)
            for committed in s.step_lengths:
                accepted = max(committed - 1, 0)
                _add_into(self.accepted_histogram, [0] * accepted + [1])
        verified = [n for s in out.stats for n in (getattr(s, "step_nodes", None) or ())]
        sizes = verified if verified else list(step_nodes or ())
        sizes += [0] * max(0, sum(s.steps for s in out.stats) - len(sizes))
        for n in sizes:
            _add_into(self.step_nodes_histogram, [0] * n + [1])

    @property
    def outputs_unknown(self) -> bool:
        """Whether the cell ran prompts without a record of their tokens (transformers' baseline, older cells)."""
        return self.prompts > 0 and self.output_sha256 == NO_OUTPUTS

    def merge(self, other: "Cell") -> None:
        """Add ``other``'s counts; the outputs' digest covers both in order, and stays unknown where a part's is."""
        unknown = self.outputs_unknown or other.outputs_unknown
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("drafter", "category"):
                continue
            if f.name in ("calibration", "size_calibration"):
                mine.extend(theirs)
            elif f.name == "output_sha256":
                self.output_sha256 = NO_OUTPUTS if unknown else hashlib.sha256(f"{mine}{theirs}".encode()).hexdigest()
            elif isinstance(mine, list):
                _add_into(mine, theirs)
            else:
                setattr(self, f.name, mine + theirs)

    @property
    def tau(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return self.new_tokens / decode if decode > 0 else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        return list(acceptance_rates(self.depth_accepted, self.depth_tried))

    @property
    def mean_tree_nodes(self) -> float:
        return self.draft_nodes / self.drafts if self.drafts else 0.0


_CELL_FIELDS = {f.name: f.type for f in fields(Cell)}  # annotations as strings: "int", "list[int]", ...


def _check_cell_fields(data: dict) -> str | None:
    return cell_problem(data, _CELL_FIELDS)


def _add_into(acc: list[int], new) -> None:
    if len(acc) < len(new):
        acc.extend([0] * (len(new) - len(acc)))
    for i, x in enumerate(new):
        acc[i] += int(x)


def cell_stem(label: str) -> str:
    """A row label as cell file names spell it (two labels spelled alike are refused by :class:`SuiteConfig`)."""
    return label.replace("/", "_").replace(" ", "_")


def cell_path(out: Path, drafter: str, category: str, rank: int | None = None) -> Path:
    return out / "cells" / f"{cell_stem(drafter)}__{category}{'' if rank is None else f'.rank{rank}'}.json"


def finished_cells(out: Path) -> list[Path]:
    """The cells written in ``out`` so far (every row's and process's, as :func:`cell_path` names them)."""
    return sorted((out / "cells").glob("*__*.json"))


def _write_cell(path: Path, cell: Cell, settings_sha256: str, rank: int | None) -> None:
    write_json(path, seal_cell(asdict(cell), settings_sha256, rank), indent=1)


def read_cell(path: Path, settings_sha256: str | None = None, expect: tuple[str, str, int | None] | None = None
              ) -> Cell:
    """A cell file, checked (``ResumeError`` naming it): schema, checksum, fields, and when given the settings
    digest it must have been measured under and the (drafter, category, rank) it must hold. Without a settings
    digest, a cell of an older run (no checksum, committed-length ``histogram``, no calibration) is read too."""
    data = load_json(path)
    if settings_sha256 is None and isinstance(data, dict) and data.get("schema") in OLDER_CELL_SCHEMAS:
        data = data.get("cell")  # a checked run of an older specdec: its fields, without the output digest
        if not isinstance(data, dict):
            raise ResumeError(f"{path}: 'cell' must be a JSON object")
    elif settings_sha256 is not None or not isinstance(data, dict) or "schema" in data:
        return Cell(**open_cell(path, settings_sha256, expect, _check_cell_fields))
    if "histogram" in data:  # older cells: index = tokens committed in a step = accepted + 1
        committed = data.pop("histogram")
        data.setdefault("accepted_histogram", committed[1:])
    known = {f.name for f in fields(Cell)}
    unknown = sorted(set(data) - known)
    if unknown:
        logger.warning("%s: ignoring unknown fields %s", path, unknown)
    return Cell(**{k: v for k, v in data.items() if k in known})


class _CountingDrafter(Drafter):
    """A drafter seen whole, counting the trees and nodes it proposes: the engine gets every attribute and hook of
    the wrapped drafter (those of the Drafter contract, a later one too, and its own: a combined drafter's
    ``children``), so a cell runs the drafter as generate() would; only ``propose`` and ``propose_pending`` are the
    wrapper's, and they count what the drafter's own give. Under ``speculation="auto"`` the counts include the trees
    asked in hindsight of a drafter that looks back (never verified)."""

    _OWN = frozenset({"inner", "trees", "nodes", "sizes", "propose", "propose_pending", "_count"})

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.trees, self.nodes = inner, 0, 0
        self.sizes: list[int] = []  # nodes of every tree proposed, in order

    def __getattribute__(self, name: str) -> Any:
        if name in _CountingDrafter._OWN or (name.startswith("__") and name.endswith("__")):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CountingDrafter._OWN:
            object.__setattr__(self, name, value)
        else:  # what the engine sets on its drafter is the wrapped one's
            setattr(self.inner, name, value)

    def _count(self, sizes: list[int]) -> None:
        self.trees += len(sizes)
        self.sizes += sizes
        self.nodes += sum(sizes)

    def propose(self, seqs):
        trees = self.inner.propose(seqs)
        self._count([int(getattr(t, "num_nodes", 0)) for t in trees])
        return trees

    def propose_pending(self, seqs):
        pending = self.inner.propose_pending(seqs)
        self._count([int(n) for n in pending.num_nodes])  # known on the host: nothing read from the device
        return pending


def _speculation(config: SuiteConfig, drafter: Drafter | None) -> str:
    """The suite's speculation setting for a drafter's cells; plain cells ask nothing of it (generate() warns about
    a speculation setting without a drafter)."""
    return config.speculation if drafter is not None else "auto"


def hf_greedy_batch(model: Any, batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate()`` on ``batch`` in one call, as specdec's cell runs it: left-padded, with an
    attention mask; each prompt's new tokens up to and including its first end-of-sequence token."""
    gen = model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    eos = {int(t) for t in eos if t is not None}
    pad = gen.pad_token_id if gen.pad_token_id is not None else min(eos, default=0)
    width = max(map(len, batch))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    new = []
    for row in out[:, width:].tolist():
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))  # finished rows are padded after it
        new.append(row[:stop])
    return new


def _hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> tuple[int, float]:
    """New tokens and seconds of transformers' greedy baseline over ``prompts``, in the cells' batches."""
    tokens, seconds = 0, 0.0
    for i in range(0, len(prompts), batch_size):
        t0 = time.perf_counter()
        with torch.inference_mode():
            new = hf_greedy_batch(model, prompts[i : i + batch_size], max_new_tokens)
        seconds += time.perf_counter() - t0
        tokens += sum(map(len, new))
    return tokens, seconds


def _median_batch(prompts: list[list[int]], size: int) -> list[list[int]]:
    """The ``size`` prompts around the median length (a batch like a typical one of the cell)."""
    by_length = sorted(prompts, key=len)
    start = max(0, min((len(by_length) - size) // 2, len(by_length) - size))
    return by_length[start : start + size]


def _calibrate(loaded: Any, cell: Cell, batch: list[list[int]], config: SuiteConfig) -> None:
    """Time a plain step, a step of the mean tree size and one of every tree size the cell verified
    (specdec.eval.pricing), each run of sizes on a fresh context; through CUDA graphs where generate() replays them
    (an eager GPU step costs several times a graphed one: it would price another machine)."""
    n = max(1, round(1 + cell.mean_tree_nodes))
    costs: dict[int, float] = {}
    # each run of sizes grows one context by (repeats + 1) rounds of its query tokens: on a short-context model the
    # runs are shorter, and a size whose rounds alone do not fit leaves the cell unpriced (measure_verify_costs)
    shape, rounds = loaded.runner.shape, config.calibration_repeats + 1
    chunks = size_chunks(calibration_sizes(cell.step_nodes_histogram, cell.mean_tree_nodes),
                         min(80, (shape.max_positions - 3) // rounds))
    widest = max(sum(sizes) for sizes in chunks)
    need = calibration_need([widest], config.calibration_repeats)
    if need > shape.max_positions:
        fewer = repeats_that_fit(shape.max_positions, [widest])
        logger.warning("%s / %s: no predicted speedup: timing its verify steps of %d query tokens, %d rounds on one "
                       "context (--calibration-repeats %d and a warm-up), needs %d tokens, more than the model's %s%s",
                       cell.drafter, cell.category, widest, rounds, config.calibration_repeats, need,
                       shape.limit_words, f"; --calibration-repeats {fewer} fits" if fewer >= 1 else "")
        return
    for sizes in chunks:
        costs.update(measure_verify_costs(loaded.runner, batch, sizes, config.sampling, config.max_new_tokens // 2,
                                          config.calibration_repeats, config.seed,
                                          graphs=auto_uses_graphs(loaded.runner)))  # as the cells verified
    context = sum(len(p) for p in batch) / len(batch) + config.max_new_tokens // 2
    common = {"plain_seconds": costs[1], "batch": len(batch), "context_tokens": round(context, 1),
              "repeats": config.calibration_repeats}
    cell.calibration.append({"query_tokens": n, "verify_seconds": costs[n], **common})
    cell.size_calibration += [{"query_tokens": k, "verify_seconds": v, **common} for k, v in sorted(costs.items())]


def load_drafters(loaded: Any, config: SuiteConfig) -> list[Drafter]:
    """Every row's drafter built and its checkpoint read and checked for the target (``Drafter.load_for_target``, as
    generate() does first): a mistyped ``path=`` or a head made for another model is refused in one line before a run
    writes or deletes anything. Held through the run, what they loaded is what the cells' drafters take (the
    process-wide caches of drafters/loaded_once.py and of the model loader), not read again."""
    drafters = []
    for label, options in config.drafters:
        name = config.drafter_name(label)
        drafter = get_drafter(name, **options)
        with refusals_named(label) if label != name else nullcontext():  # which of two rows of one drafter
            drafter.load_for_target(loaded.runner, getattr(loaded, "tokenizer", None), getattr(loaded, "name", None))
        drafters.append(drafter)
    return drafters


def check_finished_cells(out: Path, labels: list[str], categories: list[str], ranks: list[int | None],
                         settings: dict) -> None:
    """Before a resume reuses them: every finished cell file of these rows, categories and ranks must be sound and
    measured under ``settings`` (one ``ResumeError`` naming each file that is not)."""
    found = [(path, (label, category, rank)) for category in categories for label in labels for rank in ranks
             if (path := cell_path(out, label, category, rank)).exists()]
    check_cells(out, found, settings_digest(settings), _check_cell_fields)


def run_cells(loaded: Any, prompts: dict[str, list[list[int]]], config: SuiteConfig, out: Path,
              rank: int | None = None, resume: bool = False,
              on_progress: Callable[[str, Cell], None] | None = None, settings: dict | None = None) -> None:
    """Measure every (row, category) cell over ``prompts`` (this process's share) and write each cell file
    (``.rank<rank>`` suffixed when ``rank`` is given) as soon as it is done. ``settings``: the run's (default:
    those of ``prompts`` in one process); each cell records their digest, and with ``resume`` only finished cells
    measured under them are kept (checked before anything is measured)."""
    if settings is None:
        settings = run_settings(model_identity(loaded), prompts, config, 1, speed_conditions(loaded))
    digest = settings_digest(settings)
    if resume:
        check_finished_cells(out, config.labels, list(prompts), [rank], settings)
    sampling = config.generate_kwargs
    options = dict(config.drafters)
    warm = next((ps[:1] for ps in prompts.values() if ps), [])
    calls = [[len(p) for p in ps[i : i + config.batch_size]] for ps in prompts.values()
             for i in range(0, len(ps), config.batch_size)]
    # on CUDA: the target's graph cache sized and its buckets captured now, not inside a timed cell
    graphs = warm_up_model_graphs(loaded.runner, calls, config.max_new_tokens) if calls else None
    for label in config.labels:  # warm-up: first-call costs out of the measurements
        if warm and label == "hf-greedy":  # transformers' too, as its baseline is timed like the cells
            with torch.inference_mode():
                hf_greedy_batch(loaded.model, warm, 4)
        elif warm:
            drafter = None if label == "plain" else get_drafter(config.drafter_name(label), **options[label])
            generate(loaded, warm, max_new_tokens=4, drafter=drafter, speculation=_speculation(config, drafter),
                     **sampling)  # as the cells: their trees' first verify happens here
            layers = getattr(drafter, "feature_layers", ())  # an EAGLE-3 head's, known once attached
            if graphs is not None and layers:  # its verify buckets return those layers' streams: captured too
                graphs.warm_up(min(max(map(len, calls)), graphs.config.batch_sizes[-1]), layers)
    for category, mine in prompts.items():
        for label in config.labels:
            path = cell_path(out, label, category, rank)
            if resume and path.exists():
                logger.info("resume: %s / %s already done", label, category)
                continue
            cell = Cell(label, category)
            if label == "hf-greedy":
                cell.new_tokens, cell.seconds = _hf_greedy(loaded.model, mine, config.max_new_tokens,
                                                            config.batch_size)
                cell.prompts = len(mine)
            else:
                for i in range(0, len(mine), config.batch_size):
                    batch = mine[i : i + config.batch_size]
                    drafter = None if label == "plain" else _CountingDrafter(
                        get_drafter(config.drafter_name(label), **options[label]))
                    t0 = time.perf_counter()
                    # whole trees by default (no timed sizing / guard): a cell's acceptance must not depend on
                    # wall times, or a rerun, a resume or a second process would count other steps
                    res = generate(loaded, batch, max_new_tokens=config.max_new_tokens, drafter=drafter,
                                   return_dict=True, speculation=_speculation(config, drafter), **sampling)
                    seconds = time.perf_counter() - t0
                    counts = (drafter.trees, drafter.nodes, drafter.sizes) if drafter is not None else (0, 0, [])
                    cell.add(res, seconds, *counts)
                    if on_progress:
                        on_progress(category, cell)
                if label != "plain" and mine and config.calibration_repeats:
                    _calibrate(loaded, cell, _median_batch(mine, config.batch_size), config)
            _write_cell(path, cell, digest, rank)


def process_state() -> Any:
    """accelerate's state of this process (with several processes, their process group: gloo on the CPU, formed at
    the first call, where SIGTERM ends the process at once: it waits for every process in C++)."""
    from accelerate import PartialState

    with sigterm_ends_at_once():
        return PartialState(cpu=not torch.cuda.is_available())  # CPU-only: processes talk over gloo


def check_resume(loaded: Any, config: SuiteConfig, out: Path, categories: list[str], prompts_identity: Any) -> dict:
    """What a resume checks before it measures anything: ``settings.json`` and every finished cell of ``categories``
    (of every process's rank) must be of this run's settings (``ResumeError`` naming each file that is not); returns
    the settings. Every process checks every rank's cells, so all of them stop together on a bad one."""
    state = process_state()
    settings = run_settings(model_identity(loaded), prompts_identity, config, state.num_processes,
                            speed_conditions(loaded))
    check_resumable(out, settings, True)
    ranks = [None] if state.num_processes == 1 else list(range(state.num_processes))
    check_finished_cells(out, config.labels, categories, ranks, settings)
    return settings


def run_suite(loaded: Any, prompts: dict[str, list[list[int]]], config: SuiteConfig, out: Path, resume: bool = False,
              on_progress: Callable[[str, Cell], None] | None = None, prompts_identity: Any = None
              ) -> dict[tuple[str, str], Cell]:
    """Run (or resume) every cell, sharded over the ``accelerate`` processes; returns merged cells keyed by
    (drafter, category). ``prompts_identity``: what the settings record as the prompts (default: ``prompts``; a
    multi-turn run gives its conversations, the same for every turn's call)."""
    state = process_state()
    rank = state.process_index if state.num_processes > 1 else None
    identity = prompts if prompts_identity is None else prompts_identity
    settings = check_resume(loaded, config, out, list(prompts), identity) if resume else run_settings(
        model_identity(loaded), identity, config, state.num_processes, speed_conditions(loaded))
    held = load_drafters(loaded, config)  # a bad head refused before settings.json is written
    state.wait_for_everyone()  # every process has read the old settings before the main one replaces them
    written = state.is_main_process and not (out / "settings.json").exists()
    if state.is_main_process:
        write_json(out / "settings.json", settings_record(settings), indent=1)
    shard = {}
    for category, cat_prompts in prompts.items():
        with state.split_between_processes(cat_prompts) as mine:
            shard[category] = list(mine)
    try:
        run_cells(loaded, shard, config, out, rank, resume, on_progress, settings)
    except BaseException:
        # a run that failed before its first cell leaves no settings.json of its own: alone, it would make the
        # corrected rerun's --out look like an earlier run's
        if written and not finished_cells(out):
            (out / "settings.json").unlink(missing_ok=True)
        raise
    del held
    state.wait_for_everyone()
    return merge_cells(out, config.labels, list(prompts), state.num_processes, settings)


def merge_cells(out: Path, labels: list[str], categories: list[str], num_processes: int,
                settings: dict | None = None) -> dict:
    """Read the cells of a run; with several processes sum their rank files (seconds are summed process time,
    so tokens/s is per process; calibrations are kept one per process). With ``settings`` every cell must have
    been measured under them and hold the cell its file name says."""
    digest = None if settings is None else settings_digest(settings)

    def read(label: str, category: str, rank: int | None) -> Cell:
        expect = None if digest is None else (label, category, rank)
        return read_cell(cell_path(out, label, category, rank), digest, expect)

    cells = {}
    for label in labels:
        for category in categories:
            if num_processes == 1:
                cells[label, category] = read(label, category, None)
                continue
            merged = Cell(label, category)
            for r in range(num_processes):
                merged.merge(read(label, category, r))
            cells[label, category] = merged
    return cells


def identical_outputs(cell: Cell, plain: Cell) -> bool | None:
    """Whether ``cell`` committed the same tokens as plain decoding for every prompt; None when a side has no record
    of its tokens (transformers' baseline, cells of older runs)."""
    return None if cell.outputs_unknown or plain.outputs_unknown else cell.output_sha256 == plain.output_sha256


def summarise(cells: dict[tuple[str, str], Cell]) -> list[dict]:
    """One row per (drafter, category) with speedups against the same run's baselines and the prediction."""
    rows = []
    for (label, category), cell in cells.items():
        plain = cells[("plain", category)]
        hf = cells.get(("hf-greedy", category))
        measured = cell.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else None
        decode = None  # needs both prefill times (cells of older runs lack them)
        if cell.prefill_seconds and plain.prefill_seconds and cell.decode_tokens_per_second:
            decode = cell.decode_tokens_per_second / plain.decode_tokens_per_second
        row = {"drafter": label, "category": category, "prompts": cell.prompts, "new_tokens": cell.new_tokens,
               "steps": cell.steps, "tau": None if label == "hf-greedy" else cell.tau,  # its steps are not recorded
               "tokens_per_s": cell.tokens_per_second,
               "speedup_vs_plain": measured,
               "speedup_vs_hf": cell.tokens_per_second / hf.tokens_per_second if hf and hf.tokens_per_second else None,
               "decode_speedup_vs_plain": decode,
               "identical_to_plain": identical_outputs(cell, plain),
               "acceptance_per_depth": cell.acceptance_per_depth, "accepted_histogram": cell.accepted_histogram,
               "predicted_speedup": None, "predicted_over_measured": None}
        if label not in BASELINES:
            row["mean_tree_nodes"] = cell.mean_tree_nodes if cell.drafts else None  # older cells: not recorded
            row["draft_share"] = cell.draft_seconds / max(cell.draft_seconds + cell.verify_seconds, 1e-9)
            prediction = predicted_speedup(cell)
            if prediction is not None:
                row.update(prediction)
                if measured:
                    row["predicted_over_measured"] = prediction["predicted_speedup"] / measured
        rows.append(row)
    return rows
