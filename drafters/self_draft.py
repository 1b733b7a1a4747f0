"""The "self-draft" drafter: the target's own first N layers + its final norm and LM head.

No extra weights, so every model (the embedded default included) has a model-based
drafter. The truncated model shares the target's weights (``LlamaRunner.truncated``) and
keeps its own small KV cache of N layers.

    generate("default", ids, drafter="self-draft", drafter_options={"num_layers": 8})

Defaults (``num_layers``, ``num_draft_tokens``) were picked by measurement on the embedded
model with ``benchmarks/bench_drafters_cpu.py --sweep-self-draft``.
"""
from __future__ import annotations

from typing import Any

from specdec.drafters.base import TargetView
from specdec.drafters.model_drafter import DraftConfig, ModelDrafter

from specdec.models.llama import LlamaRunner

DEFAULT_LAYERS = 8
DEFAULT_DRAFT_TOKENS = 3


class SelfDraftDrafter(ModelDrafter):
    name = "self-draft"

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
