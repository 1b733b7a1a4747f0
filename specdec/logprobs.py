"""Per-token log-probabilities of the committed tokens (``generate(..., output_logprobs=True, return_dict=True)``).

Each new token's log-probability is read from the target's logits at the verify row that chose it, after the
logits processors (:mod:`specdec.logits_processing`) and the sampling transform:

* sampling (standard or coupled): ``log_softmax(sampling_logits(processed))`` at the token, where
  :func:`~specdec.sampling.sampling_logits` divides by the temperature and puts ``-inf`` where the sampling
  warpers (top-k, top-p, ...) remove the token: the log of the probability the token was drawn with;
* greedy: ``log_softmax(processed)`` at the token (no temperature, no warpers), i.e. the log-softmax of
  the scores transformers returns with ``output_scores=True`` when it decodes greedily.

The row that chose a committed token is the same with or without a drafter (the root's row for the first token
of a step, then the row of the accepted node before it), so the values are the same, up to float rounding of
the target's forward, whatever the drafter proposed. Computed in float64, only when asked for.

    rows, tokens = committed_rows(acceptance, emitted)         # per sequence
    values = token_logprobs(logits[b_idx, rows], tokens, sampling)
"""
from __future__ import annotations

import torch

from specdec.host_copy import to_device
from specdec.rejection import Acceptance
from specdec.sampling import SamplingConfig, sampling_logits


def committed_rows(acceptance: Acceptance, count: int) -> list[int]:
    """The verify rows (0 = root, 1 + i = node i) whose logits chose the first ``count`` committed tokens
    (``accepted_tokens + [next_token]``, cut at a stop)."""
    return ([0] + [1 + i for i in acceptance.accepted_nodes])[:count]


def token_logprobs(logits: torch.Tensor, tokens: list[int], sampling: SamplingConfig) -> list[float]:
    """logits [k, V] (processed), tokens [k] -> the k log-probabilities (module docstring), as floats."""
    x = logits.to(torch.float64)
    if not sampling.greedy:
        x = sampling_logits(x, sampling)
    index = to_device(tokens, torch.long, x.device)[:, None]
    return x.log_softmax(-1).gather(1, index)[:, 0].tolist()
