"""Recording a run for offline replay (``specdec eval replay record``).

    record = record_run(loaded, prompts, max_new_tokens=128)          # plain greedy decoding
    save_record(record, "run.json"); record = load_record("run.json")

A record names its model by display name, source and content fingerprint
(:func:`specdec.models.fingerprint.model_fingerprint`), and holds, per prompt, the prompt ids, the
committed tokens of a plain run (greedy, or sampled at ``temperature``), the seconds that run
spent on the prompt's prefill, and the target's top-k tokens with their log-probabilities
(temperature 1, before any sampling transform) at every generated position; and, for the whole
run, the measured costs: ``verify_seconds[n]``, one engine verify step with ``n`` query tokens per
sequence (batch 1, the context of a typical prompt halfway through its answer), and the plain run's
decode seconds per step. :mod:`specdec.eval.replay` replays drafters over it without the target.

The top-k rows come from one teacher-forced target forward over each finished sequence (the
same runner, the same causal attention path as prefill), not from the decoding steps
themselves: exact for the positions' distributions, and it needs no hook in the engine. The
costs come from the engine's calibrated, cached cost model (``specdec.cost_model``: c(n) for every
n, interpolated from its grid), or with ``cost_source="measure"`` from
:func:`specdec.verify_cost.measure_verify_costs` on a grid of query sizes at the record's own
context (linear interpolation in between; see :func:`verify_cost_at`).
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from specdec.eval.resume import model_identity

from specdec.atomic_write import write_json
from specdec.errors import InputError
from specdec.output_dirs import sticky_for_others, why_uncreatable
from specdec.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)

SCHEMA = "specdec.replay-record"
VERSION = 1
COST_GRID = tuple(range(1, 13)) + (16, 20, 24, 32, 40, 48, MAX_TREE_NODES + 1)  # query tokens per sequence


@dataclass(frozen=True)
class RecordConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 20  # target tokens kept per position
    seed: int = 0
    cost_repeats: int = 3  # timed verify steps per query size ("measure" only)
    cost_source: str = "cost-model"  # "cost-model": specdec.cost_model's cached curve; "measure": timed here

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 1:
            raise InputError(f"top_k must be >= 1, got {self.top_k}")
        if self.cost_source not in ("cost-model", "measure"):
            raise InputError(f"cost_source must be 'cost-model' or 'measure', got {self.cost_source!r}")
        if self.cost_repeats < 1:
            raise InputError(f"cost_repeats must be >= 1, got {self.cost_repeats}")


def teacher_forced_topk(loaded: Any, token_ids: Sequence[int], num_prompt_tokens: int, k: int
                        ) -> tuple[list[list[int]], list[list[float]]]:
    """The target's top-k (ids, log-probs at temperature 1) for every token after the prompt: row j is the
    distribution that chose ``token_ids[num_prompt_tokens + j]``. One causal forward over ``token_ids[:-1]``."""
    from specdec.attention import BatchBuilder
    from specdec.kv_cache import CacheConfig, PagedKVCache, blocks_for

    runner, shape = loaded.runner, loaded.runner.shape
    n = len(token_ids) - 1
    if n < num_prompt_tokens or num_prompt_tokens < 1:
        return [], []
    block = CacheConfig().block_size
    cache = PagedKVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, blocks_for(n, block), block,
                         runner.dtype, runner.device, runner.backend)
    cache.add(0)
    cache.reserve_many({0: n})
    builder = BatchBuilder(cache, runner.device)
    builder.add(0, list(token_ids[:-1]), range(n), num_keys=n, num_visible=0)
    batch = builder.build()
    rows = torch.arange(num_prompt_tokens - 1, n, device=batch.token_ids.device)
    out = runner.forward(batch.token_ids, batch.positions, batch.plan, cache, rows)
    logprobs = torch.log_softmax(out.logits.float(), dim=-1)  # [M, vocab]
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return top.indices.tolist(), [[round(x, 6) for x in row] for row in top.values.tolist()]


def measure_costs(loaded: Any, prompts: Sequence[Sequence[int]], config: RecordConfig) -> dict:
    """``{"verify_seconds": {n: s}, "source": ...}`` for n on :data:`COST_GRID` (batch 1, a median prompt extended
    by max_new_tokens / 2: the mean context while decoding)."""
    try:
        from specdec.cost_model import load_cost_model  # the engine's own calibrated, cached curve
    except ImportError:
        load_cost_model = None
    if load_cost_model is not None and config.cost_source == "cost-model":
        from specdec.cost_model import CalibrationConfig
        from specdec.cuda_graphs import auto_uses_graphs

        # priced as generate() runs verify steps by default: replayed CUDA graphs where "auto" uses them
        model = load_cost_model(loaded.runner, CalibrationConfig(graphs=auto_uses_graphs(loaded.runner)))
        if not model.measured:  # its curve prices tokens, not seconds: a record must hold this machine's times
            raise InputError(f"the model's context ({loaded.runner.shape.max_positions} tokens) is too short to "
                             "measure verify costs, which a replay record holds")
        return {"verify_seconds": {n: float(model.seconds(n, 1)) for n in range(1, MAX_TREE_NODES + 2)},
                "source": "specdec.cost_model", "context_tokens": model.config.context}
    from specdec.eval.pricing import size_chunks

    from specdec.cuda_graphs import auto_uses_graphs
    from specdec.sampling import SamplingConfig
    from specdec.verify_cost import calibration_need, measure_verify_costs

    median = sorted(prompts, key=len)[len(prompts) // 2]
    extra = config.max_new_tokens // 2
    costs = {}
    for sizes in size_chunks(list(COST_GRID)):  # each run of sizes on a fresh context
        room = loaded.runner.shape.max_positions - calibration_need(sizes, config.cost_repeats) + 1
        costs.update(measure_verify_costs(loaded.runner, [median], sizes, SamplingConfig(False),
                                          max(0, min(extra, room - len(median))), config.cost_repeats, config.seed,
                                          graphs=auto_uses_graphs(loaded.runner)))  # as generate() verifies
    return {"verify_seconds": costs, "source": "measured (specdec.verify_cost)", "repeats": config.cost_repeats,
            "context_tokens": len(median) + extra}


def check_costs_fit(shape: Any, config: RecordConfig) -> None:
    """An InputError, before anything is recorded, where ``cost_source="measure"`` cannot time every size of
    :data:`COST_GRID` in the model's context (``shape``: the runner's): each run of sizes grows one context by
    ``cost_repeats + 1`` rounds of them."""
    from specdec.eval.pricing import size_chunks

    from specdec.verify_cost import calibration_need, repeats_that_fit

    if config.cost_source != "measure":
        return
    widest = max(sum(sizes) for sizes in size_chunks(list(COST_GRID)))
    need = calibration_need([widest], config.cost_repeats)
    if need > shape.max_positions:
        fewer = repeats_that_fit(shape.max_positions, [widest])
        also = f"lower --cost-repeats to {fewer}, or " if fewer >= 1 else ""
        raise InputError(f"--costs measure needs {need} tokens of context to time its verify steps "
                         f"({config.cost_repeats + 1} rounds of {widest} query tokens on one context), more than the "
                         f"model's {shape.limit_words}; {also}take the cost model's curve (--costs cost-model)")


def record_run(loaded: Any, prompts: Sequence[Sequence[int]], config: RecordConfig = RecordConfig(),
               categories: Sequence[str] | None = None, with_costs: bool = True) -> dict:
    """Run plain decoding over ``prompts`` (one at a time) and return the record (see the module docstring)."""
    from specdec.generate import generate

    if not prompts:
        raise InputError("record_run needs at least one prompt")
    categories = list(categories) if categories is not None else ["custom"] * len(prompts)
    if len(categories) != len(prompts):
        raise InputError(f"record_run: {len(prompts)} prompts but {len(categories)} categories (one per prompt)")
    if with_costs:
        check_costs_fit(loaded.runner.shape, config)
    sampling = dict(do_sample=config.temperature > 0, temperature=config.temperature or 1.0, top_k=0,
                    seed=config.seed)  # the full distribution at that temperature: no warper
    generate(loaded, [list(prompts[0])], max_new_tokens=2, **sampling)  # warm-up: first-call costs out
    sequences, steps, decode_seconds = [], 0, 0.0
    for category, prompt in zip(categories, prompts, strict=True):
        t0 = time.perf_counter()
        out = generate(loaded, [list(prompt)], max_new_tokens=config.max_new_tokens, return_dict=True, **sampling)
        seconds = time.perf_counter() - t0
        stats = out.stats[0]
        steps += stats.steps
        decode_seconds += seconds - out.prefill_seconds
        new = list(out.new_tokens[0])
        ids, logprobs = teacher_forced_topk(loaded, list(prompt) + new, len(prompt), config.top_k)
        sequences.append({"category": category, "prompt_ids": list(prompt), "new_tokens": new,
                          "finish_reason": stats.finish_reason, "topk_ids": ids, "topk_logprobs": logprobs,
                          "prefill_seconds": out.prefill_seconds})
    costs = measure_costs(loaded, prompts, config) if with_costs else {"verify_seconds": {}, "source": "none"}
    costs["decode_step_seconds"] = decode_seconds / steps if steps else None
    runner = loaded.runner
    identity = model_identity(loaded)  # the model by its content: a folder of the same name may hold another
    return {"schema": SCHEMA, "version": VERSION, "model": loaded.name, "model_source": identity["model_source"],
        "model_fingerprint": identity["model_fingerprint"], "dtype": str(runner.dtype).removeprefix(
        "torch."), "device": str(runner.device), "threads": torch.get_num_threads(), "vocab_size":
        runner.shape.vocab_size, "max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
        "top_k": config.top_k, "seed": config.seed, "costs": costs, "sequences": sequences,
        "date": time.strftime("%Y-%m-%d")}


def check_record_path(path: str | Path, overwrite: bool, inputs: Sequence[str | Path] = ()) -> None:
    """Refuse to write a record over one of the run's ``inputs`` (ever), over a file that is no record (ever) or over
    an earlier record (unless ``overwrite``); a one-line InputError naming the file."""
    path = Path(path)
    for source in inputs:
        if path.exists() and Path(source).exists() and path.samefile(source):
            raise InputError(f"--out {path} is the run's input {source}; write the record to another file")
    if path.is_dir():
        raise InputError(f"--out {path} is a directory; name the record file to write")
    if path.exists() and not overwrite:
        raise InputError(f"--out {path} exists; pass --overwrite to replace it, or name another file")
    if path.is_file() and not _is_a_record(path):  # --overwrite replaces an earlier record, never other data
        raise InputError(f"--out {path} exists and is not a replay record; --overwrite replaces only a record: "
                         "name another file")
    if path.is_file() and sticky_for_others(path.parent, {path.name}):  # a rename over it: "Operation not permitted"
        raise InputError(f"--out {path}: --overwrite cannot replace it: {path.parent} has the sticky bit (as /tmp) and "
                         "the record is another user's, which only its owner may replace there; name another file")
    # a folder the record cannot go into (or be written into) fails now, not after the recording
    why = why_uncreatable(path.parent)
    if why is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            why = why_uncreatable(path.parent) or err.strerror or str(err)
    if why is not None:
        what = "write into" if path.parent.is_dir() else "create"
        raise InputError(f"--out {path}: cannot {what} its folder {path.parent} ({why})")


def _is_a_record(path: Path) -> bool:
    """Whether ``path`` holds a replay record (of any version): JSON whose schema says so."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("schema") == SCHEMA


