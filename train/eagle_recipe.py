"""What the shared training loop trains for ``train-eagle``: one EAGLE draft layer and its unrolled loss.

    recipe = EagleRecipe(cfg, model, device, draft_vocab=ids)
    history = train_drafter(cfg, recipe, model, train_seqs, accelerator, resume_from)
    save_eagle(recipe.module, out)

The layer starts from the target's last decoder layer (its LM-head rows for a reduced
vocabulary) and learns, at ``cfg.eagle_steps`` draft depths, the target's own next token and
next feature (train/eagle_loss.py). ``cfg.eagle_arch == "eagle3"`` trains an EAGLE-3 layer over the
target's low / middle / high layers' features (token loss only; its own LM head even over the full
vocabulary, which serving engines need).
"""
from __future__ import annotations

import torch
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.train.config import TrainConfig
from specdec.train.eagle_loss import eagle_loss, eagle_loss_counts


class EagleRecipe:
    name = "train-eagle"

    def __init__(self, cfg: TrainConfig, model, device, model_name: str = "", draft_vocab: tuple[int, ...] = ()):
        eagle3 = dict(arch="eagle3", own_lm_head=not draft_vocab) if cfg.eagle_arch == "eagle3" else {}
        config = EagleConfig.for_target(model.config, draft_vocab=tuple(draft_vocab),
                                        base_model_name_or_path=model_name, **eagle3)
        torch.manual_seed(cfg.seed)
        self.module = EagleModel(config)
        self.module.init_from_target(model)
        self.module.to(device)
        self.embed_w = model.get_input_embeddings().weight.detach()
        self.lm_w = model.get_output_embeddings().weight.detach()
        self.cfg, self.depths = cfg, cfg.eagle_steps
        self.feature_layers = config.feature_layers  # EAGLE-3: what the feature cache holds instead of final states

    def loss_counts(self, labels, mask) -> list[int]:
        """The positions each term of the unrolled loss averages over in this micro-batch."""
        return eagle_loss_counts(self.module, labels, mask, self.lm_w.shape[0], self.cfg.eagle_steps)

    def accumulate(self, ids, hidden, labels, mask, over: list[int], autocast) -> tuple[torch.Tensor, list, list]:
        """Backward of this micro-batch's share of the step's loss (``over``: the step's :meth:`loss_counts`)."""
        with autocast():
            loss, correct, count = eagle_loss(self.module, ids, hidden, labels, mask, self.embed_w, self.lm_w,
                                              steps=self.cfg.eagle_steps, reg_weight=self.cfg.reg_weight,
                                              step_decay=self.cfg.head_decay, over=over)
        loss.backward()
        return loss.detach(), correct, count
