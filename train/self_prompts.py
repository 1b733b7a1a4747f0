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
from specdec.train.distill import (
    cache_whole,
    decoding_graphs,
    keep_batch,
    kept_answers,
    one_row_policy,
    partial_file,
    read_cache_entry,
    remove_partials,
    use_graphs,
    what_is_left,
)
from specdec.train.process_team import Team

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
    of one process (a batch's seed is its first draw's number, whoever draws it). Each finished batch of draws is
    kept in the cache's partial files as self-distillation keeps its batches (train/distill.py), so a run
    interrupted part-way draws only the batches still missing when run again with the same settings."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    team = team or Team.alone()
    graphs = use_graphs(loaded, cuda_graphs)
    file = _cache_file(loaded, n, seed, batch_size, cache_dir, graphs)
    cache, key = file.parent, file.stem
    cached = read_cache_entry(file, "prompts", lambda ps: 0 < len(ps) <= n and all(isinstance(p, str) for p in ps))
    if all(team.exchange(cached is not None)):
        logger.info("self-written prompts: cache hit %s", file)
        remove_partials(cache, key, team.index)  # a run killed after writing the entry, before removing them
        return cached
    starts = range(0, 4 * n, batch_size)  # the first draw of each batch, 4 n draws at most
    draws = len(starts) * batch_size
    held = kept_answers(cache, key, [[]] * draws, team.index)  # each draw's new tokens, by its number
    whole = [s for s in starts if all(i in held for i in range(s, s + batch_size))]
    todo = what_is_left(held, [set(w) for w in team.exchange(whole)], draws, batch_size, team, cache,
                        "writing prompts", "draws")
    tok = loaded.tokenizer
    prefix = user_turn_prefix(tok)
    pick = _Pick(tok, n, _end_of_turn(loaded), progress and team.index == 0)
    pick.read(held, batch_size)
    try:
        _draw(loaded, prefix, pick, todo, held, partial_file(cache, key, team.index), seed, batch_size, graphs, team)
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM through the CLI: it names what is kept (train/cli.py)
        err.self_prompted = (len(pick.prompts), n)  # several processes: those of the batches exchanged so far
        raise
    finally:
        pick.close()
    prompts, drawn = pick.prompts, pick.drawn
    if not prompts:
        raise TrainDataError(f"the target wrote no usable user prompt in {drawn} tries (none ended its turn "
                             f"within {MAX_TOKENS} tokens): pass --prompts-file or --data instead")
    if len(prompts) < n:
        logger.warning("the target wrote %d usable prompts of %d asked in %d tries; training on those",
                       len(prompts), n, drawn)
    prompts = prompts[:n]
    logger.info("self-written prompts: %d kept of %d drawn (%d too close to held-out evaluation prompts)",
                len(prompts), drawn, pick.dropped_close)
    cache_whole(file, {"prompts": prompts}, cache, key, team)
    return prompts


class _Pick:
    """The prompts among the draws, read batch after batch in the order one process draws them: whole user turns
    (ended by one of ``end``) of at least MIN_WORDS words, each once, none too close to a held-out evaluation
    prompt; ``n`` of them, then done. ``drawn``: the draws read (the first draw of the next batch to read)."""

    def __init__(self, tok, n: int, end: set[int], progress: bool) -> None:
        self.tok, self.n, self.end, self.held_out = tok, n, end, held_out_words()
        self.prompts: list[str] = []
        self.seen: set[str] = set()
        self.drawn = self.dropped_close = 0
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=n, unit="prompt", desc="prompts by the target", disable=None)

    @property
    def done(self) -> bool:
        return len(self.prompts) >= self.n

    def read(self, held: dict[int, list[int]], batch_size: int) -> None:
        """Read the batches of ``held`` (each draw's new tokens, by its number) from the next one on, while they are
        whole and fewer than ``n`` prompts were found."""
        while not self.done and all(i in held for i in range(self.drawn, self.drawn + batch_size)):
            for new in (held[i] for i in range(self.drawn, self.drawn + batch_size)):
                self._take(new)
            self.drawn += batch_size

    def _take(self, new: list[int]) -> None:
        if self.done or not new or new[-1] not in self.end:  # cut off at MAX_TOKENS: not a whole user turn
            return
        text = self.tok.decode(new[:-1], skip_special_tokens=True).strip()
        if len(text.split()) < MIN_WORDS or text in self.seen:
            return
        if too_close(text, self.held_out):
            self.dropped_close += 1
            return
        self.seen.add(text)
        self.prompts.append(text)
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _draw(loaded, prefix: list[int], pick: _Pick, todo: list[int], held: dict[int, list[int]], own: Path, seed: int,
          batch_size: int, graphs: bool, team: Team) -> None:
    """Draw the batches starting at ``todo`` (``prefix``, the chat template up to the user's message, sampled)
    until ``pick`` is done: each process every ``team.size``-th, one per round, appended to its partial file
    ``own`` as it is finished; then the round's batches are exchanged into ``held`` and read in order."""
    from specdec.generate import generate

    if pick.done:
        return
    one_row_policy(loaded, team)
    graphed = decoding_graphs(loaded, [len(prefix)] * batch_size, MAX_TOKENS, batch_size) if graphs else False
    for mine, _ in team.rounds(todo):
        made = {}
        if mine is not None:
            res = generate(loaded, [prefix] * batch_size, max_new_tokens=MAX_TOKENS, do_sample=True,
                           temperature=TEMPERATURE, top_k=0, top_p=TOP_P, seed=seed * 1_000_003 + mine,
                           return_dict=True, cuda_graphs=graphed)
            keep_batch(own, mine, [list(new) for new in res.new_tokens], held)
            made[mine] = [held[i] for i in range(mine, mine + batch_size)]
        for theirs in team.exchange(made):
            for s, batch in theirs.items():
                held.update(enumerate(batch, s))
        pick.read(held, batch_size)  # in the order one process draws them, the draws of a later batch waiting
        if pick.done:
            return