def save_record(record: dict, path: str | Path) -> Path:
    return write_json(path, _to_json(record))


def _to_json(record: dict) -> dict:
    costs = dict(record["costs"])
    costs["verify_seconds"] = {str(n): s for n, s in costs["verify_seconds"].items()}
    return {**record, "costs": costs}


def load_record(path: str | Path) -> dict:
    """A record written by :func:`save_record`, checked (one-line InputError naming the file otherwise)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"replay record {path}: cannot read it ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise InputError(f"replay record {path}: not a {SCHEMA} file")
    if data.get("version") != VERSION:
        raise InputError(f"replay record {path}: version {data.get('version')!r}, this specdec reads {VERSION}")
    try:
        costs = {int(n): float(s) for n, s in data["costs"]["verify_seconds"].items()}
        if any(not math.isfinite(c) or c <= 0 for c in costs.values()):
            raise ValueError("a verify cost is not a positive number of seconds")
        if costs and 1 not in costs:
            raise ValueError("no verify cost of size 1 (a decode step), which every speedup is over")
        data["costs"]["verify_seconds"] = costs
        str(data["model"])  # noqa: B018 (present, of its type)
        vocab = int(data["vocab_size"])
        if int(data["max_new_tokens"]) < 1:
            raise ValueError("max_new_tokens below 1")
        if not isinstance(data["sequences"], list) or not data["sequences"]:
            raise ValueError("no sequences")
        for i, s in enumerate(data["sequences"]):
            _check_sequence(s, vocab, f"sequences[{i}]")
    except KeyError as err:
        raise InputError(f"replay record {path}: malformed (no {err.args[0]!r})") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise InputError(f"replay record {path}: malformed ({err})") from None
    return data


def _check_sequence(s: dict, vocab: int, where: str) -> None:
    """A recorded sequence's ids in the vocabulary, one top-k row of ids and log-probabilities (<= 0) per new token;
    a ValueError naming the position (``where``: the sequence) otherwise."""
    prefill = s.get("prefill_seconds")
    if prefill is not None and not (isinstance(prefill, (int, float)) and math.isfinite(prefill) and prefill >= 0):
        raise ValueError(f"{where}: prefill_seconds {prefill!r} is not a number of seconds")
    if len(s["topk_ids"]) != len(s["new_tokens"]) or len(s["topk_logprobs"]) != len(s["new_tokens"]):
        raise ValueError(f"{where}: top-k rows and new tokens differ in number")
    for field in ("prompt_ids", "new_tokens"):
        for j, t in enumerate(s[field]):
            if not 0 <= int(t) < vocab:
                raise ValueError(f"{where}.{field}[{j}]: token {t} is outside the vocabulary of {vocab}")
    for j, (ids, logprobs) in enumerate(zip(s["topk_ids"], s["topk_logprobs"], strict=True)):
        if not ids:
            raise ValueError(f"{where}.topk_ids[{j}] is empty")
        if len(ids) != len(logprobs):
            raise ValueError(f"{where}.topk_ids[{j}] holds {len(ids)} tokens, topk_logprobs[{j}] {len(logprobs)}")
        bad = next((t for t in ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"{where}.topk_ids[{j}]: token {bad} is outside the vocabulary of {vocab}")
        bad = next((x for x in logprobs if not float(x) <= 0), None)  # NaN too
        if bad is not None:
            raise ValueError(f"{where}.topk_logprobs[{j}]: {bad} is not a log-probability (<= 0)")


def verify_cost_at(costs: dict[int, float], n: int) -> float:
    """Seconds of a verify step with ``n`` query tokens: the recorded value, else linear interpolation between the
    nearest recorded sizes (extrapolated with the last slope past the largest)."""
    if n in costs:
        return costs[n]
    if not costs:
        raise InputError("the record has no verify costs (recorded with costs off)")
    sizes = sorted(costs)
    lo = max((s for s in sizes if s < n), default=None)
    hi = min((s for s in sizes if s > n), default=None)
    if lo is None:
        return costs[hi]
    if hi is None:
        if len(sizes) < 2:
            return costs[lo]
        a, b = sizes[-2], sizes[-1]
        return costs[b] + (costs[b] - costs[a]) / (b - a) * (n - b)
    return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)
