"""Self-distillation: the target model answers prompts itself (specdec's batched ``generate()``).

The heads then learn the target's own distribution. Results are cached on disk, keyed by the
model, the prompts and the generation settings, so a second run does not regenerate. Each finished
batch is appended to ``<key>.partial.jsonl`` first, so a run interrupted part-way (Ctrl-C, SIGTERM, a
crash) continues from its last finished batch when run again with the same settings. On a GPU the
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
from pathlib import Path

from specdec.atomic_write import replaced_atomically, write_json
from specdec.models.embedded import cache_root
from specdec.models.fingerprint import model_fingerprint

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return cache_root() / "distill"  # $SPECDEC_CACHE_DIR, else ~/.cache/specdec


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  return_dict=False))
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def use_graphs(loaded, cuda_graphs: bool | None) -> bool:
    """Whether self-distillation decodes through CUDA-graph buckets (:func:`decoding_graphs`). ``cuda_graphs``:
    None (auto) = on a CUDA device with the Triton backend, the only place graphs are captured; True demands the
    Triton backend (a one-line InputError without it; on CPU, in the Triton interpreter, the same padded buckets run
    uncaptured: how the tests check it); False = eager.

    On a GPU the embedded model's decode step is bound by its ~1,600 kernel launches (plain decoding ran 7.6-7.9x
    faster with graphs on an H200, batch 1), and self-distillation is the GPU recipes' main cost."""
    from specdec.errors import InputError

    runner = loaded.runner
    if cuda_graphs is None:
        return runner.device.type == "cuda" and runner.backend.triton
    if cuda_graphs and not runner.backend.triton:
        raise InputError(f"CUDA graphs need the Triton backend; the model on {runner.device} runs the "
                         f"{runner.backend.name} backend (SPECDEC_ATTENTION)")
    return bool(cuda_graphs)


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
                 cuda_graphs: bool | None = None) -> list[list[int]]:
    """``cuda_graphs``: see :func:`use_graphs` (None: on where they can be captured). Graphs change bf16 rounding at
    near-ties, so data made with them is cached under its own key."""
    from specdec.generate import generate

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
    if file.is_file():
        logger.info("self-distillation cache hit: %s", file)
        return json.loads(file.read_text())["sequences"]
    partial = cache / f"{key}.partial.jsonl"
    out = _finished_batches(partial, ids)
    if out:
        logger.info("self-distillation continues an interrupted run: %d of %d prompts were done (%s)", len(out),
                    len(ids), partial)
    graphed = decoding_graphs(loaded, [len(p) for p in ids], max_new_tokens, batch_size) if graphs else False
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), initial=len(out), unit="prompt", desc="self-distill")
    new_tokens, t0 = 0, time.perf_counter()  # graph capture counted: it is part of what the recipe pays
    try:
        for start in range(len(out), len(ids), batch_size):  # a sampled run's batches keep their starts: same seeds
            chunk = ids[start : start + batch_size]
            res = generate(loaded, chunk, max_new_tokens=max_new_tokens, do_sample=do_sample,
                           temperature=temperature, seed=seed + start if do_sample else None, return_dict=True,
                           cuda_graphs=graphed)
            done = [list(p) + list(n) for p, n in zip(chunk, res.new_tokens)]
            with open(partial, "a", encoding="utf-8") as f:  # kept before the next batch starts
                f.write(json.dumps({"start": start, "sequences": done}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            out.extend(done)
            new_tokens += sum(map(len, res.new_tokens))
            if bar is not None:
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM through the CLI: it names what is kept (train/cli.py)
        err.distilled = (len(out), len(ids))
        raise
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    write_json(file, {"sequences": out})
    partial.unlink(missing_ok=True)
    logger.info("self-distilled %d sequences (%d new tokens) in %.1f s, %.0f tokens/s, %s; cached in %s", len(out),
                new_tokens, seconds, new_tokens / max(seconds, 1e-9),
                _how(graphed, batch_size), file)
    return out


def _finished_batches(partial: Path, ids: list[list[int]]) -> list[list[int]]:
    """The sequences of the batches an interrupted run appended to ``partial``, in order from the first prompt; the
    file is rewritten to hold only those (a line cut short by a kill, and anything after it, is dropped), so the
    batches of this run append after whole lines. Creates the cache directory."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    if not partial.is_file():
        return []
    out: list[list[int]] = []
    kept = []
    for line in partial.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            start, seqs = record["start"], record["sequences"]
        except (json.JSONDecodeError, KeyError, TypeError):
            break
        # each sequence must continue its own prompt (the key already fixes the model, prompts and settings)
        if start != len(out) or not seqs or start + len(seqs) > len(ids) or any(
                s[: len(ids[start + i])] != list(ids[start + i]) for i, s in enumerate(seqs)):
            break
        out.extend(seqs)
        kept.append(line + "\n")
    with replaced_atomically(partial) as tmp:
        tmp.write_text("".join(kept), encoding="utf-8")
    return out


def _how(graphed, batch_size: int) -> str:
    if not graphed:
        return f"eagerly, batch {batch_size}"
    # off a GPU the buckets run uncaptured (the tests' path): say so, a log line must not claim graphs that never ran
    return f"through CUDA graphs, batch {batch_size}" if graphed.config.capture else \
        f"through uncaptured graph buckets, batch {batch_size}"
