"""A model's fingerprint (specdec.models.fingerprint) tells apart models whose config or weights differ anywhere, and
is the same for the same model loaded from another path."""
from __future__ import annotations

import torch

from specdec.models.fingerprint import WEIGHT_SAMPLES, model_fingerprint
from specdec.testing import build_tiny_model


def test_a_change_to_the_last_embedding_row_alone_changes_the_fingerprint():
    """A fine-tune that trained only a token added at the end of the vocabulary: the row lies past the first
    WEIGHT_SAMPLES values of the embedding, which the strided samples still reach."""
    model = build_tiny_model(vocab_size=256)
    embed = model.get_input_embeddings().weight
    assert embed.numel() > 2 * WEIGHT_SAMPLES  # 256 x 64 = 16384 values: a stride of 4
    before = model_fingerprint(model)
    with torch.no_grad():
        embed[-1] += 1.0
    assert model_fingerprint(model) != before


def test_the_same_weights_under_another_config_fingerprint_differently_and_another_path_alike():
    model = build_tiny_model()
    before = model_fingerprint(model)
    model.config._name_or_path = "/elsewhere/tiny"  # where it was loaded from: not what it computes
    assert model_fingerprint(model) == before
    model.config.rms_norm_eps = 1e-3  # another model: its norms compute other logits
    assert model_fingerprint(model) != before
