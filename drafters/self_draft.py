"""The "self-draft" drafter: the target's own first N layers + its final norm and LM head.

No extra weights, so every model (the embedded default included) has a model-based
drafter. The truncated model shares the target's weights (``LlamaRunner.truncated``) and
its KV cache: the first N layers' K/V of every committed token are already in the
target's cache, so each step runs only the root and the draft nodes through N layers.

    generate("default", ids, drafter="self-draft", drafter_options={"num_layers": 8})

Defaults were picked by measurement on the embedded model (SmolLM2-135M, 30 layers, CPU,
``benchmarks/bench_drafters_cpu.py --sweep-self-draft``, chat prompts, greedy): an
untrained early exit predicts the full model's token poorly -- acceptance at depth 1 is
~5% with 4-12 layers, 9% with 18, 36% with 24 and still only 46% with 29 of 30 layers --
so no setting pays on this model: the cheapest (4 layers, 2 tokens) ran at 0.75x plain
decoding, every other setting slower. Self-drafting needs a model trained for early exit
(LayerSkip-style); the drafter is exact either way.
"""
from __future__ import annotations

from typing import Any

from specdec.drafters.base import TargetView
from specdec.drafters.model_drafter import DraftConfig, ModelDrafter

from specdec.models.llama import LlamaRunner

DEFAULT_LAYERS = 4
DEFAULT_DRAFT_TOKENS = 2


class SelfDraftDrafter(ModelDrafter):
    name = "self-draft"
    shares_target_cache = True

    def __init__(self, num_layers: int = DEFAULT_LAYERS, **options: Any) -> None:
        options.setdefault("num_draft_tokens", DEFAULT_DRAFT_TOKENS)
        super().__init__(DraftConfig(**options))
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"self-draft: num_layers must be a positive int, got {num_layers!r}")
        self.num_layers = num_layers

    def make_runner(self, target: TargetView) -> LlamaRunner:
        total = target.runner.shape.num_layers
        if self.num_layers >= total:
            raise ValueError(f"self-draft: num_layers={self.num_layers} must be below the target's {total} layers")
        return target.runner.truncated(self.num_layers)
