"""Self-distillation: the target model answers prompts itself (specdec's batched ``generate()``).

The heads then learn the target's own distribution. Results are cached on disk, keyed by the
model, the prompts and the generation settings, so a second run does not regenerate.

    seqs = self_distill(loaded, prompts, max_new_tokens=128, batch_size=16, cache_dir=...)
    # list[list[int]]: chat-templated prompt + the target's response, per prompt
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from specdec.atomic_write import write_json
from specdec.models.embedded import cache_root

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return cache_root() / "distill"  # $SPECDEC_CACHE_DIR, else ~/.cache/specdec


def model_fingerprint(model) -> str:
    """Config + a checksum of a few weights: changes when the model does, cheap to compute."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for _, p in list(model.named_parameters())[:3] + list(model.named_parameters())[-2:]:
            h.update(f"{p.double().sum().item():.10e}".encode())
    return h.hexdigest()[:16]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  return_dict=False))
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def self_distill(loaded, prompts: list[str] | list[list[int]], *, max_new_tokens: int, batch_size: int = 16,
                 do_sample: bool = False, temperature: float = 1.0, seed: int = 0,
                 cache_dir: str | os.PathLike | None = None, progress: bool = True) -> list[list[int]]:
    from specdec.generate import generate

    ids = [p if isinstance(p, list) else encode_prompt(loaded.tokenizer, p) for p in prompts]
    key_src = json.dumps({"model": model_fingerprint(loaded.model), "prompts": ids, "max_new_tokens": max_new_tokens,
                          "do_sample": do_sample, "temperature": temperature if do_sample else None,
                          "seed": seed if do_sample else None, "batch_size": batch_size if do_sample else None})
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    file = cache / f"{key}.json"
    if file.is_file():
        logger.info("self-distillation cache hit: %s", file)
        return json.loads(file.read_text())["sequences"]
    out: list[list[int]] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), unit="prompt", desc="self-distill")
    for start in range(0, len(ids), batch_size):
        chunk = ids[start : start + batch_size]
        res = generate(loaded, chunk, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                       seed=seed + start if do_sample else None, return_dict=True)
        out.extend(list(p) + list(n) for p, n in zip(chunk, res.new_tokens))
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    write_json(file, {"sequences": out})
    logger.info("self-distilled %d sequences, cached in %s", len(out), file)
    return out
