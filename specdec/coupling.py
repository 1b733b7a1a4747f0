"""Seed-coupled sampling: randomness tied to (seed, sequence, position), never to steps, batches or drafters.

Every token is drawn by the Gumbel-max rule::

    token_t = argmax_i ( sampling_logits_t[i] + G_t[i] )

``sampling_logits_t`` are the target's logits at position ``t`` after temperature, ``-inf`` where a warper removed
the token (:func:`specdec.sampling.sampling_logits`, the transform behind ``target_probs``), and ``G_t[i]`` is
standard Gumbel noise that is a pure function of the seed, the sequence's key and ``(t, i)``. Since
``argmax(l + G) ~ softmax(l)`` and each position has fresh noise, this samples the target's law exactly. The
verify walk (:func:`coupled_sample`) computes the target's coupled token at every reached tree node and moves to
the child that carries it; where none does, that token is the recovered token, at a leaf the bonus token. The
committed text is therefore plain coupled sampling's for that seed, whatever the drafter proposed and however
the tree was sized. Model drafters pick candidates with the same noise (:func:`perturbed_logits`).

Definitions the tests pin down:

* ``t`` is the token's index in its sequence, prompt included, padding excluded (the first new token of
  a 5-token prompt is ``t = 5``);
* a sequence's key hashes its prompt's token ids and how many equal prompts came before it in the call
  (:func:`sequence_keys`): the same prompt gives the same text alone or in any batch, and
  ``num_return_sequences`` copies differ;
* the noise is a counter-based hash (splitmix64's finaliser on int64 tensors, wrapping arithmetic, on the
  logits' device: no generator state, no host sync), 53 bits per uniform, ``G = -log(-log(u))`` in float64.

    coupling = Coupling(seed=7)
    keys = torch.tensor(sequence_keys(prompts))                     # [B]
    gumbel = coupling.gumbel(keys, positions, vocab)                # [B, P, vocab] float64
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import InputError, InputTypeError
from specdec.generate_inputs import describe
from specdec.host_copy import to_device
from specdec.rejection import Acceptance, follow_choices
from specdec.sampling import SamplingConfig, choose_max, sampling_logits
from specdec.tree import DraftTree

SAMPLERS = ("standard", "coupled")  # GenerationConfig.sampler


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_POSITION_STREAM = _i64(0x632BE59BD9B4E019)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on negative values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps mod 2**64, as two's complement does),
    IN PLACE (the vocabulary-wide tensors are the cost of coupled sampling: no temporaries); returns ``x``."""
    x ^= _shr(x, 30)
    x *= _MIX1
    x ^= _shr(x, 27)
    x *= _MIX2
    x ^= _shr(x, 31)
    return x


def sequence_keys(prompts: Sequence[Sequence[int]]) -> list[int]:
    """One int64 key per prompt: its token ids and its occurrence among equal prompts before it."""
    seen: dict[tuple[int, ...], int] = {}
    keys = []
    for prompt in prompts:
        ids = tuple(int(t) for t in prompt)
        occurrence = seen.get(ids, 0)
        seen[ids] = occurrence + 1
        digest = hashlib.blake2b(f"{occurrence}:{','.join(map(str, ids))}".encode(), digest_size=8).digest()
        keys.append(_i64(int.from_bytes(digest, "little")))
    return keys


