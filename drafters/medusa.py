"""The "medusa" drafter: Medusa heads on the target's last hidden state propose a token tree.

    generate(model, ids, drafter="medusa", drafter_options={"path": "heads/"})
    generate(model, ids, drafter=MedusaDrafter(heads=my_heads, tree="dynamic", max_nodes=32))
    specdec generate --drafter medusa --drafter-option path=heads/ --drafter-option tree=dynamic

Each step the engine hands over the target's final-norm hidden state of the token before
the root (``SequenceView.last_hidden``); head ``i`` scores the tokens at depth ``i + 1``.
All live sequences go through the heads in one batched forward. Candidates are chosen
deterministically (top-k, ``draft_probs`` None), so the rejection sampler keeps greedy and
sampled output exactly the target's; typical acceptance (lossy) is deliberately not offered.
A one-token prompt has no hidden state before its root: it gets the empty tree that step.

Trees (see drafters/medusa_tree.py):

* ``static`` (default): ``medusa_choices``, a list of top-k paths: ``(2, 0)`` is the best token of head 1 under
  the third-best token of head 0. Every prefix of a path must be listed. Default choices: the checkpoint's saved
  ones, else the ``max_nodes`` best paths under a fixed prior of head accuracies (``default_choices``). Given or
  saved choices are the tree: a ``max_nodes`` or ``top_k`` given with them is refused.
* ``dynamic``: per sequence and step, the ``max_nodes`` paths with the highest product of
  head probabilities (top ``top_k`` tokens per head), grown best-first.

Heads whose checkpoint shares the base model's LM head (``medusa_shared_lm_head``) use the
target's LM head weight. Hidden size and vocabulary are checked against the target when the heads load for it.

Heads over a reduced draft vocabulary (``draft_vocab`` in the checkpoint, N token ids) score
only those N tokens: the top-k ranks are taken among them and mapped back to token ids, so
every candidate is an in-vocabulary token; a shared LM head is cut to those N rows once, on
attach. Ranks in ``medusa_choices`` then count within the N tokens.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from specdec.drafters.base import (
    Drafter,
    SequenceView,
    TargetView,
    check_given_dtype,
    check_path_option,
    refusals_named,
    refuse_top_k_past,
)
from specdec.drafters.loaded_once import load_once
from specdec.drafters.medusa_heads import MedusaCheckpointError, MedusaConfig, MedusaHeads, load_medusa
from specdec.drafters.medusa_tree import (
    check_paths,
    check_ranks,
    default_choices,
    dynamic_tree,
    static_tree,
    validate_choices,
)
from specdec.drafters.top_k import top_k

from specdec.coupling import perturbed_logits
from specdec.errors import InputError, InputTypeError
from specdec.generate_inputs import check_int
from specdec.tree import MAX_TREE_NODES, DraftTree

if TYPE_CHECKING:
    from specdec.models.llama import LlamaRunner

logger = logging.getLogger(__name__)

__all__ = ["MedusaDrafter", "validate_choices"]

DEFAULT_TOP_K = 8
DEFAULT_MAX_NODES = 16


@dataclass(frozen=True)
class MedusaDraftConfig:
    """How the Medusa drafter shapes its tree (validated here, before any checkpoint is read; what needs the heads,
    a path deeper than they are or a rank beyond their vocabulary, is checked when the heads load for the target).

    ``max_nodes`` bounds the dynamic tree and the default static tree (explicit choices: <= 64 paths);
    the default of 16 nodes is sized for CPUs, where verifying many nodes costs more than a decode step.
    ``max_nodes`` and ``top_k`` shape no tree of given or saved ``medusa_choices``: given there, they are refused
    (given choices here, saved ones when the heads are loaded for the target)."""

    tree: str = "static"  # "static" (medusa_choices) | "dynamic" (best-first per step)
    medusa_choices: tuple[tuple[int, ...], ...] | None = None  # static tree paths; None = saved / default
    max_nodes: int | None = None  # nodes of a dynamic or default static tree; None: 16
    top_k: int | None = None  # tokens per head a dynamic tree considers; None: 8, at most the draft vocabulary

    def __post_init__(self) -> None:
        check_int("medusa: max_nodes", self.max_nodes, minimum=1, maximum=MAX_TREE_NODES, optional=True)
        check_int("medusa: top_k", self.top_k, minimum=1, optional=True)
        if self.tree not in ("static", "dynamic"):
            raise InputError(f"medusa: tree must be 'static' or 'dynamic', got {self.tree!r}")
        choices = self.medusa_choices
        if isinstance(choices, str):  # e.g. from a CLI option or a config file
            try:
                choices = json.loads(choices)
            except json.JSONDecodeError as err:
                raise InputError(f"medusa: medusa_choices is not a JSON list of paths: {choices!r}") from err
        if choices is not None:
            if self.tree == "dynamic":
                raise InputError("medusa: medusa_choices define a static tree; they cannot be used with "
                                 "tree='dynamic'")
            try:
                check_paths(choices)
            except InputError as err:
                raise InputError(f"medusa: {err}") from err
            object.__setattr__(self, "medusa_choices", tuple(tuple(int(k) for k in path) for path in choices))
            self.refuse_tree_options(f"the given medusa_choices ({len(self.medusa_choices)} paths)",
                                     "drop {it}, or drop medusa_choices")
        if self.top_k is not None:
            with refusals_named("medusa"):
                refuse_top_k_past(self.top_k, self.nodes,
                                  "max_nodes" if self.max_nodes is not None else "the default max_nodes")

    @property
    def nodes(self) -> int:
        """The node budget of a dynamic or default static tree: ``max_nodes``, else 16."""
        return DEFAULT_MAX_NODES if self.max_nodes is None else self.max_nodes

    def refuse_tree_options(self, tree: str, instead: str) -> None:
        """A given ``max_nodes`` / ``top_k`` beside ``tree`` (a static tree of given or saved choices, which they do
        not shape) is refused in one line saying what to do ``instead`` (its ``{it}``: "it" or "them")."""
        given = [f"{k}={getattr(self, k)}" for k in ("max_nodes", "top_k") if getattr(self, k) is not None]
        if given:
            one = len(given) == 1
            raise InputError(f"medusa: {', '.join(given)} shape{'s' * one} a dynamic tree or the default static tree, "
                             f"not {tree}: {instead.format(it='it' if one else 'them')}")

    def tokens_per_head(self, draft_size: int) -> int:
        """``top_k`` over heads of ``draft_size`` tokens: a given one must fit, the default is cut to fit."""
        if self.top_k is None:
            return min(DEFAULT_TOP_K, draft_size)
        if self.top_k > draft_size:
            raise InputError(f"medusa: top_k={self.top_k} exceeds the draft vocabulary of {draft_size} tokens")
        return self.top_k


class MedusaDrafter(Drafter):
    options_config = MedusaDraftConfig  # what **options configure (drafters.registry.option_names)
    name = "medusa"
    python_only_options = frozenset({"heads"})  # not --drafter-option keys (drafters.registry)
    needs_hidden_states = True
    catches_up = False  # the heads read the root's hidden state only: a first call is a step

    def __init__(self, path: str | None = None, heads: MedusaHeads | None = None, **options) -> None:
        """``path`` (a checkpoint directory) or ``heads`` (a MedusaHeads module); ``options``: MedusaDraftConfig."""
        path = check_path_option("medusa", path)
        if (path is None) == (heads is None):
            raise InputError("medusa: give exactly one of path= (a checkpoint directory; on the command line "
                             "--drafter-option path=DIR) or heads= (a MedusaHeads)")
        if heads is not None and not isinstance(heads, MedusaHeads):
            raise InputTypeError(f"medusa: heads= must be a MedusaHeads module, got {type(heads).__name__}")
        self.config = MedusaDraftConfig(**options)
        self.path, self.heads = path, heads
        self.paths: tuple[tuple[int, ...], ...] = ()
        self.paths_source = ""  # given, saved in the checkpoint, or default (set with paths, for the log)

    def cost_key(self) -> str:  # the checkpoint's path, else the given heads' shape
        return super().cost_key() + ("" if self.path is not None else "|" + repr(self.heads.config))

    def load_for_target(self, runner: "LlamaRunner", tokenizer: Any = None, name: str | None = None) -> None:
        """The heads of ``path=`` read for this target (once per process: drafters/loaded_once.py), and the heads'
        hidden and vocabulary sizes checked against the target's; a max_nodes / top_k beside saved choices refused,
        and the tree checked against the heads (top_k, a path's depth and ranks), before any cost measurement."""
        shape = runner.shape
        if self.path is not None:  # the heads loaded for this target's shape, dtype and device (shared, never moved)
            self.heads = load_once("medusa", self.path, (shape.hidden_size, shape.vocab_size, str(runner.dtype),
                                                         str(runner.device)),
                                   lambda: load_medusa(self.path, shape.hidden_size, shape.vocab_size,
                                                       dtype=runner.dtype, device=runner.device))
        else:
            check_given_dtype("medusa", "heads=", self.heads, runner.dtype)
        cfg = self.heads.config
        for name, want in (("hidden_size", shape.hidden_size), ("vocab_size", shape.vocab_size)):
            if getattr(cfg, name) != want:
                raise MedusaCheckpointError(
                    f"medusa: the heads have {name}={getattr(cfg, name)} but the target model has {name}={want}"
                )
        if self.config.tree == "static" and self.config.medusa_choices is None and cfg.medusa_choices:
            nodes = len(cfg.medusa_choices)
            self.config.refuse_tree_options(f"the static tree of {nodes} nodes saved in the heads' checkpoint "
                                            "(medusa_choices), which is used", "use tree='dynamic', or drop {it}")
        self.k_per_head = self.config.tokens_per_head(cfg.draft_size)
        if self.config.tree == "static":
            self.paths, self.paths_source = self._static_paths(cfg)

    def _static_paths(self, cfg: MedusaConfig) -> tuple[tuple[tuple[int, ...], ...], str]:
        """The static tree's paths (given, saved or default choices), checked against the heads' count and
        vocabulary, and where they come from."""
        if self.config.medusa_choices is not None:
            source, choices = "given", self.config.medusa_choices
        elif cfg.medusa_choices:
            source, choices = "saved in the checkpoint", cfg.medusa_choices
        else:
            source = "default"
            choices = default_choices(cfg.num_heads, self.config.nodes, self.k_per_head)
        try:
            paths = validate_choices(choices, cfg.num_heads)
        except InputError as err:
            raise InputError(f"medusa: {source} medusa_choices: {err}") from err
        try:
            check_ranks(paths, cfg.draft_size, bool(cfg.draft_vocab))
        except InputError as err:
            raise InputError(f"medusa: {err}") from err
        return paths, source

    def attach(self, target: TargetView) -> None:
        self.target = target
        runner = target.runner
        self.load_for_target(runner, target.tokenizer)  # after build_engine's: the heads it loaded (a cache hit)
        cfg = self.heads.config
        weight = next(self.heads.parameters(), None)
        if weight is not None and weight.device != runner.device:  # given heads (load_for_target checked the dtype)
            logger.info("medusa: moving the heads to the target's %s", runner.device)
            self.heads.to(device=runner.device)
        # [draft_size, hidden]: the target's LM-head rows the heads score (a copy of N rows when reduced)
        self.lm_head = self.heads.lm_rows(runner.lm_head) if cfg.shared_lm_head else None
        self.vocab = self.heads.vocab()  # None: full vocabulary; else maps logit columns -> token ids
        if self.vocab is not None:
            self.vocab.to(runner.device)
        self.draft_size = cfg.draft_size
        if self.config.tree == "static":
            logger.info("medusa: static tree of %d nodes, depth %d (%s choices)", len(self.paths),
                        len(self.paths[-1]), self.paths_source)

    def detach(self) -> None:
        """The call's end: its view and the target's LM-head rows (the target's own tensor with a full vocabulary)
        are dropped, so heads kept across calls keep no dropped target alive; the next attach takes them again."""
        super().detach()
        self.lm_head = None

    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        ready = [i for i, v in enumerate(seqs) if v.last_hidden is not None]
        trees = [DraftTree.empty() for _ in seqs]
        if not ready:
            return trees
        runner = self.target.runner
        hidden = torch.stack([seqs[i].last_hidden for i in ready]).to(device=runner.device, dtype=runner.dtype)
        if self.config.tree == "static":
            depth, k = len(self.paths[-1]), max(max(p) for p in self.paths) + 1
        else:
            depth, k = self.heads.config.num_heads, self.k_per_head
        logits = self._head_logits(hidden, depth)  # [depth, B, draft_size], one forward for the batch
        values, indices = top_k(self._scores(logits, [seqs[i] for i in ready]), k)  # [depth, B, k], best first
        tokens = indices if self.vocab is None else self.vocab.to_full(indices)  # [depth, B, k] token ids
        top_tokens = tokens.transpose(0, 1).tolist()  # [B][depth][k]
        if self.config.tree == "static":
            for b, i in enumerate(ready):
                trees[i] = static_tree(self.paths, top_tokens[b])
        else:
            top_logp = values.transpose(0, 1).tolist()
            for b, i in enumerate(ready):
                trees[i] = dynamic_tree(top_tokens[b], top_logp[b], self.config.nodes)
        return trees

    def _scores(self, logits: torch.Tensor, views: list[SequenceView]) -> torch.Tensor:
        """[depth, B, n] head logits -> log-scores that rank candidates: the heads' log-probabilities, or under
        coupled sampling the log-softmax of their perturbed logits (head d guesses position root + 1 + d, so it
        ranks by that position's shared noise: a Gumbel-top-k sample, coupled to the target's choice)."""
        coupling = self.target.coupling
        if coupling is None:
            return logits.float().log_softmax(-1)
        depth, vocab = logits.shape[0], self.target.runner.shape.vocab_size
        columns = None if self.vocab is None else self.vocab.ids
        positions = [range(len(v.token_ids), len(v.token_ids) + depth) for v in views]
        noise = coupling.draft_noise_batch([v.noise_key for v in views], positions, vocab, logits.device,
                                           columns).transpose(0, 1)  # [depth, B, n]
        return perturbed_logits(logits, self.target.sampling, noise).log_softmax(-1)

    def _head_logits(self, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """Logits of the first ``depth`` heads only (a static tree may use fewer than all of them)."""
        out = []
        for head in self.heads.heads[:depth]:
            x = head(hidden)  # [B, hidden] (shared LM head) or [B, draft_size]
            out.append(torch.nn.functional.linear(x, self.lm_head) if self.lm_head is not None else x)
        return torch.stack(out)
