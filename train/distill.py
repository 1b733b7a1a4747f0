"""Self-distillation: the target model answers prompts itself (specdec's batched ``generate()``).

The heads then learn the target's own distribution. Results are cached on disk, keyed by the
model, the prompts and the generation settings, so a second run does not regenerate. Each finished
batch is appended to ``<key>.partial.jsonl`` first (``<key>.partial.<p>.jsonl`` by process p of several), so a
run interrupted part-way (Ctrl-C, SIGTERM, a crash) generates only the batches still missing when run again with
the same settings, with any number of processes. Several processes share the batches, one each per round, and
exchange them (train/process_team.py): N processes distil N times as fast, and a batch is the same prompts (a
sampled one the same seed) whoever generates it, so the data do not depend on the process count. On a GPU the
decode steps replay as CUDA graphs from one set of buckets reused chunk after chunk (:func:`use_graphs`).

    seqs = self_distill(loaded, prompts, max_new_tokens=128, batch_size=16, cache_dir=...)
    # list[list[int]]: chat-templated prompt + the target's response, per prompt
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from specdec.train.deferred_interrupts import interrupts_deferred
from specdec.train.process_team import Team

from specdec.atomic_write import write_json, write_text
from specdec.errors import InputError
from specdec.generate_inputs import check_encoded
from specdec.models.embedded import cache_root
from specdec.models.fingerprint import model_fingerprint
from specdec.output_dirs import why_uncreatable

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return cache_root() / "distill"  # $SPECDEC_CACHE_DIR, else ~/.cache/specdec


def encode_prompt(tokenizer, prompt: str, what: str = "the prompt") -> list[int]:
    """``prompt`` as the model's prompt ids: through its chat template, else as text; one that encodes to no token is
    refused naming it (``what``: which prompt it is)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  return_dict=False))
    return check_encoded(prompt, tokenizer(prompt, add_special_tokens=True)["input_ids"], what)


def use_graphs(loaded, cuda_graphs: bool | None) -> bool:
    """Whether self-distillation decodes through CUDA-graph buckets (:func:`decoding_graphs`). ``cuda_graphs``:
    None (auto) = on a CUDA device with the Triton backend, the only place graphs are captured; True demands the
    Triton backend (a one-line InputError without it; on CPU, in the Triton interpreter, the same padded buckets run
    uncaptured: how the tests check it); False = eager.

    On a GPU the embedded model's decode step is bound by its ~1,600 kernel launches (plain decoding ran 7.6-7.9x
    faster with graphs on an H200, batch 1), and self-distillation is the GPU recipes' main cost."""
    runner = loaded.runner
    if cuda_graphs is None:
        return runner.device.type == "cuda" and runner.backend.triton
    if cuda_graphs and not runner.backend.triton:
        raise InputError(f"CUDA graphs need the Triton backend; the model on {runner.device} runs the "
                         f"{runner.backend.name} backend (SPECDEC_ATTENTION)")
    return bool(cuda_graphs)


def one_row_policy(loaded, team: Team) -> None:
    """Several processes about to decode: ``linear()``'s CPU row policy is the first process's (read from the cost
    cache, or measured while the others wait), not one measured by each at once: processes timing the same
    products side by side can choose differently, and another policy rounds another way, so their answers could
    part from one process's at near-ties (:func:`specdec.cost_model.adopt_row_policy`). Every process calls it."""
    if team.size == 1:
        return
    from specdec.cost_model import adopt_row_policy, row_policy_decision

    decision = row_policy_decision(loaded.runner) if team.index == 0 else None
    adopt_row_policy(loaded.runner, team.exchange(decision)[0])


