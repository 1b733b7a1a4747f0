"""Resuming an acceptance run safely: what its cells were measured with, and the check that a
resumed run measures the same thing (``<out>/settings.json``).

    settings = run_settings(loaded.name, prompts, config, num_processes)
    check_resumable(out, settings, resume)   # ValueError naming what changed
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.eval.acceptance import SuiteConfig


def run_settings(model: str, prompts: dict[str, list[list[int]]], config: "SuiteConfig", num_processes: int) -> dict:
    """What a cell's numbers depend on, as stored in ``<out>/settings.json`` (JSON types only)."""
    digest = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]
    settings = {"model": model, "prompts_sha256": digest, "num_processes": num_processes, **asdict(config)}
    # objects among drafter options (a draft model) are named by their name or type
    return json.loads(json.dumps(settings, default=lambda obj: getattr(obj, "name", None) or type(obj).__name__))


def check_resumable(out: Path, settings: dict, resume: bool) -> None:
    """Refuse to resume over cells measured with other settings: they would be merged into one report."""
    path = out / "settings.json"
    if not resume or not path.exists():
        return
    before = json.loads(path.read_text())
    changed = sorted(k for k in set(settings) | set(before) if settings.get(k) != before.get(k))
    if changed:
        raise ValueError(f"cannot resume {out}: its cells were measured with other settings ({', '.join(changed)} "
                         f"differ); use another output directory, or run without resume to measure every cell anew")
