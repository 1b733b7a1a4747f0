"""Where a drafter without training data gets its reduced draft vocabulary (the self-draft drafter's option).

A trained draft head's vocabulary comes from its training data (``frequent_tokens`` over the
self-distilled sequences, stored in the checkpoint). A drafter attached to a bare target has no
such data, so ``draft_vocab`` may be:

* a list of token ids: used as given;
* a path: a checkpoint directory whose ``config.json`` holds ``draft_vocab`` (a Medusa checkpoint trained
  on this target: the best choice, its ids came from the target's own text), or whose weights hold an EAGLE
  head's ``d2t`` map (id = index + d2t[index]), or a JSON file holding a list of ids (or an object with a
  ``draft_vocab`` list);
* an integer N: the N most frequent tokens of specdec's built-in training prompts
  (``specdec.train.prompts``) as the target's tokenizer splits them, plus the end-of-sequence
  ids; if the prompts hold fewer than N distinct tokens, the smallest remaining ids fill up
  (byte tokens and the earliest, most frequent merges of a BPE vocabulary). This is a proxy:
  prompts are requests, not the answers the target writes, so coverage of its output is lower
  than a trained checkpoint's list; greedy output stays identical either way.

    ids = resolve_draft_vocab(4096, tokenizer, vocab_size=49152)
    ids = resolve_draft_vocab("heads/", tokenizer, vocab_size=49152)
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

from specdec.drafters.draft_vocab import frequent_tokens

from specdec.errors import InputError

logger = logging.getLogger(__name__)

_PROMPT_COUNTS: dict[tuple, Counter] = {}  # (tokenizer name, vocabulary size) -> token counts of the prompts


def check_spec(spec) -> None:
    """Refuse an option value that is none of: a positive int, a non-empty list of distinct ids >= 0, a path."""
    if isinstance(spec, bool):
        raise InputError(f"draft_vocab must be a size, a list of token ids or a path, got {spec!r}")
    if isinstance(spec, int):
        if spec < 1:
            raise InputError(f"draft_vocab must be a positive number of tokens, got {spec}")
        return
    if isinstance(spec, (str, os.PathLike)):
        if not str(spec):  # Path("") is ".": the current directory's config.json would be read
            raise InputError("draft_vocab must be a size, a list of token ids or a path, got the empty string")
        return
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(t, int) and not isinstance(t, bool) for t in spec):
        if min(spec) < 0:  # refused here, before the target loads, as the ids past its vocabulary are once it has
            raise InputError(f"draft_vocab holds token id {min(spec)}; token ids are >= 0")
        if len(set(spec)) != len(spec):
            raise InputError(f"draft_vocab lists a token id more than once ({len(spec)} ids, {len(set(spec))} "
                             "distinct)")
        return
    raise InputError(f"draft_vocab must be a size, a non-empty list of integer token ids or a path, got {spec!r}")


def read_ids(path: str | os.PathLike, name: str = "draft") -> list[int]:
    """The ``draft_vocab`` list of a checkpoint directory's config.json, or of a JSON file (refusals name ``name``)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise InputError(f"{name}: draft_vocab: {file} does not exist (give a checkpoint directory or a JSON list of "
                         "ids)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"{name}: draft_vocab: {file} is not valid JSON: {err}") from err
    ids = raw.get("draft_vocab") if isinstance(raw, dict) else raw
    if ids is None and path.is_dir():
        ids = _d2t_ids(path)
    if not isinstance(ids, list) or not ids or any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
        raise InputError(f"{name}: draft_vocab: {file} holds no draft_vocab list of token ids (a full-vocabulary "
                         "checkpoint?)")
    return ids


def _d2t_ids(directory: Path) -> list[int] | None:
    """An EAGLE head's reduced vocabulary, which its weights keep as the ``d2t`` map (speculators' layout); None:
    there is none. Only that tensor is read."""
    from safetensors import SafetensorError, safe_open
    from specdec.drafters.eagle_checkpoint import WEIGHTS_FILE

    file = directory / WEIGHTS_FILE
    try:
        with safe_open(str(file), "pt") as weights:
            if "d2t" not in weights.keys():
                return None
            d2t = weights.get_tensor("d2t").long()
    except (SafetensorError, OSError):
        return None
    return [int(i) + int(t) for i, t in enumerate(d2t.tolist())]


def builtin_prompt_tokens(tokenizer, n: int) -> list[int]:
    """The N most frequent tokens of the built-in training prompts (see the module doc), sorted."""
    from specdec.train.prompts import builtin_prompts

    key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer))
    counts = _PROMPT_COUNTS.get(key)
    if counts is None:
        encoded = tokenizer(builtin_prompts(), add_special_tokens=False)["input_ids"]
        counts = _PROMPT_COUNTS[key] = Counter(t for seq in encoded for t in seq)
    vocab_size = len(tokenizer)
    always = [t for t in _eos_ids(tokenizer) if 0 <= t < vocab_size]
    ids = set(frequent_tokens([list(counts.elements())], n, always=always))
    fill = (t for t in range(vocab_size) if t not in ids)
    while len(ids) < min(n, vocab_size):
        ids.add(next(fill))
    return sorted(ids)


def _eos_ids(tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [] if eos is None else [int(t) for t in (eos if isinstance(eos, list) else [eos])]


def resolve_draft_vocab(spec, tokenizer, vocab_size: int, name: str = "draft") -> list[int]:
    """Token ids of the draft vocabulary ``spec`` (see the module doc) for a target of ``vocab_size`` tokens."""
    check_spec(spec)
    if isinstance(spec, int):
        if tokenizer is None:
            raise InputError(f"{name}: draft_vocab={spec} picks the most frequent tokens of the built-in prompts and "
                             "needs the target's tokenizer; pass a list of token ids or a checkpoint path instead")
        if len(tokenizer) > vocab_size:
            raise InputError(f"{name}: the tokenizer has {len(tokenizer)} tokens but the model {vocab_size}")
        ids = builtin_prompt_tokens(tokenizer, spec)
    elif isinstance(spec, (str, os.PathLike)):
        ids = read_ids(spec, name)
    else:
        ids = [int(t) for t in spec]
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InputError(f"{name}: draft_vocab holds token id {bad}, but the target's vocabulary has {vocab_size} "
                         "tokens")
    if len(set(ids)) != len(ids):
        raise InputError(f"{name}: draft_vocab lists a token id more than once ({len(ids)} ids, {len(set(ids))} "
                         "distinct)")
    logger.info("%s: reduced draft vocabulary of %d of %d tokens", name, len(ids), vocab_size)
    return ids