def decoding_graphs(loaded, prompt_lengths: list[int], max_new_tokens: int, batch_size: int):
    """A :class:`~specdec.cuda_graphs.GraphedForward` for plain batched decoding of prompts of ``prompt_lengths``
    tokens, ``batch_size`` at a time in order, with a KV cache of its own as large as the largest chunk needs (what
    eager ``generate()`` would allocate for it): passed as ``generate(..., cuda_graphs=...)`` chunk after chunk, each
    bucket is captured once. Captured on a GPU, run uncaptured elsewhere (:func:`use_graphs`)."""
    from specdec.cuda_graphs import GraphConfig, GraphedForward
    from specdec.generation_config import GenerationConfig
    from specdec.kv_cache import blocks_needed

    runner = loaded.runner
    # buckets: every power of two below the batch and the batch itself (sequences finish at different steps)
    sizes = tuple(sorted({1 << k for k in range(batch_size.bit_length()) if 1 << k < batch_size} | {batch_size}))
    block = GenerationConfig().block_size  # generate()'s, which the cache must match
    blocks = max(blocks_needed(prompt_lengths[i : i + batch_size], max_new_tokens, block, tree_budget=0)
                 for i in range(0, max(len(prompt_lengths), 1), batch_size))
    config = GraphConfig(batch_sizes=sizes, tokens_per_seq=(1,), capture=runner.device.type == "cuda")
    return GraphedForward.with_cache(runner, max(blocks, 1) * block, block, config)


def self_distill(loaded, prompts: list[str] | list[list[int]], *, max_new_tokens: int, batch_size: int = 16,
                 do_sample: bool = False, temperature: float = 1.0, seed: int = 0,
                 cache_dir: str | os.PathLike | None = None, progress: bool = True,
                 cuda_graphs: bool | None = None, team: Team | None = None) -> list[list[int]]:
    """``cuda_graphs``: see :func:`use_graphs` (None: on where they can be captured). Graphs change bf16 rounding at
    near-ties, so data made with them is cached under its own key. ``team``: the processes of a run distilling
    together (train/process_team.py); each generates every ``team.size``-th batch still missing, they exchange
    them batch by batch, and every process returns the sequences of a run of one process (a batch keeps its prompts
    and, sampled, its seed, whoever generates it). ``progress``: a bar on the first process."""
    from specdec.generate import generate

    team = team or Team.alone()
    ids = [p if isinstance(p, list) else encode_prompt(loaded.tokenizer, p) for p in prompts]
    graphs = use_graphs(loaded, cuda_graphs)
    key = {"model": model_fingerprint(loaded.model), "prompts": ids, "max_new_tokens": max_new_tokens,
           "do_sample": do_sample, "temperature": temperature if do_sample else None,
           "seed": seed if do_sample else None, "batch_size": batch_size if do_sample else None}
    if graphs:  # only then: caches made without graphs keep their keys
        key["cuda_graphs"] = True
    key = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    file = cache / f"{key}.json"
    cached = read_cache_entry(file, "sequences", lambda seqs: len(seqs) == len(ids) and _continue(seqs, ids))
    held = dict(enumerate(cached)) if cached is not None else kept_answers(cache, key, ids, team.index)
    starts = range(0, len(ids), batch_size)  # a batch is these prompts whoever generates it: a sampled one's seed too
    whole = [s for s in starts if all(i in held for i in range(s, min(s + batch_size, len(ids))))]
    try:
        views = team.exchange((cached is not None, whole))  # what each process found: a cache, finished batches
        if all(found for found, _ in views):
            logger.info("self-distillation cache hit: %s", file)
            remove_partials(cache, key, team.index)  # a run killed after writing the entry, before removing them
            return cached
        todo = what_is_left(held, [set(w) for _, w in views], len(ids), batch_size, team, cache)
        if todo:
            one_row_policy(loaded, team)
        graphed = (decoding_graphs(loaded, [len(p) for p in ids], max_new_tokens, batch_size)
                   if graphs and todo[team.index :: team.size] else False)

        def answers(start: int) -> list[list[int]]:
            chunk = ids[start : start + batch_size]
            res = generate(loaded, chunk, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                           top_k=0, seed=seed + start if do_sample else None, return_dict=True, cuda_graphs=graphed)
            return [list(p) + list(n) for p, n in zip(chunk, res.new_tokens, strict=True)]

        t0 = time.perf_counter()  # graph capture counted: it is part of what the recipe pays
        new_tokens = _in_rounds(answers, todo, batch_size, ids, held, team, partial_file(cache, key, team.index),
                                progress and team.index == 0)
        seconds = time.perf_counter() - t0
        out = [held[i] for i in range(len(ids))]
        cache_whole(file, {"sequences": out}, cache, key, team)
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM through the CLI: it names what is kept (train/cli.py)
        err.distilled = (len(held), len(ids), team.size)  # several processes: those this one knows of
        raise
    logger.info("self-distilled %d sequences (%d new tokens) in %.1f s, %.0f tokens/s, %s%s; cached in %s", len(out),
                new_tokens, seconds, new_tokens / max(seconds, 1e-9), _how(graphed, batch_size),
                f", {team.size} processes" if team.size > 1 else "", file)
    return out


