"""The "self-draft" drafter: the target's own first N layers + its final norm and LM head.

No extra weights, so every model (the embedded default included) has a model-based
drafter. The truncated model shares the target's weights (``LlamaRunner.truncated``) and
its KV cache: the first N layers' K/V of every committed token are already in the
target's cache, so each step runs only the root and the draft nodes through N layers.

    generate("default", ids, drafter="self-draft", drafter_options={"num_layers": 8})

An untrained early exit predicts the full model's token poorly, so it pays only on a model trained for early
exit (LayerSkip-style); measurements on the embedded model: docs/drafters/self-draft.md. The drafter is exact
either way.

``draft_vocab`` projects the draft logits onto a reduced vocabulary (the LM head cut to those
rows): a size N (the most frequent tokens of the built-in prompts), a list of token ids, or a
checkpoint directory / JSON file holding a ``draft_vocab`` list (drafters/vocab_sources.py).
Drafts are then only those tokens and sampled draft_probs are zero elsewhere; output stays exact.

    generate("default", ids, drafter="self-draft", drafter_options={"num_layers": 4, "draft_vocab": "heads/"})
"""
from __future__ import annotations

from typing import Any

from specdec.drafters.base import refusals_named
from specdec.drafters.draft_vocab import DraftVocab
from specdec.drafters.model_drafter import DraftConfig, ModelDrafter
from specdec.drafters.vocab_sources import check_spec, resolve_draft_vocab

from specdec.errors import InputError
from specdec.generate_inputs import check_int
from specdec.models.llama import LlamaRunner

DEFAULT_LAYERS = 4
DEFAULT_DRAFT_TOKENS = 2


class SelfDraftDrafter(ModelDrafter):
    options_config = DraftConfig  # what **options configure (drafters.registry.option_names)
    name = "self-draft"
    shares_target_cache = True
    catches_up = False  # the first N layers' K/V of the prompt are the target's: a first call is a step

    def __init__(self, num_layers: int = DEFAULT_LAYERS, draft_vocab: Any = None, **options: Any) -> None:
        """``draft_vocab``: None (full vocabulary), a size, a list of token ids, or a path (see the module doc)."""
        options.setdefault("num_draft_tokens", DEFAULT_DRAFT_TOKENS)
        with refusals_named(self.name):
            super().__init__(DraftConfig(**options))
            check_int("num_layers", num_layers, minimum=1)  # True is no layer count
            if draft_vocab is not None:
                check_spec(draft_vocab)
        self.num_layers = num_layers
        self.draft_vocab_spec = draft_vocab

    def cost_key(self) -> str:
        vocab = self.draft_vocab_spec
        vocab = vocab if vocab is None or isinstance(vocab, (int, str)) else len(vocab)  # a list: its size
        return f"{super().cost_key()}|layers={self.num_layers}|vocab={vocab}"

    def make_runner(self, target: LlamaRunner, tokenizer: Any) -> LlamaRunner:
        total = target.shape.num_layers
        if total < 2:  # no N below it: "from 1 to 0" named no option
            raise InputError(f"self-draft: the target has {total} layer; self-draft drafts with its first num_layers "
                             "layers, so it needs a target of 2 or more (choose another drafter)")
        if self.num_layers >= total:
            choice = "num_layers=1" if total == 2 else f"a num_layers option from 1 to {total - 1}"  # not "1 to 1"
            typed = "--drafter-option num_layers=" + ("1" if total == 2 else "N")
            raise InputError(f"self-draft: num_layers={self.num_layers} must be below the target's {total} layers; "
                             f"give {choice} (on the command line {typed})")
        runner = target.truncated(self.num_layers)
        if self.draft_vocab_spec is not None:
            vocab_size = target.shape.vocab_size
            ids = resolve_draft_vocab(self.draft_vocab_spec, tokenizer, vocab_size, self.name)
            self.draft_vocab = DraftVocab(ids, vocab_size).to(runner.device)
            runner.lm_head = runner.lm_head[self.draft_vocab.ids]  # [N, hidden]: this runner's logits cover N tokens
        return runner
