"""The drafter contract: what the engine asks of anything that proposes tokens.

Lifecycle, driven by the engine (first ``load_for_target(runner, ...)``: its checkpoint read and checked):

1. ``attach(target)`` once per generate() call: what the drafter may read of the target (runner, KV cache,
   sampling config, ``seed``, the policy's ``costs``); drafters that sample apply ``target.sampling`` to their own
   logits. A reused instance drafts as a fresh one: what it learned from text is forgotten here.
2. ``propose(views)`` at most once per step: one :class:`~specdec.tree.DraftTree` per view (the empty tree is
   allowed). The engine validates every tree before the target verifies it and may verify only an ancestor-closed part
   of it (exact). Whatever chooses or prunes a sampled tree (sizing, a combined drafter) uses only what was fixed
   before its tokens were drawn: the drafter's identity and history and a shape committed to in advance, never the
   drawn tokens, scores computed from them, or a shape that depends on them (a drafter may give ``scores`` and
   token-dependent shapes; they do not decide what of it is verified). With ``speculation="auto"`` the guard may leave
   sequences out of ``views``, or skip the call: a drafter must not assume it sees every step, and reads what was
   committed meanwhile from ``token_ids`` (and ``new_hidden``). A drafter with ``pending_trees`` also offers
   ``propose_pending``: the same trees left on the device (specdec/pending_trees.py), read after the verify's launch.
3. ``on_accept(seq_id, committed)`` after EVERY commit, proposed for or not.
4. ``release(seq_id)`` when a sequence finishes, or its call ends early (an exception).
5. ``detach()`` once at the end of the call, however it ended (after the releases): the drafter drops what belongs
   to the call (the target's view, a KV cache of its own), so a reused instance keeps no dropped target alive.

The speculation policy asks ``cost_key()`` (what the drafter's cost depends on: what is learned is kept per key),
``never_pays_by_shape()`` / ``forward_seconds()`` (one forward of its own model costs a target decode step, by its
shapes / as measured: it is never asked) and ``catches_up`` (a sequence's first call costs more than a step); the
draft audit asks ``draw_source(seed)`` (what a call's random draws come from).
A drafter that sets ``needs_hidden_states = True`` finds in ``SequenceView.new_hidden`` the target's final-norm
hidden states of the positions committed since its previous ``propose``, ending at the token *before* the root
(``feature_layers``: those layers' input streams instead). The engine talks to every drafter through this class
(any object with ``propose`` is wrapped by :func:`as_drafter`).
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.tree import DraftTree

if TYPE_CHECKING:
    from specdec.coupling import Coupling
    from specdec.kv_cache import PagedKVCache
    from specdec.logits_processing import LogitsProcessing
    from specdec.models.llama import LlamaRunner
    from specdec.pending_trees import PendingTrees
    from specdec.sampling import SamplingConfig


@dataclass(frozen=True)
class CostView:
    """The speculation policy's costs as drafters see them, in plain decode steps of the target on this machine:
    what a drafter that weighs its own choices (the combined drafter's child gate, EAGLE's depth) prices them with."""

    # verify cost of n query tokens per sequence at a batch size, c(n) / c(1): the measured curve corrected by the
    # run's own step times (specdec.online_costs), the one the engine sizes trees with
    verify_cost: Callable[[int, int], float]
    # wall seconds of one plain decode step at a batch size, from this run's step times (else the cost model's)
    decode_seconds: Callable[[int], float]


@dataclass(frozen=True)
class TargetView:
    """What a drafter may read of the target. Its KV cache is read-only to drafters except the scratch region
    (``cache.reserve_scratch``: positions past a sequence's ``committed_length``), which a drafter running the
    target's own layers may write; the engine overwrites and commits or releases it (self-draft)."""

    runner: "LlamaRunner"
    cache: "PagedKVCache"
    sampling: "SamplingConfig"
    tokenizer: Any = None  # the target's tokenizer when known (vocabulary checks)
    # coupled sampling (specdec.coupling): the call's shared Gumbel noise; drafters that choose among their own
    # logits rank candidates by perturbed_logits with the noise of each candidate's position; None = standard
    coupling: "Coupling | None" = None
    # the target's logits processors (specdec.logits_processing), None = none: a drafter may apply them to its own
    # logits with each node's prefix (process_prefixes) so its drafts follow the processed target; optional
    processing: "LogitsProcessing | None" = None
    # the speculation policy's costs (None: it does not size trees: speculation="always", seeded standard sampling)
    costs: CostView | None = None
    seed: int | None = None  # generate()'s seed for drafters that sample (None: unseeded)
    # seeded standard sampling: a tree of another shape draws other numbers, so no choice of what to draft may read
    # this machine's measured costs or times (one seed, one text: GenerationConfig.speculation)
    seeded_sampling: bool = False
    graphs: bool = False  # the engine replays its verify steps as captured CUDA graphs (price verifies so)


class TokenView(Sequence[int]):
    """A read-only window onto a sequence's committed tokens: indexing, slicing (a new list), len and
    iteration, no mutation. The engine hands drafters this instead of its own list, so no drafter can
    change committed state (an ``append`` on the engine's list once injected tokens into the output)."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __getitem__(self, index):
        return self._tokens[index]

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self):
        return iter(self._tokens)

    def __repr__(self) -> str:
        return f"TokenView({self._tokens!r})"


@dataclass(frozen=True)
class SequenceView:
    """What a drafter sees of one sequence at ``propose``: its committed tokens, read-only. ``seq_id`` is stable for
    the sequence's life (``on_accept`` and ``release`` name it); ``token_ids[-1]`` is the root of the tree to
    propose; ``token_ids[:num_prompt_tokens]`` is the prompt. Views are built anew at each ``propose``
    (``new_hidden`` is that step's): key what a drafter keeps by ``seq_id``."""

    seq_id: int
    # prompt + every committed token (read-only); the last one is the root of the next draft tree
    token_ids: Sequence[int]
    num_prompt_tokens: int
    # [k, hidden_size] target hidden states (after the final norm) of the k positions committed since the
    # previous propose, ending at token_ids[-2]; only for drafters with needs_hidden_states, None for a
    # one-token prompt's first step
    new_hidden: torch.Tensor | None = None
    noise_key: int = 0  # coupled sampling: the key of this sequence's noise (TargetView.coupling)
    # the deepest node the engine verifies for it this step (the tokens still allowed, max_new_tokens and context,
    # but one: 0 on its last token); None where no engine bounds it (replay, look-back)
    max_depth: int | None = None

    @property
    def last_hidden(self) -> torch.Tensor | None:  # [hidden_size] at token_ids[-2], the row that chose the root
        return None if self.new_hidden is None else self.new_hidden[-1]


class Drafter(ABC):
    """Base class of all drafters. Subclasses set ``name`` and implement ``propose``."""

    name: str = "drafter"
    needs_hidden_states: bool = False
    # with needs_hidden_states: the target layers whose input streams propose reads instead of the final hidden
    # states (an EAGLE-3 head's); read by the engine once, when it is built
    feature_layers: tuple[int, ...] = ()
    # a sequence's first propose does one-off work over its prompt (EAGLE's layer over every prompt row, a draft
    # model's prefill), so its time is no step's; False: every call costs as a step does (self-draft, Medusa)
    catches_up: bool = True
    # propose_pending is offered: the step's trees may stay on the device until the verify is launched
    pending_trees: bool = False
    # propose reads a sequence's tokens alone and costs host time only (no model, no device work): while the guard
    # holds a sequence off and the engine queues its plain steps, it may be asked in hindsight, its deterministic
    # trees judged by the text that follows and never verified (specdec.tree_sizing, Looks)
    looks_back: bool = False
    # its deterministic trees' scores are already calibrated online on the committed tokens (the combined drafter's,
    # per child): the tree sizer takes them as they are, as a second correction over the first one cut right chains
    calibrated_scores: bool = False
    # constructor options only Python can give (a config object, a module, a callable): the command line's
    # --drafter-option lists leave them out (drafters.registry.check_options)
    python_only_options: frozenset[str] = frozenset()

    @classmethod
    def check_nested_options(cls, options: Mapping[str, Any], *, command_line: bool = False) -> None:
        """Refuse, before anything is built, options of the drafters nested in ``options`` (a combined drafter's
        children) that they do not take: drafters.registry.check_options calls it after the drafter's own."""

    def load_for_target(self, runner: "LlamaRunner", tokenizer: Any = None, name: str | None = None) -> None:
        """Read and check what this drafter loads for the target ``runner`` (its checkpoint, its draft model) and
        refuse one made for another model (``name``: the target as its caller named it, for messages; None if
        unknown). build_engine calls it before anything is measured for the call (the row policy, the verify-cost
        calibration: minutes on a big model), so such a refusal comes at once. Idempotent per target: ``attach``
        calls it too (a drafter attached by hand) and then finds it done, never loading twice. The default loads
        nothing."""

    def unload_for_target(self) -> None:
        """Drop what ``load_for_target`` made and no ``attach`` took: build_engine calls it when the call fails in
        between, so a drafter reused across calls holds no draft model for a call that never ran. The default
        holds nothing."""

    def attach(self, target: TargetView) -> None:
        """Called once by the engine before any sequence is added."""
        self.target = target

    @abstractmethod
    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        """One draft tree per sequence, in the order of ``seqs``."""

    def propose_pending(self, seqs: Sequence[SequenceView]) -> "PendingTrees":
        """What :meth:`propose` gives, left on the device (specdec/pending_trees.py); only where ``pending_trees``
        is set. The engine calls it instead of propose on steps whose trees it expects to verify whole."""
        raise NotImplementedError(f"{self.name} does not offer pending trees")

    def on_accept(self, seq_id: int, committed: Sequence[int]) -> None:
        """Tokens committed to ``seq_id`` this step (accepted drafts + recovered/bonus)."""

    def release(self, seq_id: int) -> None:
        """Forget everything about a finished sequence."""

    def detach(self) -> None:
        """The end of the generate() call (every sequence released): drop what belongs to the call, above all the
        ``TargetView`` and anything made from the target (its tensors, a KV cache of the call's size), so that an
        instance kept across calls holds no target the caller dropped. Caches documented as kept across calls with
        the drafter's own model may stay. Nothing is asked of the drafter after it until the next ``attach``. The
        default drops ``self.target``; a drafter that keeps more of the call overrides it."""
        self.target = None

    def cost_key(self) -> str:
        """What this drafter's cost per propose call depends on besides the machine and the target (its type, name
        and settings): what the guard remembers across calls is kept per key. Drafters whose cost depends on a
        model they load add what identifies it."""
        return "|".join([type(self).__qualname__, self.name,
                         *(repr(getattr(self, attr, None)) for attr in ("config", "options", "path"))])

    def draw_source(self, seed: int | None) -> Hashable | None:
        """What this drafter's random draws in one call are a function of, given the seed it is attached with
        (``TargetView.seed``): the draft audit keeps evidence across calls only from sources it has not seen
        (specdec/audit.py). None: torch's global RNG. A drafter that draws from a stream it reseeds per call
        from a seed of its own returns that seed."""
        return seed

    def never_pays_by_shape(self) -> str | None:
        """After ``attach``: why one forward of the drafter's own model does at least a target decode step's work,
        read from what is fixed before a call's first token (the models, their shapes, device and dtype; never a
        timing or a token), so that no draft can pay; None when it may pay. A seeded call acts on it too."""
        return None

    def cheapest_call_seconds(self) -> float | None:
        """After a propose call: wall seconds its next call takes at least, where the drafter knows it to be less than
        the calls it made (the combined drafter, whose gate leaves a child timed as costly out of later calls), else
        None. The break-even guard prices its probes by the lower of this and the calls it timed
        (:meth:`specdec.tree_sizing.TreeSizer.probe_cost`); it asks only when a drafted step did not pay."""
        return None

    def forward_seconds(self) -> float | None:
        """After ``attach``: seconds of one forward of the drafter's own model over one token, measured on this
        machine (cached), or None when it has no model of its own. Every depth of a tree costs at least one
        such forward, so the break-even guard never asks a drafter whose forward costs a target decode step
        (:meth:`specdec.tree_sizing.TreeSizer.never_pays`)."""
        return None


class _ObjectDrafter(Drafter):
    """A plain object with ``propose`` (and optionally ``name``, ``needs_hidden_states``, ``feature_layers``,
    ``catches_up``, ``attach``, ``on_accept``, ``release``, ``detach``) seen through the Drafter contract."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.name = str(getattr(obj, "name", type(obj).__name__))
        self.needs_hidden_states = bool(getattr(obj, "needs_hidden_states", False))
        self.feature_layers = tuple(getattr(obj, "feature_layers", ()) or ())
        self.catches_up = bool(getattr(obj, "catches_up", True))

    def _call(self, method: str, *args: Any) -> Any:
        fn = getattr(self.obj, method, None)
        return fn(*args) if callable(fn) else None

    def attach(self, target: TargetView) -> None:
        self.target = target
        self._call("attach", target)

    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        return self.obj.propose(seqs)

    def cost_key(self) -> str:
        return f"{type(self.obj).__module__}.{type(self.obj).__qualname__}|{self.name}"

    def on_accept(self, seq_id: int, committed: Sequence[int]) -> None:
        self._call("on_accept", seq_id, committed)

    def release(self, seq_id: int) -> None:
        self._call("release", seq_id)

    def detach(self) -> None:
        self.target = None
        self._call("detach")


def as_drafter(obj: Any) -> Drafter | None:
    """``obj`` itself if it is a Drafter (or None), else a Drafter view of an object with ``propose``; anything else
    is a one-line InputTypeError saying what is accepted."""
    if obj is None or isinstance(obj, Drafter):
        return obj
    if not callable(getattr(obj, "propose", None)):
        raise InputTypeError(f"drafter must be None, a Drafter or an object with a propose(sequences) method; "
                             f"{type(obj).__name__} has no propose()")
    return _ObjectDrafter(obj)


@contextmanager
def refusals_named(drafter: str) -> Iterator[None]:
    """A SpecdecError raised inside comes out with the drafter's name in front (``self-draft: widths ...``), for
    checks shared by several drafters (DraftConfig, draft vocabularies) that do not know whose option they check."""
    try:
        yield
    except SpecdecError as err:
        raise type(err)(f"{drafter}: {err}") from None


def refuse_top_k_past(top_k: int, max_nodes: int, nodes: str) -> None:
    """A given ``top_k`` above the tree's node budget (``nodes`` names it) is refused: no node of a tree of
    ``max_nodes`` nodes keeps more children (EAGLE's, MTP's), nor more tokens of a head (Medusa's), so it drafts the
    trees of ``top_k=max_nodes``, more slowly. Raised without the drafter's name: see :func:`refusals_named`."""
    if top_k > max_nodes:
        raise InputError(f"top_k={top_k} exceeds {nodes}={max_nodes}: a tree of {max_nodes} nodes keeps no more "
                         f"children of a node, so it drafts as top_k={max_nodes}, more slowly (lower top_k, or raise "
                         "max_nodes)")


# files a checkpoint directory holds: a path= naming one is refused naming its folder
CHECKPOINT_FILES = (".safetensors", ".json", ".pt", ".bin")


def check_path_option(drafter: str, path: Any) -> str | None:
    """A drafter's ``path=`` option is a checkpoint directory: a str or os.PathLike (None: not given), never the
    empty string (``Path("")`` is the current directory, which would be read instead) nor a file (its folder named).
    Returned with ``~`` expanded, as the target's path is."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"{drafter}: path= must be a checkpoint directory (a str or os.PathLike), got "
                             f"{type(path).__name__} {path!r}")
    if isinstance(path, str) and not path:
        raise InputError(f"{drafter}: path= is the empty string; give a checkpoint directory")
    if path is None:
        return None
    path = os.path.expanduser(path)
    if os.path.isfile(path):  # the checkpoint's weights or config.json named instead of its folder
        folder = f" (the one holding it: {os.path.dirname(path) or '.'})" if path.endswith(CHECKPOINT_FILES) else ""
        raise InputError(f"{drafter}: path={path} is a file; give the checkpoint directory{folder}")
    return path


def check_given_dtype(drafter: str, option: str, module: Any, dtype: Any) -> None:
    """A module the caller gave (``model=``, ``heads=``) runs in its own dtype, the target's: converting it would
    change the caller's weights for good (a float32 head rounded to bfloat16), so another dtype is refused in one
    line, as a target passed loaded is (specdec.models.loader). Moving it to the target's device is left to the
    caller's ``.to()`` convention: in place."""
    weight = next(module.parameters(), None)
    if weight is not None and weight.dtype != dtype:
        raise InputError(f"{drafter}: the {option} given is in {weight.dtype} but the target runs in {dtype}: convert "
                         f"it first ({option.rstrip('=')}.to({dtype}))")