def read_cache_entry(file: Path, field: str, sound: Callable[[list], bool]) -> list | None:
    """The list under ``field`` in the cache file ``file``, or None where there is none. A file that is not JSON, or
    whose list ``sound`` refuses (a machine that went down just after the write can leave it empty, a copy cut
    short), is made again, with a warning naming it: read as it was, it stopped the run with a JSON error naming no
    file, or with another number of answers than prompts ("zip() argument 2 is longer than argument 1")."""
    if not file.is_file():
        return None
    try:
        entry = json.loads(file.read_text(encoding="utf-8"))[field]
        if isinstance(entry, list) and sound(entry):
            return entry
        why = "not what this run asked for"
    except (OSError, ValueError, KeyError, TypeError) as err:
        why = f"{type(err).__name__}: {err}"
    logger.warning("the cache file %s is damaged (%s); it is made again", file, why)
    return None


def _continue(seqs: list, prompts: list[list[int]]) -> bool:
    """Whether each of ``seqs`` is a list of tokens that starts with its prompt of ``prompts``."""
    return all(isinstance(s, list) and s[: len(p)] == list(p) for s, p in zip(seqs, prompts, strict=True))


def what_is_left(held: dict[int, list[int]], found: list[set[int]], n: int, batch_size: int, team: Team,
                 cache: Path, what: str = "self-distillation", unit: str = "prompts") -> list[int]:
    """The starts of the batches no process holds whole (``found``: the starts each process holds). Where the
    processes found different ones (caches that are not one directory: each node its own disk), the first process
    holding a batch another lacks sends it (an exchange every process makes, or none does). ``what`` and ``unit``:
    the job and what its ``n`` counts, as the log line names them."""
    done = set().union(*found)
    if done != set.intersection(*found):
        mine = {s: [held[i] for i in range(s, min(s + batch_size, n))] for s in sorted(done)
                if any(s not in f for f in found) and next(p for p, f in enumerate(found) if s in f) == team.index}
        for theirs in team.exchange(mine):
            for s, seqs in theirs.items():
                held.update(enumerate(seqs, s))
    if done:
        logger.info("%s continues an interrupted run: %d of %d %s were done (%s)", what,
                    sum(min(batch_size, n - s) for s in done), n, unit, cache)
    return [s for s in range(0, n, batch_size) if s not in done]


