"""Resuming an acceptance run safely: nothing read back from ``<out>`` is trusted unchecked.

    settings = run_settings(model_identity(loaded), prompts, config, num_processes)
    check_resumable(out, settings, resume)          # ResumeError naming settings.json and what is wrong
    write_json(out / "settings.json", settings_record(settings))
    write_json(path, seal_cell(asdict(cell), settings_digest(settings), rank))
    record = open_cell(path, settings_digest(settings))   # ResumeError naming the cell file

File formats (canonical JSON = ``json.dumps(obj, sort_keys=True, separators=(",", ":"))``):

* ``settings.json``: ``{"schema": SETTINGS_SCHEMA, "settings": {...}, "sha256": <SHA-256 of the canonical
  settings>}``; that digest is the run's *settings digest*.
* ``settings.json`` names the model and the drafters' checkpoints by their content (:func:`model_identity`,
  :func:`checkpoint_fingerprint`): a model or head of the same name or path with other weights is other settings.
* its ``machine`` entry (:func:`speed_conditions`: device, processor, torch's threads and version, attention backend)
  is part of the settings: a cell's tokens/s only compare with the same run's plain cell measured under the same
  conditions, so a resume under other ones is refused naming each difference.
* a cell: ``{"schema": CELL_SCHEMA, "settings_sha256": <settings digest it was measured under>, "rank": r | null,
  "cell": {<Cell fields>}, "sha256": <SHA-256 of the canonical object without "sha256">}``.

On resume a finished cell is reused only if its file is valid JSON of this schema, with exactly these keys, its
checksum matches (not edited by hand), it was measured under this run's settings digest and it holds the cell its
file name says. Any other cell is an ERROR, not re-measured: ``ResumeError`` (a ``SpecdecError``, one line, the CLI
exits 2) names every such file and why, and the user deletes them (they are then measured again) or measures every
cell anew (``--overwrite`` instead of ``--resume``). An unsound ``settings.json`` is refused the same way; deleting it
is safe, as each cell is checked against its own settings digest. Cells and ``settings.json`` written before
checksums existed are refused too (their settings cannot be verified); :func:`specdec.eval.acceptance.read_cell`
still reads such a cell outside a resume, for old reports.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.errors import SpecdecError
from specdec.models.fingerprint import model_fingerprint

if TYPE_CHECKING:
    from specdec.eval.acceptance import SuiteConfig

SETTINGS_SCHEMA = "specdec-acceptance-settings/3"  # /2: no machine; /1: a bare settings object, no schema or checksum
_NO_MACHINE_SCHEMA = "specdec-acceptance-settings/2"
CELL_SCHEMA = "specdec-acceptance-cell/3"  # /2: no output digest; /1: bare Cell fields without schema or checksum
OLDER_CELL_SCHEMAS = ("specdec-acceptance-cell/2",)  # read for old reports, never reused by a resume
# one entry of Cell.calibration (acceptance._calibrate writes them)
CALIBRATION_KEYS = frozenset({"query_tokens", "plain_seconds", "verify_seconds", "batch", "context_tokens",
                              "repeats"})
_CELL_KEYS = {"schema", "settings_sha256", "rank", "cell", "sha256"}
_SETTINGS_KEYS = {"schema", "settings", "sha256"}
_ANEW = "measure every cell anew (--overwrite instead of --resume)"
WHOLE_FILE_BYTES = 64 << 20  # checkpoint files up to this size are fingerprinted byte for byte
SAMPLED_BLOCKS, _BLOCK_BYTES = 64, 1 << 16  # of a bigger one: blocks read, evenly spaced


class ResumeError(SpecdecError, ValueError):
    """A file of an acceptance run (``settings.json`` or a cell) cannot be trusted; the message names it."""


def model_identity(loaded: Any) -> dict:
    """What names the measured model by its content, not by its folder's name: the display name, where it was
    loaded from, and :func:`model_fingerprint` of its config and weights."""
    return {"model": loaded.name, "model_source": getattr(loaded, "source", "") or "",
            "model_fingerprint": model_fingerprint(loaded.model)}


def speed_conditions(loaded: Any) -> dict:
    """What a cell's speed depends on besides the settings: the device's type and name (a GPU's; a CPU's model,
    family and flags, as :mod:`specdec.cost_model` keys them), torch's intra-op threads and version, and the attention
    backend. Not the device's index: every process of a run on identical GPUs records the same."""
    import torch

    from specdec import cpu_info

    runner = getattr(loaded, "runner", None)
    device = torch.device(getattr(runner, "device", None) or "cpu")
    processor = ({"device_name": torch.cuda.get_device_name(device)} if device.type == "cuda" else
                 {"device_name": cpu_info.cpu_model(), "cpu": cpu_info.cpu_signature(), "isa": cpu_info.isa()})
    backend = getattr(runner, "backend", None)
    return {"device": device.type, **processor, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "attention": str(getattr(backend, "name", backend))}


