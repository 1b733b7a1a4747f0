"""The acceptance / speed suite behind ``specdec eval acceptance``.

For every (drafter, category) cell it runs the category's prompts through specdec with
that drafter and records tau, acceptance per depth, the committed-length histogram,
tokens/s, and the time split between drafting and verification. Per category it also runs
the baselines once: specdec plain decoding and (greedy only) transformers' ``generate()``.

Definitions (documented in the report):

* acceptance at depth d = P(a node at depth d is accepted | its parent was accepted), i.e.
  accepted / tried summed over steps (the engine's depth counters);
* tau = committed tokens per target forward (mean accepted length + 1);
* predicted speedup = tau * (plain seconds per step) / (draft + verify seconds per step),
  from the measured costs of this run, next to the measured tokens/s ratio.

Each finished cell is written to ``<out>/cells/<drafter>__<category>[.rank<r>].json``
at once, so a crashed run resumes where it stopped (``resume=True`` skips finished cells).
Under ``accelerate launch`` every process takes its share of the prompts
(``split_between_processes``) and the main process merges the shards.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.generate import generate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuiteConfig:
    drafters: tuple[tuple[str, dict], ...]  # (name, options); "plain" is always measured
    categories: tuple[str, ...]
    prompts_per_category: int = 20
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    batch_size: int = 1
    hf_baseline: bool = True  # transformers' greedy generate(), greedy runs only
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompts_per_category < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("prompts per category, max_new_tokens and batch_size must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.drafters or not self.categories:
            raise ValueError("give at least one drafter and one category")


@dataclass
class Cell:
    drafter: str
    category: str
    prompts: int = 0
    new_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    depth_tried: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # index = tokens committed in one step

    def add(self, out: Any, seconds: float) -> None:
        self.prompts += len(out.stats)
        self.seconds += seconds
        self.draft_seconds += out.draft_seconds
        self.verify_seconds += out.verify_seconds
        for s in out.stats:
            self.new_tokens += s.new_tokens
            self.steps += s.steps
            _add_into(self.depth_tried, s.depth_tried)
            _add_into(self.depth_accepted, s.depth_accepted)
            for n in s.step_lengths:
                _add_into(self.histogram, [0] * n + [1])

    def merge(self, other: "Cell") -> None:
        for name in ("prompts", "new_tokens", "steps", "seconds", "draft_seconds", "verify_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("depth_tried", "depth_accepted", "histogram"):
            _add_into(getattr(self, name), getattr(other, name))

    @property
    def tau(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepted, self.depth_tried)]


def _add_into(acc: list[int], new) -> None:
    if len(acc) < len(new):
        acc.extend([0] * (len(new) - len(acc)))
    for i, x in enumerate(new):
        acc[i] += int(x)


def cell_path(out: Path, drafter: str, category: str, rank: int | None = None) -> Path:
    safe = drafter.replace("/", "_").replace(" ", "_")
    return out / "cells" / f"{safe}__{category}{'' if rank is None else f'.rank{rank}'}.json"


def _write_cell(path: Path, cell: Cell) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cell), indent=1))
    os.replace(tmp, path)


def _read_cell(path: Path) -> Cell:
    return Cell(**json.loads(path.read_text()))


def _hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    tokens, seconds = 0, 0.0
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
        seconds += time.perf_counter() - t0
        tokens += out.shape[1] - len(ids)
    return tokens, seconds


def run_suite(loaded: Any, prompts: dict[str, list[list[int]]], config: SuiteConfig, out: Path, resume: bool = False,
              on_progress: Callable[[str, Cell], None] | None = None) -> dict[tuple[str, str], Cell]:
    """Run (or resume) every cell; returns merged cells keyed by (drafter, category)."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # CPU-only: processes talk over gloo
    rank = state.process_index if state.num_processes > 1 else None
    sampling = dict(do_sample=config.temperature > 0, temperature=config.temperature or 1.0, seed=config.seed)
    rows = [("plain", None, {})] + [(name, name, opts) for name, opts in config.drafters]
    if config.hf_baseline and config.temperature == 0:
        rows.append(("hf-greedy", "hf", {}))
    warm = next(iter(prompts.values()))[:1]
    for _label, drafter, options in rows:  # warm-up: first-call costs out of the measurements
        if drafter != "hf":
            generate(loaded, warm, max_new_tokens=4, drafter=drafter, drafter_options=options or None, **sampling)
    for category, cat_prompts in prompts.items():
        with state.split_between_processes(cat_prompts) as mine:
            for label, drafter, options in rows:
                path = cell_path(out, label, category, rank)
                if resume and path.exists():
                    logger.info("resume: %s / %s already done", label, category)
                    continue
                cell = Cell(label, category)
                if drafter == "hf":
                    cell.new_tokens, cell.seconds = _hf_greedy(loaded.model, mine, config.max_new_tokens)
                    cell.prompts = len(mine)
                else:
                    for i in range(0, len(mine), config.batch_size):
                        batch = mine[i : i + config.batch_size]
                        t0 = time.perf_counter()
                        res = generate(loaded, batch, max_new_tokens=config.max_new_tokens, drafter=drafter,
                                       drafter_options=options or None, return_dict=True, **sampling)
                        cell.add(res, time.perf_counter() - t0)
                        if on_progress:
                            on_progress(category, cell)
                _write_cell(path, cell)
    state.wait_for_everyone()
    return merge_cells(out, [r[0] for r in rows], list(prompts), state.num_processes)


def merge_cells(out: Path, labels: list[str], categories: list[str], num_processes: int) -> dict:
    cells = {}
    for label in labels:
        for category in categories:
            if num_processes == 1:
                cells[label, category] = _read_cell(cell_path(out, label, category))
                continue
            merged = Cell(label, category)
            for r in range(num_processes):
                merged.merge(_read_cell(cell_path(out, label, category, r)))
            # shards ran in parallel: wall time is the slowest shard's, tokens/s uses summed process time
            cells[label, category] = merged
    return cells


def summarise(cells: dict[tuple[str, str], Cell]) -> list[dict]:
    """One row per (drafter, category) with speedups against the same run's baselines."""
    rows = []
    for (label, category), cell in cells.items():
        plain = cells[("plain", category)]
        hf = cells.get(("hf-greedy", category))
        row = {"drafter": label, "category": category, "prompts": cell.prompts, "new_tokens": cell.new_tokens,
               "tau": cell.tau, "tokens_per_s": cell.tokens_per_second,
               "speedup_vs_plain": cell.tokens_per_second / plain.tokens_per_second if plain.seconds else None,
               "speedup_vs_hf": cell.tokens_per_second / hf.tokens_per_second if hf and hf.seconds else None,
               "acceptance_per_depth": cell.acceptance_per_depth, "histogram": cell.histogram}
        if cell.steps and plain.steps and label not in ("plain", "hf-greedy"):
            plain_step = (plain.draft_seconds + plain.verify_seconds) / plain.steps
            step = (cell.draft_seconds + cell.verify_seconds) / cell.steps
            row["predicted_speedup"] = cell.tau * plain_step / step
            row["draft_share"] = cell.draft_seconds / max(cell.draft_seconds + cell.verify_seconds, 1e-9)
        rows.append(row)
    return rows