def _in_rounds(answers, todo: list[int], batch_size: int, ids: list[list[int]], held: dict[int, list[int]],
               team: Team, own: Path, progress: bool) -> int:
    """Generate the batches starting at ``todo`` (``answers(start)``), each process every ``team.size``-th, one per
    round: each is appended to this process's partial file ``own`` before the next starts, then the round's batches
    are exchanged into ``held``. Returns the tokens generated (by every process)."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        left = sum(len(ids[s : s + batch_size]) for s in todo)
        bar = tqdm(total=len(ids), initial=len(ids) - left, unit="prompt", desc="self-distill", disable=None)
    new_tokens, t0 = 0, time.perf_counter()
    for start, _ in team.rounds(todo):
        made = {}
        if start is not None:
            made[start] = answers(start)
            keep_batch(own, start, made[start], held)
        for theirs in team.exchange(made):  # every process's batch of this round
            for s, seqs in theirs.items():
                held.update(enumerate(seqs, s))
                new_tokens += sum(len(x) - len(ids[s + i]) for i, x in enumerate(seqs))
                if bar is not None:
                    bar.update(len(seqs))
                    bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    if bar is not None:
        bar.close()
    return new_tokens


def keep_batch(own: Path, start: int, seqs: list[list[int]], held: dict[int, list[int]]) -> None:
    """Append the finished batch ``seqs`` of the sequences from ``start`` on to the partial file ``own`` (on disk
    before the next batch starts), and count it in ``held``: an interrupt waits until both are done (the CLI's last
    line names that count; between the two, it named one batch fewer than were kept)."""
    with interrupts_deferred(), open(own, "a", encoding="utf-8") as f:
        f.write(json.dumps({"start": start, "sequences": seqs}) + "\n")
        f.flush()
        os.fsync(f.fileno())
        held.update(enumerate(seqs, start))


def cache_whole(file: Path, record: dict, cache: Path, key: str, team: Team) -> None:
    """Write the whole ``record`` (the distillation's, the self-written prompts') to ``file`` and remove the partial
    files: the first process, then every other whose cache directory is not the first one's (another node's disk)
    and so lacks ``file``, each its own partial file (one writer per directory: two with one process id, on two
    nodes, would share a temporary file)."""
    if team.index == 0:
        write_json(file, record)
        remove_partials(cache, key, 0)  # every process's: they have finished appending
    team.meet()
    if team.index > 0:
        if not file.is_file():
            write_json(file, record)
        remove_partials(cache, key, team.index)


def remove_partials(cache: Path, key: str, index: int) -> None:
    """Once the whole entry of ``key`` is written: the first process removes every process's partial file, any other
    process its own (another node's disk holds no one else's)."""
    for partial in _partial_files(cache, key) if index == 0 else [partial_file(cache, key, index)]:
        partial.unlink(missing_ok=True)


def partial_file(cache: Path, key: str, index: int) -> Path:
    """Where process ``index`` appends its finished batches (each process its own file: no two append to one)."""
    return cache / (f"{key}.partial.jsonl" if index == 0 else f"{key}.partial.{index}.jsonl")


def _partial_files(cache: Path, key: str) -> list[Path]:
    return sorted(cache.glob(f"{key}.partial*.jsonl"))


def kept_answers(cache: Path, key: str, ids: list[list[int]], index: int) -> dict[int, list[int]]:
    """The answers (by prompt index) of the batches interrupted runs appended to the partial files, whichever process
    wrote them; process ``index``'s own file is rewritten to hold only those (a line cut short by a kill, and
    anything after it, is dropped), so its batches of this run append after whole lines. Creates the cache
    directory; one that cannot be written (read-only) is refused in one line before anything is generated: it
    stopped the run with a bare "[Errno 30] Read-only file system", or after the first batch. A cache holding the
    whole entry is read without writing, and never comes here."""
    why = why_uncreatable(cache)
    if why is not None:
        raise InputError(f"cannot write the cache {cache} ({why}), which holds no entry for this run's settings yet: "
                         "set SPECDEC_CACHE_DIR to a writable folder (or make this one writable)")
    cache.mkdir(parents=True, exist_ok=True)
    held: dict[int, list[int]] = {}
    own = partial_file(cache, key, index)
    for partial in _partial_files(cache, key):
        try:
            lines = partial.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:  # removed since: a run that completed the cache meanwhile
            continue
        kept = []
        for line in lines:
            try:
                record = json.loads(line)
                start, seqs = record["start"], record["sequences"]
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            # each sequence must continue its own prompt (the key already fixes the model, prompts and settings)
            if not isinstance(start, int) or start < 0 or not seqs or start + len(seqs) > len(ids) or not _continue(
                    seqs, ids[start : start + len(seqs)]):
                break
            held.update(enumerate(seqs, start))
            kept.append(line + "\n")
        if partial == own:
            write_text(partial, "".join(kept))
    return held


def _how(graphed, batch_size: int) -> str:
    if not graphed:
        return f"eagerly, batch {batch_size}"
    # off a GPU the buckets run uncaptured (the tests' path): say so, a log line must not claim graphs that never ran
    return f"through CUDA graphs, batch {batch_size}" if graphed.config.capture else \
        f"through uncaptured graph buckets, batch {batch_size}"
