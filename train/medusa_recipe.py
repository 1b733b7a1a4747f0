"""What the shared training loop trains for ``train-medusa``: the Medusa heads, one weighted loss per head.

    heads, history = train_heads(cfg, model, train_seqs, accelerator, resume_from, draft_vocab=ids)

The heads' own LM heads start as copies of the target's (its rows of a reduced draft vocabulary); head ``i``
learns the target's own token ``i + 1`` ahead (train/medusa_loss.py), its loss weighted by ``head_decay ** i``.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads
from specdec.train.config import TrainConfig
from specdec.train.loop import train_drafter
from specdec.train.medusa_loss import head_loss, head_loss_count

logger = logging.getLogger(__name__)


class MedusaRecipe:
    """What the shared loop trains for ``train-medusa``: the heads, one weighted loss per head."""

    name = "train-medusa"

    def __init__(self, cfg: TrainConfig, model, device, model_name: str = "", draft_vocab: tuple[int, ...] = ()):
        shape_cfg = model.config
        extra = {"draft_vocab": tuple(draft_vocab)} if draft_vocab else {}
        self.lm_w = model.get_output_embeddings().weight.detach()
        config = MedusaConfig(cfg.num_heads, cfg.num_layers, shape_cfg.hidden_size, shape_cfg.vocab_size,
                              cfg.shared_lm_head, model_name, **extra)
        self.module = MedusaHeads.from_lm_head(config, self.lm_w, device)  # built on the device, no random draws
        self.cfg, self.depths = cfg, cfg.num_heads
        self.weights = [cfg.head_decay**i for i in range(cfg.num_heads)]

    def loss_counts(self, labels, mask) -> list[int]:
        """The positions each head's loss averages over in this micro-batch."""
        return [head_loss_count(self.module, i, labels, mask, self.cfg.loss) for i in range(self.cfg.num_heads)]

    def accumulate(self, ids, hidden, labels, mask, over: list[int], autocast) -> tuple[torch.Tensor, list, list]:
        """Backward of this micro-batch's share of the step's loss (head i's summed loss / ``over[i]``, the step's
        count of :meth:`loss_counts`); returns (that share, correct per depth, count per depth)."""
        total, correct, count = hidden.new_zeros(()), [], []
        for i in range(self.cfg.num_heads):  # one graph per head: peak memory is one head's logits
            with autocast():
                loss, c, n = head_loss(self.module, i, hidden, labels, mask, self.lm_w, self.cfg.loss, over[i])
            (self.weights[i] * loss).backward()
            total = total + self.weights[i] * loss.detach()
            correct.append(c), count.append(n)
        return total, correct, count


def train_heads(cfg: TrainConfig, model, train_seqs: list[list[int]], accelerator, resume_from: Path | None,
                model_name: str = "", draft_vocab: tuple[int, ...] = ()) -> tuple[MedusaHeads, list[dict]]:
    """Train Medusa heads; returns (heads, history)."""
    torch.manual_seed(cfg.seed)
    if cfg.num_layers > 1 and accelerator.is_main_process:
        logger.warning("--num-layers %d: the heads' residual blocks are trained independently; FasterDecoding's Medusa "
                       "cannot load them (it repeats one block, so every block would get the head's last one); "
                       "specdec reads them, and `specdec export-head --format vllm` keeps them for vLLM",
                       cfg.num_layers)
    recipe = MedusaRecipe(cfg, model, accelerator.device, model_name, draft_vocab)
    return recipe.module, train_drafter(cfg, recipe, model, train_seqs, accelerator, resume_from)
