"""The "draft-model" drafter: a smaller model of the same vocabulary proposes the tree.

    generate("default", ids, drafter="draft-model", drafter_options={"model": "./small-llama"})
    generate(target, ids, drafter=DraftModelDrafter(small_hf_model, num_draft_tokens=5))

``model`` is anything :func:`specdec.models.loader.load_model` accepts (a transformers model,
a checkpoint directory, a GGUF file, an alias). Its vocabulary must be the target's: same
size and, when both tokenizers are known, the same token for every id checked. Sizes may differ
only by padding (Qwen2.5-0.5B's 151,936 ids beside Qwen2.5-7B's 152,064): both tokenizers known,
the same, and every token of theirs an id of both models (:func:`padded_alike`); the drafter then
drafts among the ids both have (ModelDrafter._target_columns).
Tree shape and sampling mode: see :class:`specdec.drafters.model_drafter.DraftConfig`.
"""
from __future__ import annotations

import logging
import os
import textwrap
import weakref
from pathlib import Path
from typing import Any

from specdec.drafters.base import refusals_named
from specdec.drafters.model_drafter import DraftConfig, ModelDrafter

from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.kv_cache import PagedKVCache
from specdec.models import embedded
from specdec.models.llama import LlamaRunner
from specdec.models.loader import NO_TOKENIZER_FILES, gguf_file, holds_tokenizer_files, load_model

logger = logging.getLogger(__name__)


# draft tokenizer -> the target tokenizers found to map every checked id alike (4,000 lookups, ~5 ms, per call)
_MATCHED: "weakref.WeakKeyDictionary[Any, weakref.WeakSet]" = weakref.WeakKeyDictionary()
_PARAMS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # module -> its parameter count
# (draft model, warning) -> the target models it was given about: each pair's warning once, not at every call
_WARNED: "weakref.WeakKeyDictionary[Any, dict[str, weakref.WeakSet]]" = weakref.WeakKeyDictionary()


def _warn_once(draft_runner: LlamaRunner, target_runner: LlamaRunner, message: str, *args: Any) -> None:
    """logger.warning(message, *args) the first time this draft model meets this target with it."""
    try:
        seen = _WARNED.setdefault(draft_runner.hf_model, {}).setdefault(message, weakref.WeakSet())
        if target_runner.hf_model in seen:
            return
        seen.add(target_runner.hf_model)
    except TypeError:  # a module that cannot be weakly referenced: warned every time
        pass
    logger.warning(message, *args)


class VocabularyMismatchError(SpecdecError, ValueError):
    """The draft model's token ids do not mean what the target's mean."""


def padded_alike(dv: int, tv: int, *tokenizers: Any) -> bool:
    """Whether vocabularies of ``dv`` and ``tv`` ids can be the given tokenizers' padded to two sizes: every
    tokenizer is known, all have as many tokens, and each of them is an id of both models."""
    return all(t is not None for t in tokenizers) and len({len(t) for t in tokenizers}) == 1 and \
        len(tokenizers[0]) <= min(dv, tv)


def check_gguf_vocabulary(path: Path, target_runner: LlamaRunner, target_tok: Any = None) -> None:
    """Refuse a draft model's GGUF file of another vocabulary size than the target's, read from its header before
    any conversion work (:func:`specdec.models.embedded.vocab_size`), unless the difference may be padding past the
    target tokenizer's tokens (then :func:`check_vocabularies` compares the converted model's tokenizer)."""
    dv, tv = embedded.vocab_size(path), target_runner.shape.vocab_size
    if dv is not None and dv != tv and not padded_alike(dv, tv, target_tok):
        raise VocabularyMismatchError(f"draft-model: the draft model {path} has a vocabulary of {dv} ids, the "
                                      f"target's {tv}; the two models need the same tokenizer")