@dataclass(frozen=True)
class Coupling:
    """The shared noise of one generate() call: Gumbel noise G[key, t, i] for the seed."""

    seed: int

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InputTypeError(f"the coupling seed must be an int, got {describe(self.seed)}")
        if not -(2**63) <= self.seed < 2**64:
            raise InputError(f"the coupling seed must fit in 64 bits, got {self.seed}")

    @property
    def _seed_word(self) -> int:
        digest = hashlib.blake2b(f"specdec.coupling:{self.seed}".encode(), digest_size=8).digest()
        return _i64(int.from_bytes(digest, "little"))

    def uniforms(self, keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
        """keys [B] int64, positions [B, P] int64 -> [B, P, vocab] float64 uniforms in (0, 1), on keys' device."""
        positions = positions.to(keys.device, torch.long)
        per_position = mix64(keys[:, None] + self._seed_word + mix64(positions * _GOLDEN + _POSITION_STREAM))
        tokens = torch.arange(1, vocab + 1, dtype=torch.long, device=keys.device) * _GOLDEN  # [vocab]
        bits = mix64(per_position[..., None] + tokens)  # [B, P, vocab]
        # 53 bits + 0.5 need 54: the largest word rounds up to 1.0 (Gumbel noise +inf), kept below 1 as documented
        return _shr(bits, 11).to(torch.float64).add_(0.5).mul_(2.0**-53).clamp_(max=1.0 - 2.0**-53)

    def gumbel(self, keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
        """keys [B], positions [B, P] -> [B, P, vocab] float64 standard Gumbel noise."""
        return self.uniforms(keys, positions, vocab).log_().neg_().log_().neg_()

    def draft_noise(self, key: int, positions: Sequence[int], vocab: int, device: torch.device | str,
                    columns: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence's Gumbel noise at ``positions`` -> [P, vocab] float64 on ``device``, for a drafter;
        ``columns`` [n]: only those token ids (a reduced draft vocabulary's) -> [P, n]."""
        return self.draft_noise_batch([key], [positions], vocab, device, columns)[0]

    def draft_noise_batch(self, keys: Sequence[int] | torch.Tensor, positions: Sequence[Sequence[int]] | torch.Tensor,
                          vocab: int, device: torch.device | str, columns: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`draft_noise` of several sequences at once, P positions each -> [B, P, vocab] (or [B, P, n]).
        ``keys`` [B] and ``positions`` [B, P] may be device tensors already (a CUDA-graph capture reads no host
        values)."""
        key_t = keys if isinstance(keys, torch.Tensor) else to_device(list(keys), torch.long, device)
        if not isinstance(positions, torch.Tensor):
            positions = to_device([list(p) for p in positions], torch.long, device)
        noise = self.gumbel(key_t, positions, vocab)
        return noise if columns is None else noise[..., to_device(columns, torch.long, noise.device)]


def perturbed_logits(logits: torch.Tensor, sampling: SamplingConfig, gumbel: torch.Tensor) -> torch.Tensor:
    """logits [..., n], gumbel [..., n] -> [..., n] float64 ``sampling_logits + G``: the argmax is the coupled
    token, the top-k a Gumbel-top-k sample (without replacement) of softmax(sampling_logits). A drafter over a
    reduced vocabulary passes the noise of its n token ids (``gumbel[..., ids]``)."""
    return sampling_logits(logits.to(torch.float64), sampling) + gumbel


def coupled_tokens(target_logits: torch.Tensor, sampling: SamplingConfig, gumbel: torch.Tensor) -> torch.Tensor:
    """target_logits [..., V], gumbel [..., V] -> [...] int64: the target's coupled token at each row; a row with no
    law gets the id V, as standard sampling gives it (:mod:`specdec.sampling`): a +inf logit too, whose argmax would
    be the first +inf id whatever the noise."""
    perturbed = perturbed_logits(target_logits, sampling, gumbel)
    return choose_max(perturbed).masked_fill_(perturbed.isposinf().any(-1), perturbed.shape[-1])


def coupled_sample(
    trees: Sequence[DraftTree],
    target_logits: torch.Tensor,  # [B, max_nodes + 1, V]; row 0 = root, row 1 + i = node i
    sampling: SamplingConfig,
    coupling: Coupling,
    keys: torch.Tensor,  # [B] int64 sequence keys
    root_positions: Sequence[int],  # [B] index of each root in its sequence (the first new token is root + 1)
) -> list[Acceptance]:
    """Verify draft trees by coupled sampling: the deterministic walk over the target's Gumbel-max tokens.

    Every node at depth d chooses the token at position ``root + 1 + d``, so the noise has one row per depth
    (shared by siblings: they choose the same position's token under different prefixes)."""
    if sampling.greedy:  # no noise: the argmax walk
        return follow_choices(trees, choose_max(target_logits).tolist())
    device, vocab = target_logits.device, target_logits.shape[-1]
    max_depth = max(t.max_depth for t in trees)
    offsets = torch.arange(max_depth + 1, dtype=torch.long)  # [D + 1]
    positions = torch.tensor(list(root_positions), dtype=torch.long)[:, None] + 1 + offsets  # [B, D + 1]
    # host values reach the device through to_device: a blocking copy would wait for every queued kernel
    gumbel = coupling.gumbel(to_device(keys, torch.long, device), to_device(positions, torch.long, device),
                             vocab)  # [B, D + 1, V]
    # one depth at a time: the rows at depth d share the noise of position root + 1 + d, and no [B, rows, V]
    # index or float64 copy of every row is ever built (rows x vocab can be large on a GPU)
    at_depth: list[tuple[list[int], list[int]]] = [([], []) for _ in range(max_depth + 1)]
    for b, tree in enumerate(trees):
        at_depth[0][0].append(b), at_depth[0][1].append(0)
        for i, d in enumerate(tree.depths.tolist()):
            at_depth[d][0].append(b), at_depth[d][1].append(1 + i)
    chosen = torch.zeros(target_logits.shape[:2], dtype=torch.long, device=device)  # [B, max_nodes + 1]
    for d, (batch_rows, tree_rows) in enumerate(at_depth):
        if batch_rows:
            b_idx, r_idx = to_device([batch_rows, tree_rows], torch.long, device)
            chosen[b_idx, r_idx] = coupled_tokens(target_logits[b_idx, r_idx], sampling, gumbel[b_idx, d])
    return follow_choices(trees, chosen.tolist())
