"""Prompts the target writes itself: sample its chat template's user turn (the Magpie recipe).

An instruction-tuned model given only the template up to the user's message writes a user message of the
kind it was tuned on: varied requests in its own domain, which no built-in template list can match. The
drafter then learns answers to the questions the target expects, not to a handful of templates.

    prompts = self_written_prompts(loaded, 1000, seed=0)   # list[str], cached on disk per model and settings

Each prompt is a complete user turn (the target ended it with its end-of-turn token), unique, at least
``MIN_WORDS`` words, and kept apart from the held-out evaluation prompts (:func:`too_close`), so a measured
tau is never on a question the drafter was trained on.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from specdec.train.data import TrainDataError
from specdec.train.process_team import Team

from specdec.atomic_write import write_json
from specdec.models.embedded import cache_root

logger = logging.getLogger(__name__)

MIN_WORDS = 3
MAX_TOKENS = 64  # a user turn longer than this is cut off and dropped
TEMPERATURE, TOP_P = 1.0, 0.95
_SENTINEL = "\u2063SPECDEC_USER\u2063"


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the user's message starts (with its default system turn)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise TrainDataError("prompts written by the target need a chat template (an instruction-tuned model); "
                             "this tokenizer has none: pass --prompts-file or --data instead")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text[: text.index(_SENTINEL)], add_special_tokens=False)["input_ids"])


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def too_close(prompt: str, held_out: list[set[str]], share: float = 0.6) -> bool:
    """True when ``prompt`` holds ``share`` or more of some held-out prompt's words."""
    words = _words(prompt)
    return any(len(words & h) >= share * len(h) for h in held_out if h)


def held_out_words() -> list[set[str]]:
    """Word sets of every evaluation prompt written for this project (chat, qa, math, translation)."""
    from specdec.eval.prompt_sets import MATH, QA, TRANSLATION
    from specdec.eval.prompts import CHAT

    return [_words(p) for p in (*CHAT, *QA, *MATH, *TRANSLATION)]


def _end_of_turn(loaded) -> set[int]:
    """The model's end-of-sequence ids and the tokenizer's: a user turn is whole when one of them ends it."""
    eos = loaded.model.config.eos_token_id
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) | {getattr(loaded.tokenizer, "eos_token_id", None)}
    ids.discard(None)
    if not ids:
        raise TrainDataError("prompts written by the target need an end-of-turn token; neither the model's config "
                             "nor the tokenizer names one")
    return ids


def _cache_file(loaded, n: int, seed: int, batch_size: int, cache_dir, graphs: bool) -> Path:
    from specdec.models.fingerprint import model_fingerprint

    key = {"model": model_fingerprint(loaded.model), "n": n, "seed": seed, "batch_size": batch_size,
           "temperature": TEMPERATURE, "top_p": TOP_P, "max_tokens": MAX_TOKENS, "min_words": MIN_WORDS,
           "held_out": hashlib.sha256(repr(held_out_words()).encode()).hexdigest()[:8]}
    if graphs:  # CUDA graphs round bf16 otherwise at near-ties: their prompts are cached apart
        key["cuda_graphs"] = True
    key = json.dumps(key)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "self_prompts"
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def self_written_prompts(loaded, n: int, *, seed: int = 0, batch_size: int = 64, cache_dir=None,
                         progress: bool = True, cuda_graphs: bool | None = None, team: Team | None = None) -> list[str]:
    """``n`` user prompts sampled from the target (module doc); at most ``4 n`` are drawn to find them.
    ``cuda_graphs``: as in :func:`specdec.train.distill.use_graphs` (None: where they are captured). ``team``:
    the processes of a run writing them together (train/process_team.py), each every ``team.size``-th batch of
    draws, exchanged round by round; the batches are read in order, so every process returns the prompts of a run
    of one process (a batch's seed is its first draw's number, whoever draws it)."""
    from specdec.train.distill import decoding_graphs, one_row_policy, read_cache_entry, use_graphs

    from specdec.generate import generate

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    team = team or Team.alone()
    graphs = use_graphs(loaded, cuda_graphs)
    file = _cache_file(loaded, n, seed, batch_size, cache_dir, graphs)
    cached = read_cache_entry(file, "prompts", lambda ps: 0 < len(ps) <= n and all(isinstance(p, str) for p in ps))
    if all(team.exchange(cached is not None)):
        logger.info("self-written prompts: cache hit %s", file)
        return cached
    one_row_policy(loaded, team)
    tok = loaded.tokenizer
    prefix, held_out = user_turn_prefix(tok), held_out_words()
    graphed = decoding_graphs(loaded, [len(prefix)] * batch_size, MAX_TOKENS, batch_size) if graphs else False
    end = _end_of_turn(loaded)
    prompts: list[str] = []
    seen: set[str] = set()
    drawn = dropped_close = 0
    bar = None
    if progress and team.index == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, unit="prompt", desc="prompts by the target", disable=None)
    for mine, firsts in team.rounds(range(0, 4 * n, batch_size)):  # the first draw of each batch, 4 n draws at most
        made = None
        if mine is not None:
            res = generate(loaded, [prefix] * batch_size, max_new_tokens=MAX_TOKENS, do_sample=True,
                           temperature=TEMPERATURE, top_k=0, top_p=TOP_P, seed=seed * 1_000_003 + mine,
                           return_dict=True, cuda_graphs=graphed)
            made = [list(new) for new in res.new_tokens]
        # in the order one process draws them; a last round of fewer pieces than processes pairs the pieces only
        for first, batch in zip(firsts, team.exchange(made), strict=False):
            if len(prompts) >= n:
                break
            drawn = first + batch_size
            for new in batch:
                if not new or new[-1] not in end:  # cut off at MAX_TOKENS: not a whole user turn
                    continue
                text = tok.decode(new[:-1], skip_special_tokens=True).strip()
                if len(text.split()) < MIN_WORDS or text in seen:
                    continue
                if too_close(text, held_out):
                    dropped_close += 1
                    continue
                seen.add(text)
                prompts.append(text)
                if bar is not None and len(prompts) <= n:
                    bar.update(1)
        if len(prompts) >= n:
            break
    if bar is not None:
        bar.close()
    if not prompts:
        raise TrainDataError(f"the target wrote no usable user prompt in {drawn} tries (none ended its turn "
                             f"within {MAX_TOKENS} tokens): pass --prompts-file or --data instead")
    if len(prompts) < n:
        logger.warning("the target wrote %d usable prompts of %d asked in %d tries; training on those",
                       len(prompts), n, drawn)
    prompts = prompts[:n]
    logger.info("self-written prompts: %d kept of %d drawn (%d too close to held-out evaluation prompts)",
                len(prompts), drawn, dropped_close)
    write_json(file, {"prompts": prompts})
    return prompts