def check_vocabularies(draft_runner: LlamaRunner, draft_tok: Any, target_runner: LlamaRunner, target_tok: Any,
                       samples: int = 2000) -> None:
    dv, tv = draft_runner.shape.vocab_size, target_runner.shape.vocab_size
    if dv != tv and not padded_alike(dv, tv, draft_tok, target_tok):
        if draft_tok is None or target_tok is None:
            missing = ("neither tokenizer is known" if draft_tok is None and target_tok is None
                       else f"the {'draft model' if draft_tok is None else 'target'}'s tokenizer is unknown")
            raise VocabularyMismatchError(
                f"draft-model: the draft model's vocabulary has {dv} ids, the target's {tv}, and {missing}: sizes "
                "may differ only by padding past one tokenizer's tokens, checked with both tokenizers (tokenizer= "
                "for the draft model, generate()'s tokenizer= for the target)")
        sizes = sorted({len(draft_tok), len(target_tok)})
        raise VocabularyMismatchError(
            f"draft-model: the draft model's vocabulary has {dv} ids, the target's {tv}, and their tokenizers "
            f"{'have ' + ' and '.join(map(str, sizes)) if len(sizes) > 1 else 'both have ' + str(sizes[0])} tokens: "
            "the two models need the same tokenizer")
    if dv != tv:
        logger.info("draft-model: the draft model's vocabulary has %d ids, the target's %d, one tokenizer's %d "
                    "tokens padded: it drafts among the first %d", dv, tv, len(target_tok), min(dv, tv))
    if draft_tok is None or target_tok is None:
        _warn_once(draft_runner, target_runner, "draft-model: a tokenizer is missing, so only the vocabulary sizes "
                   "were compared")
        return
    try:
        if target_tok in _MATCHED.get(draft_tok, ()):  # checked by an earlier generate() call
            return
    except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: checked every time
        pass
    n = min(dv, tv)
    for i in range(0, n, max(1, n // samples)):
        a, b = draft_tok.convert_ids_to_tokens(i), target_tok.convert_ids_to_tokens(i)
        if a != b:
            raise VocabularyMismatchError(
                f"draft-model: token id {i} is {a!r} for the draft model but {b!r} for the target; "
                "the two models need the same tokenizer"
            )
    try:
        _MATCHED.setdefault(draft_tok, weakref.WeakSet()).add(target_tok)
    except TypeError:
        pass


def _tokenizer(spec: Any) -> Any:
    """The tokenizer= option: a tokenizer as given; a directory (what the command line can pass) loaded from it."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    from transformers import AutoTokenizer

    path = Path(spec).expanduser()
    if not path.is_dir():
        raise InputError(f"draft-model: tokenizer={str(spec)!r} is not a directory (pass a tokenizer's directory or a "
                         "transformers tokenizer)")
    if not holds_tokenizer_files(path):
        raise InputError(f"draft-model: tokenizer={str(spec)!r} {NO_TOKENIZER_FILES}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise InputError(f"draft-model: tokenizer={str(spec)!r} holds no tokenizer transformers can load "
                         f"({textwrap.shorten(str(err), 200, placeholder=' ...')})") from err


def num_params(module: Any) -> int:
    """Parameters of a torch module, counted once per module object (each generate() call builds its drafter and
    asks again; walking a model's parameters costs milliseconds)."""
    if module not in _PARAMS:
        _PARAMS[module] = sum(p.numel() for p in module.parameters())
    return _PARAMS[module]


def _bigger(draft: LlamaRunner, target: LlamaRunner) -> tuple[str, str] | None:
    """(draft, target) parameter counts as a message says them when the draft model has more, else None: in millions,
    or whole where the two round alike (a draft model "0.1M" bigger than a target of "0.1M" says nothing)."""
    mine, theirs = num_params(draft.hf_model), num_params(target.hf_model)
    if mine <= theirs:
        return None
    said = f"{mine / 1e6:.1f}M", f"{theirs / 1e6:.1f}M"
    return said if said[0] != said[1] else (f"{mine:,}", f"{theirs:,}")


def forward_work(runner: LlamaRunner) -> tuple[int, int, int]:
    """What one token's forward through ``runner`` multiplies and reads, as sizes its cost grows with: the weights
    of its layers and LM head (the embedding is a lookup), and the widths of the keys it reads and of the queries
    it attends with, over all its layers."""
    s = runner.shape
    weights = num_params(runner.layers) + runner.lm_head.numel()
    return weights, s.num_layers * s.num_kv_heads * s.head_dim, s.num_layers * s.num_heads * s.head_dim


class DraftModelDrafter(ModelDrafter):
    options_config = DraftConfig  # what **options configure (drafters.registry.option_names)
    name = "draft-model"

    def __init__(self, model: Any = None, tokenizer: Any = None, **options: Any) -> None:
        if model is None:  # before anything loads: a silent default model only fits targets of its own vocabulary
            raise InputError("draft-model needs model=: a smaller model with the target's vocabulary (a transformers "
                             "model, checkpoint directory, .gguf file or alias), e.g. "
                             "drafter_options={'model': './small-llama'}, on the command line "
                             "--drafter-option model=./small-llama")
        if isinstance(model, (bool, int, float, list, tuple, dict)):  # e.g. a JSON value where a path was meant
            raise InputTypeError(f"draft-model: model= must be a transformers model, a checkpoint path or an alias, "
                                 f"got {type(model).__name__} {model!r}")
        if isinstance(model, str) and not model:  # Path("") is the current directory
            raise InputError("draft-model: model= is the empty string; give a checkpoint directory, .gguf file or "
                             "alias")
        if isinstance(tokenizer, str) and not tokenizer:
            raise InputError("draft-model: tokenizer= is the empty string; give a tokenizer or the directory of one")
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)) and \
                not hasattr(tokenizer, "convert_ids_to_tokens"):
            raise InputTypeError(f"draft-model: tokenizer= must be a transformers tokenizer or the directory of one, "
                                 f"got {type(tokenizer).__name__} {tokenizer!r}")
        with refusals_named(self.name):
            super().__init__(DraftConfig(**options))
        self.model_spec, self.tokenizer = model, tokenizer

    def cost_key(self) -> str:  # the draft model: its path, else its class and size
        spec = self.model_spec
        if isinstance(spec, (str, os.PathLike)):
            return f"{super().cost_key()}|{spec}"
        module = getattr(spec, "model", spec)
        params = num_params(module) if hasattr(module, "parameters") else None
        return f"{super().cost_key()}|{type(module).__qualname__}:{params}"

    def never_pays_by_shape(self) -> str | None:
        """Its model is the target, or does at least the target's work per token (:func:`forward_work`, every
        size) run as the target runs (device, dtype, backend, the bit-exact mode, replayed graphs)."""
        draft, target = self.runner, self.target.runner
        if draft is None or (draft.invariant, draft.device, draft.dtype, draft.backend.name) != (
                target.invariant, target.device, target.dtype, target.backend.name):
            return None
        if self.use_graphs and draft.device.type == "cuda" and not self.target.graphs:
            return None  # replayed graphs may be cheaper than the target's eager verify
        if draft.hf_model is target.hf_model:
            return "its model is the target itself"
        mine, theirs = forward_work(draft), forward_work(target)
        if any(a < b for a, b in zip(mine, theirs, strict=True)):
            return None
        if (sizes := _bigger(draft, target)) is not None:  # said in the policy's warning (never asked: no own one)
            return (f"the draft model ({sizes[0]} parameters) is bigger than the target ({sizes[1]}): it "
                    "does at least the target's work per token on the same device and dtype")
        return (f"its model does at least the target's work per token ({mine[0] / 1e6:.1f}M weights, the "
                f"target {theirs[0] / 1e6:.1f}M) on the same device and dtype")

    def make_runner(self, target: LlamaRunner, tokenizer: Any) -> LlamaRunner:
        # one named by a path loads in the target's dtype; a loaded model keeps its own (load_model refuses a dtype
        # asked of a loaded model)
        named = isinstance(self.model_spec, (str, os.PathLike))
        dtype = target.dtype if named else None
        if named and (gguf := gguf_file(self.model_spec)) is not None:
            check_gguf_vocabulary(gguf, target, tokenizer)  # before its conversion: seconds to minutes, a cache folder
        loaded = load_model(self.model_spec, tokenizer=_tokenizer(self.tokenizer), dtype=dtype, device=target.device)
        runner = loaded.runner
        check_vocabularies(runner, loaded.tokenizer, target, tokenizer)
        if runner.dtype != target.dtype:
            logger.info("draft-model: draft model runs in %s, target in %s", runner.dtype, target.dtype)
        return runner

    def _own_cache(self) -> PagedKVCache:
        """At the call's first draft (ModelDrafter makes its cache then): a draft model bigger than the target is
        warned about when it drafts (once per pair of models), not when it loads: one the policy never asks
        (never_pays_by_shape) never gets here, and is in the policy's one warning instead."""
        if (sizes := _bigger(self.runner, self.target.runner)) is not None:
            _warn_once(self.runner, self.target.runner, "draft-model: the draft model (%s parameters) is bigger "
                       "than the target (%s); drafting will likely cost more than it saves (use a smaller draft "
                       "model)", *sizes)
        return super()._own_cache()
