"""TrainConfig: every setting of a Medusa training run, validated; its fingerprint guards resume.

    cfg = TrainConfig(model="default", output_dir="heads/", num_heads=3, max_steps=200)
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

SCHEDULES = ("cosine", "linear", "constant")
EVAL_TREES = ("static", "dynamic")
PROMPT_SOURCES = ("builtin", "self")  # self-distillation prompts: the built-in set, or written by the target
SELF_PROMPTS = 1000  # prompt_source="self" without num_prompts
LOSSES = ("ce", "kl")  # against the target's argmax / its whole distribution
PRECISIONS = ("no", "bf16")  # fp16 would need a grad scaler; bf16 does not
SEED_LIMIT = 2**42  # seed * 1_000_003 plus a batch's number stays a 64-bit torch seed (train/loop.py, self_prompts.py)
# the self-distillation's settings: unused by a run on --data (refused there)
DISTILL_FIELDS = ("distill_max_new_tokens", "distill_batch_size", "distill_cuda_graphs")
# the fields read from --data's records: unused by a self-distillation run (refused there)
DATA_FIELDS = ("text_field", "messages_field")
# fields whose command-line flag is not their name (a resume's refusal names the flag too)
OTHER_FLAG_NAMES = {"eagle_steps": " (--train-depth)", "eagle_arch": " (--arch)",
                    "cache_features": " (False: --no-feature-cache)"}
# fields that may differ between a run and its resumption (they do not change the trained heads)
RESUMABLE_FIELDS = frozenset({"output_dir", "save_every", "log_every", "eval_prompts", "eval_max_new_tokens",
                              "tree_budget", "resume", "overwrite", "progress", "eval_tau",
                              "eval_tree"})
# the integer settings: (least, greatest or None); an optional one may be None
INT_RANGES = {"num_heads": (1, None), "num_layers": (0, None), "eagle_steps": (1, None), "num_prompts": (1, None),
              "distill_max_new_tokens": (1, None), "distill_batch_size": (1, None), "seq_len": (1, None),
              "batch_size": (1, None), "grad_accum": (1, None), "warmup_steps": (0, None), "epochs": (1, None),
              "max_steps": (1, None), "seed": (-SEED_LIMIT, SEED_LIMIT), "save_every": (1, None),
              "log_every": (1, None), "tree_budget": (1, 64), "eval_prompts": (1, None),
              "eval_max_new_tokens": (1, None)}
OPTIONAL_INTS = frozenset({"num_prompts", "max_steps"})
INT_LIMITS = {"seed": " (it is scaled into torch's 64-bit seeds)", "tree_budget": " (the largest draft tree)"}
# the real settings: (the test a finite value passes, the range in words)
REAL_RANGES = {"lr": (lambda v: v > 0, "> 0"), "weight_decay": (lambda v: v >= 0, ">= 0"),
               "max_grad_norm": (lambda v: v >= 0, ">= 0 (0: no clipping)"),
               "reg_weight": (lambda v: v >= 0, ">= 0"), "head_decay": (lambda v: 0 < v <= 1, "in (0, 1]"),
               "held_out_fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
               "draft_vocab_coverage": (lambda v: 0 < v <= 1, "in (0, 1]")}

DRAFTERS = ("medusa", "eagle")
# each drafter's own fields: refused away from their defaults when training the other (the Python API; each CLI
# has only its own)
OTHER_DRAFTERS_FIELDS = {"medusa": ("num_heads", "num_layers", "shared_lm_head"),
                         "eagle": ("eagle_steps", "eagle_arch")}
# fields naming a local file or directory (the model may also be an alias or hub id): a resume compares them resolved
PATH_FIELDS = ("model", "data", "prompts_file")


def resolved_path(value: str | None) -> str | None:
    """``value`` as an absolute path when it names something on disk (``./tiny`` and ``tiny`` alike), else as given
    (an alias, a hub id, None)."""
    if value is None or not Path(value).expanduser().exists():
        return value
    return str(Path(value).expanduser().resolve())


# fields added with train-eagle, and their defaults (a run saved before them has none)
_ADDED_LATER = {"drafter": "medusa", "draft_vocab": None, "draft_vocab_coverage": 0.97, "eagle_steps": 3,
                "reg_weight": 1.0, "eagle_arch": "eagle1", "max_grad_norm": 0.0, "prompt_source": "builtin",
                "distill_cuda_graphs": "auto"}


def _with_flags(names: list[str]) -> str:
    """``a_b (--a-b), c (--c)``: fields named with the command-line flag that sets each."""
    return ", ".join(f"{name} (--{name.replace('_', '-')})" for name in names)


@dataclass(frozen=True)
class TrainConfig:
    model: str
    output_dir: str
    drafter: str = "medusa"  # what is trained: Medusa heads or an EAGLE draft layer
    # reduced draft vocabulary: None = the full vocabulary; an int N = the N most frequent training tokens;
    # "auto" = the smallest of DRAFT_VOCAB_SIZES covering draft_vocab_coverage of the training tokens
    draft_vocab: int | str | None = None
    draft_vocab_coverage: float = 0.97
    eagle_steps: int = 3  # draft depths the EAGLE layer is trained through on its own predictions
    reg_weight: float = 1.0  # EAGLE: weight of the feature regression next to the token cross-entropy
    eagle_arch: str = "eagle1"  # "eagle3": fused low / middle / high target features, own norm and LM head
    num_heads: int = 3
    num_layers: int = 1
    shared_lm_head: bool = False
    data: str | None = None  # None: self-distil the built-in prompt set
    text_field: str = "text"
    messages_field: str = "messages"
    num_prompts: int | None = None  # None: every built-in prompt / every prompt of --prompts
    # without --data / --prompts-file: "builtin" = specdec.train.prompts; "self" = num_prompts (default
    # SELF_PROMPTS) user turns the target writes itself (specdec.train.self_prompts)
    prompt_source: str = "builtin"
    prompts_file: str | None = None
    distill_max_new_tokens: int = 128
    # more prompts per call, more tokens/s on a CPU (docs/training/eagle.md); 128 keeps the KV cache of a 1B target
    # under ~3 GB
    distill_batch_size: int = 128
    # self-distillation (and self-written prompts) through CUDA-graph buckets: "auto" = on a CUDA device with the
    # Triton backend (specdec.train.distill.use_graphs), "on" demands the Triton backend, "off" = eager
    distill_cuda_graphs: str = "auto"
    seq_len: int = 512
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0  # clip the global gradient norm to this before each step (0: no clipping)
    epochs: int = 1
    max_steps: int | None = None  # overrides epochs
    head_decay: float = 0.8  # head i's loss weight is head_decay ** i
    loss: str = "ce"
    precision: str = "no"
    cache_features: bool = True  # target features computed once, kept in memory (~4*H bytes per token)
    seed: int = 0
    held_out_fraction: float = 0.05
    save_every: int = 50
    log_every: int = 10
    tree_budget: int = 64  # Medusa only (an EAGLE run times candidate trees): nodes of the medusa_choices tree
    eval_prompts: int = 24
    eval_max_new_tokens: int = 128
    eval_tau: bool = True
    # tree the tau measurement drafts with: "static" = the chosen medusa_choices (tree_budget nodes),
    # "dynamic" = per step, the tree_budget most probable paths under the heads' own top-20
    eval_tree: str = "static"
    resume: bool = False
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.distill_cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"distill_cuda_graphs must be 'auto', 'on' or 'off', got {self.distill_cuda_graphs!r}")
        if self.prompt_source not in PROMPT_SOURCES:
            raise ValueError(f"prompt_source must be one of {PROMPT_SOURCES}, got {self.prompt_source!r}")
        if self.data is not None and self.prompts_file:
            raise ValueError("data and prompts_file are two sources of training text (data: the sequences to train "
                             "on; prompts_file: prompts the target answers); pass one")
        if self.prompt_source == "self" and (self.data is not None or self.prompts_file):
            raise ValueError("prompt_source='self' has the target write the prompts; it cannot be combined with "
                             "data or prompts_file")
        if self.eval_tree not in EVAL_TREES:
            raise ValueError(f"eval_tree must be one of {EVAL_TREES}, got {self.eval_tree!r}")
        if self.drafter == "eagle" and (self.eval_tree, self.tree_budget) != ("static", 64):
            raise ValueError("tree_budget and eval_tree choose Medusa's medusa_choices tree; an EAGLE run chooses its "
                             "tree by timing candidates (train/eagle_evaluate.py): leave them at their defaults")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.draft_vocab is not None and self.draft_vocab != "auto" and (
                not isinstance(self.draft_vocab, int) or isinstance(self.draft_vocab, bool) or self.draft_vocab < 1):
            raise ValueError(f"draft_vocab must be a positive integer, 'auto' or None, got {self.draft_vocab!r}")
        if self.eagle_arch not in ("eagle1", "eagle3"):
            raise ValueError(f"eagle_arch must be 'eagle1' or 'eagle3', got {self.eagle_arch!r}")
        self._refuse_ignored()
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other")

    def _check_numbers(self) -> None:
        """Every numeric setting an integer (not a bool) or a finite number, in its range: refused in one line here,
        not after the model loads (a float count) or in a run that diverges (an infinite lr)."""
        for name, (lo, hi) in INT_RANGES.items():
            value, label = getattr(self, name), name + OTHER_FLAG_NAMES.get(name, "")
            if value is None and name in OPTIONAL_INTS:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{label} must be an integer{' or None' if name in OPTIONAL_INTS else ''}, "
                                 f"got {value!r}")
            if value < lo:
                raise ValueError(f"{label} must be >= {lo}{INT_LIMITS.get(name, '')}, got {value}")
            if hi is not None and value > hi:
                raise ValueError(f"{label} must be <= {hi}{INT_LIMITS.get(name, '')}, got {value}")
        for name, (within, where) in REAL_RANGES.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number {where}, got {value!r}")
            if not math.isfinite(value) or not within(value):
                raise ValueError(f"{name} must be {'' if math.isfinite(value) else 'finite and '}{where}, "
                                 f"got {value}")

    def _refuse_ignored(self) -> None:
        """Settings this run would accept and do nothing with: refused in one line."""
        if self.drafter == "eagle" and self.loss != "ce":
            raise ValueError(f"loss {self.loss!r} (--loss) is train-medusa's: an EAGLE layer is trained with "
                             "cross-entropy against the target's own tokens; leave it at 'ce'")
        if self.reg_weight != 1.0 and (self.drafter, self.eagle_arch) != ("eagle", "eagle1"):
            which = "--arch eagle3 has none (token loss only)" if self.drafter == "eagle" else "Medusa heads have none"
            raise ValueError(f"reg_weight (--reg-weight) weighs EAGLE-1's feature regression and {which}; leave it "
                             "at 1.0")
        default = {f.name: f.default for f in fields(self)}
        if self.draft_vocab_coverage != default["draft_vocab_coverage"] and self.draft_vocab != "auto":
            raise ValueError(f"draft_vocab_coverage (--draft-vocab-coverage) sizes --draft-vocab auto; with "
                             f"draft_vocab {self.draft_vocab or 'full'} it is unused: leave it at "
                             f"{default['draft_vocab_coverage']}, or use --draft-vocab auto")
        other = "medusa" if self.drafter == "eagle" else "eagle"
        for name in OTHER_DRAFTERS_FIELDS[other]:
            if getattr(self, name) != default[name]:
                raise ValueError(f"{name} is {other}'s: training {self.drafter} does nothing with it; leave it at "
                                 f"{default[name]!r}")
        if self.drafter == "medusa" and self.shared_lm_head and self.num_layers == 0:
            raise ValueError("num_layers 0 (--num-layers) with shared_lm_head (--shared-lm-head) leaves the heads no "
                             "weight to train (each would be the target's own LM head): give them a residual block "
                             "(--num-layers 1), or their own LM heads")
        if self.data is not None and self.num_prompts is not None:
            raise ValueError("num_prompts (--num-prompts) limits the self-distillation prompts; with data (--data) "
                             "every record is used: leave it out")
        changed = [name for name in DISTILL_FIELDS if getattr(self, name) != default[name]]
        if self.data is not None and changed:
            raise ValueError(f"{_with_flags(changed)} shape{'s' if len(changed) == 1 else ''} self-distillation, "
                             f"which a run on data (--data) does not do: leave {'it' if len(changed) == 1 else 'them'} "
                             "out")
        named = [name for name in DATA_FIELDS if getattr(self, name) != default[name]]
        if self.data is None and named:
            raise ValueError(f"{_with_flags(named)} name{'s' if len(named) == 1 else ''} a field of the records of "
                             "data (--data); without data the run self-distils prompts and reads no such field: give "
                             f"--data, or leave {'it' if len(named) == 1 else 'them'} out")

    def to_json(self) -> dict:
        return asdict(self)

    def input_stamps(self) -> dict[str, list[int]]:
        """Size and modification time of the files read as training input (--data, --prompts-file; a directory's
        files summed), recorded with each checkpoint: a resume names the ones that changed since."""
        stamps = {}
        for path in (self.data, self.prompts_file):
            if path is None:
                continue
            files = [Path(path)] if Path(path).is_file() else sorted(Path(path).rglob("*"))
            stats = [f.stat() for f in files if f.is_file()]
            stamps[path] = [sum(st.st_size for st in stats), max((st.st_mtime_ns for st in stats), default=0)]
        return stamps

    def resolved_paths(self) -> dict[str, str | None]:
        """The path fields resolved (:func:`resolved_path`), recorded with each checkpoint: a resume compares these,
        not the spelling."""
        return {k: resolved_path(getattr(self, k)) for k in PATH_FIELDS}

    def fingerprint(self) -> str:
        """Hash of everything that shapes the trained heads (not the output dir, logging or evaluation)."""
        core = {k: v for k, v in asdict(self).items() if k not in RESUMABLE_FIELDS}
        for name, default in _ADDED_LATER.items():  # fields added after runs were made: old fingerprints still match
            if core.get(name) == default:
                core.pop(name)
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]

    def differences(self, other: dict) -> list[str]:
        """The fields that shape the trained heads and differ from ``other`` (a saved config): what a resume
        refuses. ``epochs`` does not count where both set ``max_steps``, which overrides it. Paths count resolved
        (``other``'s as recorded at the checkpoint, else resolved now): another spelling of a path is the same run,
        the same spelling from another working directory another."""
        other = {**_ADDED_LATER, **other}
        mine = asdict(self)
        ignored = set(PATH_FIELDS)
        if mine["max_steps"] is not None and other.get("max_steps") == mine["max_steps"]:
            ignored.add("epochs")
        # settings the saved run did nothing with (a run from before they were refused may hold any value)
        if other.get("draft_vocab") != "auto":
            ignored.add("draft_vocab_coverage")
        ignored |= set(OTHER_DRAFTERS_FIELDS["medusa" if other.get("drafter") == "eagle" else "eagle"])
        if other.get("data") is not None and mine["data"] is not None:  # neither self-distils
            ignored |= set(DISTILL_FIELDS)
        saved = {**{k: resolved_path(other.get(k)) for k in PATH_FIELDS}, **(other.get("resolved") or {})}
        now = self.resolved_paths()
        return sorted([f"{k}{OTHER_FLAG_NAMES.get(k, '')}: checkpoint {other.get(k)!r} vs now {mine[k]!r}" for k in mine
                       if k not in RESUMABLE_FIELDS | ignored and other.get(k) != mine[k]]
                      + [f"{k}: checkpoint {saved[k]!r} vs now {now[k]!r}" for k in PATH_FIELDS if saved[k] != now[k]])