def checkpoint_fingerprint(path: Path) -> str | None:
    """SHA-256 (16 hex digits) of a checkpoint by content: a folder's files (not its subfolders) or one file, each by
    name, size and bytes: every byte of a file up to :data:`WHOLE_FILE_BYTES`, of a bigger one (a draft model's
    weights) :data:`SAMPLED_BLOCKS` evenly spaced blocks and its modification time, so a checkpoint saved over the old
    one is told apart without reading gigabytes. None where it cannot be read (the drafter's load says why)."""
    h = hashlib.sha256()
    try:
        files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.name}\0{size}\0".encode())
            with open(f, "rb") as fh:
                if size <= WHOLE_FILE_BYTES:
                    for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                        h.update(chunk)
                    continue
                h.update(str(f.stat().st_mtime_ns).encode())
                for i in range(SAMPLED_BLOCKS):
                    fh.seek(max(0, size - _BLOCK_BYTES) * i // (SAMPLED_BLOCKS - 1))
                    h.update(fh.read(_BLOCK_BYTES))
    except OSError:
        return None
    return h.hexdigest()[:16]


def _by_content(value: Any) -> Any:
    """Drafter options with what names a checkpoint replaced by its content: a string or path naming an existing file
    or folder by ``{"checkpoint": <absolute path>, "fingerprint": checkpoint_fingerprint}`` (the same head spelled
    relative or absolute is one), a model object (a module, or a loaded model's) by its :func:`model_fingerprint`."""
    import torch

    if isinstance(value, dict):
        return {k: _by_content(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_by_content(v) for v in value]
    if isinstance(value, (str, os.PathLike)):
        path = Path(value).expanduser()
        try:
            found = str(value) != "" and path.exists()
        except (OSError, ValueError):  # not a path this system can name
            found = False
        if not found:  # a hub id, a name, or a path the drafter's load refuses
            return os.fspath(value)
        return {"checkpoint": str(path.resolve()), "fingerprint": checkpoint_fingerprint(path)}
    module = value if isinstance(value, torch.nn.Module) else getattr(value, "model", None)
    if isinstance(module, torch.nn.Module):
        return {"object": getattr(value, "name", None) or type(value).__name__,
                "fingerprint": model_fingerprint(module)}
    return value


def run_settings(model: dict, prompts: Any, config: "SuiteConfig", num_processes: int, machine: dict) -> dict:
    """What a cell's numbers depend on, as stored in ``<out>/settings.json`` (JSON types only); ``model``:
    :func:`model_identity`, ``prompts``: anything JSON that fixes the prompts (their ids, or the conversations),
    ``machine``: :func:`speed_conditions`. Drafter options naming a checkpoint (``path=``, a draft ``model=``) are
    recorded by its content (:func:`_by_content`)."""
    digest = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]
    suite = {f.name: getattr(config, f.name) for f in fields(config)}  # not asdict: it would copy a given model
    suite["drafters"] = [[label, _by_content(options)] for label, options in config.drafters]
    settings = {**model, "prompts_sha256": digest, "num_processes": num_processes, **suite, "machine": machine}
    if not settings["renamed"]:  # runs without renamed rows keep the digest they had before rows could be renamed
        del settings["renamed"]
    if settings["speculation"] == "always":  # ... and runs verifying whole trees, the one policy there was
        del settings["speculation"]
    # objects among drafter options (a draft model) are named by their name or type
    return json.loads(json.dumps(settings, default=lambda obj: getattr(obj, "name", None) or type(obj).__name__))


def _sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def settings_digest(settings: dict) -> str:
    """SHA-256 of the canonical settings: recorded in settings.json and in every cell measured under them."""
    return _sha256(settings)


def settings_record(settings: dict) -> dict:
    """What ``<out>/settings.json`` holds."""
    return {"schema": SETTINGS_SCHEMA, "settings": settings, "sha256": settings_digest(settings)}


def seal_cell(cell: dict, settings_sha256: str, rank: int | None) -> dict:
    """A cell file's content: the cell's fields with its schema, settings digest, rank and checksum."""
    record = {"schema": CELL_SCHEMA, "settings_sha256": settings_sha256, "rank": rank, "cell": cell}
    return {**record, "sha256": _sha256(record)}


def load_json(path: Path) -> Any:
    """The JSON in ``path``; ``ResumeError`` naming the file if it cannot be read or parsed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ResumeError(f"{path}: cannot be read ({err.strerror or err})") from err
    except UnicodeDecodeError as err:
        raise ResumeError(f"{path}: not UTF-8 text (byte {err.start})") from err
    except json.JSONDecodeError as err:
        raise ResumeError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from err


def _check_envelope(path: Path, data: Any, schema: str, keys: set[str], what: str) -> None:
    """The schema, exact keys and checksum every file of a run carries."""
    if not isinstance(data, dict):
        raise ResumeError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if "schema" not in data:
        raise ResumeError(f"{path}: written by an older specdec (no schema or checksum), so this {what} file "
                          f"cannot be verified")
    if data["schema"] != schema:
        raise ResumeError(f"{path}: schema {data['schema']!r}, expected {schema!r}")
    missing, extra = sorted(keys - set(data)), sorted(set(data) - keys)
    if missing or extra:
        raise ResumeError(f"{path}: " + "; ".join(f"{label} field(s) {', '.join(names)}" for label, names in
                                                   (("missing", missing), ("unexpected", extra)) if names))
    body = {k: v for k, v in data.items() if k != "sha256"}
    if data["sha256"] != _sha256(body if what == "cell" else data["settings"]):
        raise ResumeError(f"{path}: its sha256 does not match its content (edited by hand, or damaged)")


def read_settings(path: Path) -> dict:
    """The settings recorded in ``path`` (a settings.json), checked; ``ResumeError`` naming the file if not sound."""
    data = load_json(path)
    _check_envelope(path, data, SETTINGS_SCHEMA, _SETTINGS_KEYS, "settings")
    if not isinstance(data["settings"], dict):
        raise ResumeError(f"{path}: 'settings' must be a JSON object, got {type(data['settings']).__name__}")
    return data["settings"]


def check_resumable(out: Path, settings: dict, resume: bool) -> None:
    """Refuse to resume over a ``settings.json`` that is unsound or records other settings: the cells would be
    merged into one report. A missing settings.json is fine (every cell carries its settings digest)."""
    path = out / "settings.json"
    if not resume or not path.exists():
        return
    try:
        before = read_settings(path)
    except ResumeError as err:
        if _schema(path) == _NO_MACHINE_SCHEMA:  # its cells' digests lack the machine too: deleting it cannot help
            raise ResumeError(f"cannot resume {out}: {path} was written by an older specdec, which did not record "
                              f"the device, threads and torch its speeds were measured under; {_ANEW}") from err
        # safe to drop: every cell is checked against its own settings digest
        raise ResumeError(f"cannot resume {out}: {err}; delete it to resume anyway (each cell records the settings "
                          f"it was measured under), or {_ANEW}") from err
    changed = sorted(k for k in set(settings) | set(before) if k != "machine" and settings.get(k) != before.get(k))
    moved = _differences(before.get("machine"), settings.get("machine"))
    if moved:
        also = f"; other settings too: {', '.join(changed)}" if changed else ""
        raise ResumeError(f"cannot resume {out}: its cells were measured under other speed conditions "
                          f"({'; '.join(moved)}{also}); resume under the conditions {path} records, or {_ANEW}")
    drafters = _drafter_changes(before.get("drafters"), settings.get("drafters")) if "drafters" in changed else []
    if drafters:
        also = [k for k in changed if k != "drafters"]
        also_text = f"; other settings too: {', '.join(also)}" if also else ""
        raise ResumeError(f"cannot resume {out}: its cells were measured with other drafters than this run's "
                          f"({path}): {'; '.join(drafters)}{also_text}; use another output directory, or {_ANEW}")
    if changed:
        raise ResumeError(f"cannot resume {out}: its cells were measured with other settings "
                          f"({_setting_changes(before, settings, changed)}; recorded in {path}); resume with those, "
                          f"use another output directory, or {_ANEW}")


def _setting_changes(before: dict, now: dict, changed: list[str]) -> str:
    """The settings ``changed`` between ``before`` (settings.json's) and ``now``, as a refused resume names them:
    ``"num_processes: 2 in settings.json, 1 now"`` where both values are short (a number, a flag, a name), so the run
    can be repeated under them, and the others (digests, lists) by name: ``"prompts_sha256, categories differ"``."""
    shown, named = [], []
    for k in changed:
        values = before.get(k), now.get(k)
        if k.endswith(("sha256", "fingerprint")) or not all(isinstance(v, (bool, int, float, str, type(None)))
                                                             for v in values):
            named.append(k)
        else:
            shown.append(f"{k}: {json.dumps(values[0])} in settings.json, {json.dumps(values[1])} now")
    if named:
        shown.append(f"{', '.join(named)} {'differs' if len(named) == 1 else 'differ'}")
    if "model_fingerprint" in named:  # the one a changed --dtype moves: nothing else records the dtype
        shown.append("the model's fingerprint covers its config, weights and dtype: another checkpoint, or another "
                     "--dtype than the run's")
    return "; ".join(shown)


def _shown(value: Any) -> str:
    """A recorded drafter option as a message names it: a checkpoint by its path and content."""
    if isinstance(value, dict) and "checkpoint" in value:
        return f"{value['checkpoint']} (content {value.get('fingerprint')})"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _option_changes(where: str, before: Any, now: Any) -> list[str]:
    """What differs between two recorded values of the drafter option ``where`` (``eagle.path``), nested options
    walked (``combined.drafters[1].path``)."""
    if before == now:
        return []
    checkpoints = [isinstance(v, dict) and "checkpoint" in v for v in (before, now)]
    if all(checkpoints) and before["checkpoint"] == now["checkpoint"]:
        return [f"{where}: {now['checkpoint']} was written again since (content {before.get('fingerprint')} then, "
                f"{now.get('fingerprint')} now)"]
    if isinstance(before, dict) and isinstance(now, dict) and not any(checkpoints):
        return [c for k in sorted(set(before) | set(now), key=str)
                for c in _option_changes(f"{where}.{k}", before.get(k), now.get(k))]
    if isinstance(before, list) and isinstance(now, list) and len(before) == len(now):
        return [c for i, (b, n) in enumerate(zip(before, now, strict=True))
                for c in _option_changes(f"{where}[{i}]", b, n)]
    return [f"{where}: {_shown(before)} in settings.json, {_shown(now)} now"]


def _drafter_changes(before: Any, now: Any) -> list[str]:
    """Each drafter row whose recorded options differ, and how (``eagle.path= /abs/head was written again since
    ...``); [] where the records cannot be read as rows."""
    rows = [{r[0]: r[1] for r in x if isinstance(r, list) and len(r) == 2} if isinstance(x, list) else None
            for x in (before, now)]
    if rows[0] is None or rows[1] is None:
        return []
    changes = []
    for label in dict.fromkeys([*rows[0], *rows[1]]):
        if label not in rows[0] or label not in rows[1]:
            changes.append(f"row {label} only {'in this run' if label in rows[1] else 'in settings.json'}")
            continue
        changes += _option_changes(str(label), rows[0][label], rows[1][label])
    return changes


def _schema(path: Path) -> Any:
    """The schema a run file names, None where it names none or cannot be read."""
    try:
        data = load_json(path)
    except ResumeError:
        return None
    return data.get("schema") if isinstance(data, dict) else None


def _differences(before: Any, now: Any) -> list[str]:
    """``"threads: 2 in settings.json, 1 now"`` for every entry of two machine records that differs."""
    before, now = (x if isinstance(x, dict) else {} for x in (before, now))
    return [f"{k}: {json.dumps(before.get(k))} in settings.json, {json.dumps(now.get(k))} now"
            for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]


def open_cell(path: Path, settings_sha256: str | None = None, expect: tuple[str, str, int | None] | None = None,
              validate: Callable[[dict], str | None] | None = None) -> dict:
    """The Cell fields stored in ``path``, after checking its schema, keys, checksum, settings digest (when given),
    its fields (``validate``: returns what is wrong, or None) and the (drafter, category, rank) its name says
    (``expect``). ``ResumeError`` naming the file if any of it is not so."""
    data = load_json(path)
    _check_envelope(path, data, CELL_SCHEMA, _CELL_KEYS, "cell")
    if settings_sha256 is not None and data["settings_sha256"] != settings_sha256:
        raise ResumeError(f"{path}: measured under other settings than this run's (settings digest "
                          f"{str(data['settings_sha256'])[:12]}..., this run {settings_sha256[:12]}...)")
    cell = data["cell"]
    if not isinstance(cell, dict):
        raise ResumeError(f"{path}: 'cell' must be a JSON object, got {type(cell).__name__}")
    if validate is not None:
        problem = validate(cell)
        if problem:
            raise ResumeError(f"{path}: {problem}")
    found = (cell.get("drafter"), cell.get("category"), data["rank"])
    if expect is not None and found != expect:
        name = lambda d, c, r: f"{d} / {c}" + ("" if r is None else f" (rank {r})")  # noqa: E731
        raise ResumeError(f"{path}: holds the cell of {name(*found)}, not of {name(*expect)} (copied or renamed?)")
    return cell


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _amount(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


# Cell field annotation -> (check of the value read from JSON, what it must be)
_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "int": (_count, "an integer >= 0"),
    "float": (_amount, "a finite number >= 0"),
    "list[int]": (lambda v: isinstance(v, list) and all(map(_count, v)), "a list of integers >= 0"),
    "list[dict]": (lambda v: isinstance(v, list) and all(
        isinstance(c, dict) and set(c) == CALIBRATION_KEYS and all(map(_amount, c.values())) for c in v),
        f"a list of objects with numbers >= 0 for exactly {', '.join(sorted(CALIBRATION_KEYS))}"),
}


def cell_problem(data: dict, types: dict[str, str]) -> str | None:
    """What is wrong with a cell's fields as read from a file (missing, unexpected, wrongly typed), or None;
    ``types``: each Cell field's annotation (``"int"``, ``"float"``, ``"str"``, ``"list[int]"``, ``"list[dict]"``:
    the calibrations)."""
    missing, extra = sorted(set(types) - set(data)), sorted(set(data) - set(types))
    if missing or extra:
        return "; ".join(f"{label} cell field(s) {', '.join(names)}" for label, names in
                         (("missing", missing), ("unexpected", extra)) if names)
    for name, kind in types.items():
        check, expected = _FIELD_CHECKS[kind]
        if not check(data[name]):
            return f"cell field {name!r} must be {expected}, got {json.dumps(data[name])[:60]}"
    return None


def check_cells(out: Path, found: list[tuple[Path, tuple[str, str, int | None]]], settings_sha256: str,
                validate: Callable[[dict], str | None]) -> None:
    """Check every finished cell a resume would reuse (``found``: path, the cell its name says); one ResumeError
    naming each bad file and why."""
    problems = []
    for path, expect in found:
        try:
            open_cell(path, settings_sha256, expect, validate)
        except ResumeError as err:
            problems.append(str(err))
    if problems:
        them = "it" if len(problems) == 1 else "them"
        raise ResumeError(f"cannot resume {out}: {len(problems)} finished cell file(s) cannot be reused: "
                          f"{'; '.join(problems)}; delete {them} to measure {them} again, or {_ANEW}")
