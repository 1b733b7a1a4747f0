"""Medusa heads: the module, its config, and the published checkpoint layout.

Head ``i`` (0-based) reads the target's final-norm hidden state ``h_t`` of token ``t`` and
predicts token ``t + 2 + i`` (the target's own LM head predicts ``t + 1``)::

    head_i(h) = lm_head_i(block_L(... block_1(h)))     block(x) = x + SiLU(W x + b)

Checkpoint layout (as published by FasterDecoding/Medusa), a directory holding

* ``config.json``: ``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``
  (plus, written by specdec and optional on load: ``hidden_size``, ``vocab_size``,
  ``medusa_shared_lm_head``, ``medusa_choices``, ``draft_vocab``);
* ``medusa_lm_head.safetensors``: keys ``{head}.{layer}.linear.weight`` / ``.bias`` for the
  residual blocks and ``{head}.{num_layers}.weight`` for each head's LM head (absent when
  the LM head is shared with the base model). With more than one block per head specdec's blocks are distinct,
  which FasterDecoding's MedusaModel (one block repeated) cannot load.

Reduced draft vocabulary: ``draft_vocab`` in config.json lists the N token ids the heads score;
each own LM head then has N rows (row j scores token ``draft_vocab[j]``) and shared-LM-head heads
use the target's rows of those ids, so the drafter only ever proposes in-vocabulary tokens.
Absent (or empty) = the full vocabulary, as published.

Loading reads this layout only; published ``.pt`` pickles and Medusa-2 checkpoints are converted
once with ``specdec convert-medusa`` (drafters/medusa_convert.py).

    heads = MedusaHeads(MedusaConfig(num_heads=4, num_layers=1, hidden_size=576, vocab_size=49152))
    save_medusa(heads, "out/")            heads = load_medusa("out/")
    logits = heads(hidden)                # [num_heads, batch, vocab]  ([..., N] with a draft_vocab of N ids)
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from specdec.drafters.draft_vocab import DraftVocab
from specdec.drafters.medusa_tree import check_paths, check_ranks
from torch import nn

from specdec.atomic_write import save_tensors, write_json
from specdec.errors import InputError, SpecdecError
from specdec.models.llama import Linear, linear

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "medusa_lm_head.safetensors"


class MedusaCheckpointError(SpecdecError, ValueError):
    """A Medusa checkpoint is missing, corrupt, or does not fit the target model."""


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    shared_lm_head: bool = False  # True: heads reuse the base model's LM head (no own weights)
    base_model_name_or_path: str = ""
    # top-k paths of the static tree, e.g. ((0,), (1,), (0, 0)); () = none chosen yet
    medusa_choices: tuple[tuple[int, ...], ...] = ()
    # reduced draft vocabulary: the token ids the heads score, row j of an LM head <-> draft_vocab[j]; () = all
    draft_vocab: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers", "hidden_size", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < (0 if name == "num_layers" else 1):
                raise InputError(f"MedusaConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.medusa_choices:  # the drafter's checks (ranks, prefixes, size), so that no saved tree is refused later
            check_paths(self.medusa_choices, allow_repeats=True)
        choices = tuple(tuple(int(k) for k in path) for path in self.medusa_choices)
        object.__setattr__(self, "medusa_choices", choices)
        for path in choices:
            if len(path) > self.num_heads:
                raise InputError(
                    f"medusa_choices path {list(path)} must be a non-empty list of top-k ranks, "
                    f"at most num_heads={self.num_heads} long"
                )
        ids = tuple(self.draft_vocab)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise InputError(f"MedusaConfig.draft_vocab must be a list of integer token ids, got {list(ids)[:8]!r}...")
        object.__setattr__(self, "draft_vocab", ids)
        if ids:
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InputError(f"draft_vocab holds token id {bad}, but the vocabulary has "
                                 f"vocab_size={self.vocab_size} tokens (ids 0..{self.vocab_size - 1})")
            if len(set(ids)) != len(ids):
                twice = next(t for t in ids if ids.count(t) > 1)
                raise InputError(f"draft_vocab lists token id {twice} more than once ({len(ids)} ids, "
                                 f"{len(set(ids))} distinct)")
        check_ranks(choices, self.draft_size, bool(ids))

    @property
    def draft_size(self) -> int:
        """Rows of each LM head: the draft vocabulary's size, or the full vocabulary's."""
        return len(self.draft_vocab) or self.vocab_size

    def to_json(self) -> dict:
        return {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "base_model_name_or_path": self.base_model_name_or_path,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "medusa_shared_lm_head": self.shared_lm_head,
            "medusa_choices": [list(p) for p in self.medusa_choices],
            **({"draft_vocab": list(self.draft_vocab)} if self.draft_vocab else {}),
        }


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero so a fresh head starts as its LM head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W and b zero: the block passes its input through."""
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` heads; ``self.heads[i]`` is an nn.Sequential (blocks..., [lm_head of draft_size rows])."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        heads = []
        for _ in range(config.num_heads):
            layers: list[nn.Module] = [ResBlock(config.hidden_size) for _ in range(config.num_layers)]
            if not config.shared_lm_head:
                layers.append(Linear(config.hidden_size, config.draft_size, bias=False))
            heads.append(nn.Sequential(*layers))
        self.heads = nn.ModuleList(heads)
        # [N] token id of each logit column (empty: full vocabulary); not saved in the weights (config.json has it)
        # (on the CPU by name: a loader builds the parameters on the meta device, load_medusa)
        self.register_buffer("draft_ids", torch.tensor(config.draft_vocab, dtype=torch.long, device="cpu"),
                             persistent=False)

    @classmethod
    def from_lm_head(cls, config: MedusaConfig, lm_head_weight: torch.Tensor,
                     device: torch.device | str | None = None) -> MedusaHeads:
        """Fresh heads as Medusa's recipe starts them, on ``device`` (default: the LM head's): every ResBlock zero and
        every own LM head a copy of the base model's rows (:meth:`init_lm_heads_from`), so each head starts as the LM
        head. Built without the random initialisation that copy overwrites: at an 8B target's vocabulary, four heads
        are 2.1 B parameters, drawn on the CPU and then moved, by ``MedusaHeads(config).to(device)``."""
        device = lm_head_weight.device if device is None else torch.device(device)
        with torch.device("meta"):
            heads = cls(config)
        heads.to_empty(device=device)
        heads.draft_ids = torch.tensor(config.draft_vocab, dtype=torch.long, device=device)  # to_empty left it unset
        for block in heads.modules():
            if isinstance(block, ResBlock):
                block.reset_parameters()
        heads.init_lm_heads_from(lm_head_weight)
        return heads

    def vocab(self) -> DraftVocab | None:
        """The maps between logit columns and token ids, on the heads' device; None for full-vocabulary heads."""
        if not self.config.draft_vocab:
            return None
        return DraftVocab(self.draft_ids, self.config.vocab_size)

    def lm_rows(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The base model's LM-head rows [draft_size, hidden] these heads score (all of them when not reduced)."""
        if not self.config.draft_vocab:
            return lm_head_weight
        return lm_head_weight[self.draft_ids.to(lm_head_weight.device)]

    def init_lm_heads_from(self, lm_head_weight: torch.Tensor) -> None:
        """Start every own LM head as a copy of the base model's [vocab, hidden] (Medusa's recipe); with a draft
        vocabulary, as a copy of the rows of its token ids."""
        if self.config.shared_lm_head:
            return
        rows = self.lm_rows(lm_head_weight)
        with torch.no_grad():
            for head in self.heads:
                head[-1].weight.copy_(rows)

    def forward(
        self,
        hidden: torch.Tensor,  # [..., hidden_size] final-norm hidden states of the target
        lm_head_weight: torch.Tensor | None = None,  # [vocab, hidden], needed iff shared_lm_head
    ) -> torch.Tensor:  # [num_heads, ..., draft_size] logits (column j = token draft_vocab[j] when reduced)
        if self.config.shared_lm_head and lm_head_weight is None:
            raise ValueError("these Medusa heads share the base model's LM head: pass lm_head_weight")
        rows = self.lm_rows(lm_head_weight) if self.config.shared_lm_head else None
        out = []
        for head in self.heads:
            x = head(hidden)
            if rows is not None:
                x = linear(x.reshape(-1, x.shape[-1]), rows).view(*x.shape[:-1], rows.shape[0])
            out.append(x)
        return torch.stack(out)


def save_medusa(heads: MedusaHeads, directory: str | os.PathLike) -> Path:
    """Write config.json + medusa_lm_head.safetensors (atomically, file by file). Replacing heads, the old config
    goes first and the new one is written last: a stop between the files leaves weights without a config (refused
    as no checkpoint), never new weights read by the old config."""
    path = Path(directory)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.heads.state_dict().items()}
    (path / CONFIG_FILE).unlink(missing_ok=True)
    save_tensors(path / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    write_json(path / CONFIG_FILE, heads.config.to_json(), indent=2)
    return path


def read_medusa_config(directory: str | os.PathLike, hidden_size: int | None = None,
                       vocab_size: int | None = None, lm_rows: int | None = None,
                       has_lm_heads: bool | None = None) -> MedusaConfig:
    """Read config.json; hidden/vocab sizes missing from it come from the weights or the target.

    ``lm_rows`` (rows of the saved LM heads) stands for the vocabulary size when config.json has neither
    ``vocab_size`` nor ``draft_vocab``; ``vocab_size`` (the target's) is the fallback otherwise.
    ``has_lm_heads`` (whether the weights hold LM heads) decides ``shared_lm_head`` when config.json does not say
    (published heads never say: Medusa's legacy heads without LM heads share the base model's)."""
    path = Path(directory)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise MedusaCheckpointError(f"{path} is not a Medusa checkpoint: {CONFIG_FILE} is missing")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise MedusaCheckpointError(f"{cfg_file} is not valid JSON: {err}") from err
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in raw]
    if missing:
        raise MedusaCheckpointError(f"{cfg_file} lacks {', '.join(missing)}")
    draft_vocab = raw.get("draft_vocab") or []
    choices = raw.get("medusa_choices") or []
    if not isinstance(choices, list) or any(not isinstance(p, list) for p in choices):
        raise MedusaCheckpointError(f"{cfg_file}: medusa_choices must be a list of top-k paths (lists of ranks) "
                                    f"such as [[0], [1], [0, 0]], got {choices!r:.80}")
    if not isinstance(draft_vocab, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in draft_vocab):
        raise MedusaCheckpointError(f"{cfg_file}: draft_vocab must be a list of integer token ids")
    for key in ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size"):
        value = raw.get(key)
        if key in raw and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise MedusaCheckpointError(f"{cfg_file}: {key} must be an integer, got {value!r}")
    fallback_vocab = vocab_size if draft_vocab else (lm_rows or vocab_size)
    try:
        return MedusaConfig(
            num_heads=raw["medusa_num_heads"],
            num_layers=raw["medusa_num_layers"],
            hidden_size=raw.get("hidden_size") or hidden_size or 0,
            vocab_size=raw.get("vocab_size") or fallback_vocab or 0,
            shared_lm_head=bool(raw.get("medusa_shared_lm_head", has_lm_heads is False)),
            base_model_name_or_path=str(raw.get("base_model_name_or_path") or ""),
            medusa_choices=tuple(tuple(p) for p in choices),
            draft_vocab=tuple(draft_vocab),
        )
    except (InputError, ValueError, TypeError) as err:  # a value of the right type that does not fit
        raise MedusaCheckpointError(f"{cfg_file}: {err}") from err


def _is_eagle_head(path: Path) -> bool:
    """Whether ``path`` holds an EAGLE head (specdec's, or an EAGLE / speculators layout): its config says so."""
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    names = raw.get("architectures") if isinstance(raw, dict) else None
    return isinstance(raw, dict) and ("specdec_eagle" in raw or "speculators_config" in raw or any(
        "eagle" in str(n).lower() for n in (names if isinstance(names, list) else [])))


def load_medusa(directory: str | os.PathLike, hidden_size: int | None = None, vocab_size: int | None = None,
                dtype: torch.dtype | None = torch.float32, device: str | torch.device = "cpu") -> MedusaHeads:
    """Load a checkpoint; ``hidden_size`` / ``vocab_size`` of the target are checked against it. ``dtype=None``
    keeps the dtype the file stores."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory)
    weights = path / WEIGHTS_FILE
    convert = f"convert it once with `specdec convert-medusa {path} --output-dir DIR`"
    if not path.exists():
        raise MedusaCheckpointError(f"{path}: the directory does not exist (expected Medusa heads: {CONFIG_FILE} + "
                                    f"{WEIGHTS_FILE})")
    if not weights.is_file():
        from specdec.drafters.medusa_convert import find_published, model_weights_hold

        try:
            found = find_published(path)
        except MedusaCheckpointError:
            found = None
        holds = model_weights_hold(found[1]) if found is not None and found[0] == "model" else None
        ours = f"{CONFIG_FILE} + {WEIGHTS_FILE}, as train-medusa and convert-medusa write it"
        if (path / "medusa_lm_head.pt").exists():
            hint = f" (found medusa_lm_head.pt: pickles are not loaded here; {convert})"
        elif _is_eagle_head(path):
            hint = f" ({path} holds an EAGLE head: --drafter eagle --drafter-option path={path})"
        elif holds == "vllm":
            hint = (f" ({path} holds vLLM's Medusa serving layout (blocks.*, lm_heads.*, as `specdec export-head "
                    f"--format vllm` writes it), which specdec does not read back: pass the directory it was exported "
                    f"from, specdec's own checkpoint ({ours}))")
        elif holds == "none":
            hint = f" ({path} holds a model's weights but no Medusa heads: pass the heads' directory ({ours}))"
        elif found is not None and found[0] == "model":
            hint = f" (the heads may be inside the model's weights, as Medusa-2 / axolotl save them: {convert})"
        else:
            hint = ""
        raise MedusaCheckpointError(f"{path}: {WEIGHTS_FILE} is missing{hint}")
    try:
        # owned copies, not views of the file's memory map: heads overwritten in place (or truncated) while loaded
        # must not change, or crash the process (the heads take these tensors as their parameters, below)
        state = {name: tensor.clone() for name, tensor in load_file(str(weights)).items()}
    except (SafetensorError, OSError, ValueError) as err:
        raise MedusaCheckpointError(f"{weights} is not a readable safetensors file: {err}") from err
    # damaged or diverged heads: every draft would be rejected (NaN logits) without a word, so say so at load
    broken = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        raise MedusaCheckpointError(f"{weights}: weights hold NaN or infinite values "
                                    f"({', '.join(sorted(broken)[:5])}); the checkpoint is damaged or its training "
                                    "diverged")
    lm = [v for k, v in state.items() if k.endswith(".weight") and not k.endswith("linear.weight")]
    first = state.get("0.0.linear.weight", lm[0] if lm else None)  # no residual blocks: the LM heads' columns
    inferred_hidden = int(first.shape[1]) if first is not None else None
    inferred_vocab = int(lm[0].shape[0]) if lm else None
    config = read_medusa_config(path, inferred_hidden or hidden_size, vocab_size, lm_rows=inferred_vocab,
                                has_lm_heads=bool(lm))
    for name, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if want is not None and getattr(config, name) != want:
            raise MedusaCheckpointError(
                f"{path}: Medusa heads have {name}={getattr(config, name)} but the target model has {want}"
            )
    if config.draft_vocab and inferred_vocab is not None and inferred_vocab != config.draft_size:
        raise MedusaCheckpointError(
            f"{path}: config.json's draft_vocab lists {config.draft_size} token ids but the LM heads in "
            f"{WEIGHTS_FILE} have {inferred_vocab} rows"
        )
    with torch.device("meta"):  # no random initialisation only to be overwritten (three 49k-row heads: ~0.3 s)
        heads = MedusaHeads(config)
    missing = sorted(set(heads.heads.state_dict()) - set(state))
    if missing and all(".linear." in k for k in missing):  # FasterDecoding repeats one block; a saver may keep one copy
        raise MedusaCheckpointError(f"{weights} stores fewer residual blocks than {CONFIG_FILE}'s medusa_num_layers="
                                    f"{config.num_layers} (no {missing[0]}); published Medusa heads repeat one block "
                                    f"and may store one copy of it: {convert}")
    try:
        heads.heads.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise MedusaCheckpointError(f"{weights} does not match its config.json: {' '.join(str(err).split())}") from err
    logger.info("loaded %d Medusa heads (%d layers) from %s", config.num_heads, config.num_layers, path)
    return heads.to(device=device, dtype=dtype).eval()
