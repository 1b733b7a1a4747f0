"""``specdec convert-medusa`` and ``specdec export-head``: the drafters' commands, registered without importing torch.

The parsers are built for every ``specdec`` call (``--help`` and argument errors included), so this module imports
only the standard library and specdec's torch-free helpers; each command imports its work (torch with it) when it
runs: :mod:`specdec.drafters.medusa_convert` and :mod:`specdec.drafters.export_head`.
"""
from __future__ import annotations

import argparse
import json

from specdec.help_format import DefaultsHelpFormatter, path_arg

EXPORT_FORMATS = ("speculators", "sglang", "vllm")  # export-head's --format (vllm: the speculators layout)


def add_parser(subparsers) -> None:
    _add_convert_medusa(subparsers)
    _add_export_head(subparsers)


def _add_convert_medusa(subparsers) -> None:
    p = subparsers.add_parser(
        "convert-medusa", help="convert published Medusa heads into specdec's Medusa checkpoint",
        description="Read Medusa heads as FasterDecoding/Medusa publishes them (config.json + medusa_lm_head.pt "
                    "read with torch.load(weights_only=True), or medusa_lm_head.safetensors) or a Medusa-2 / axolotl "
                    "model whose weights hold medusa_head.* tensors, and write config.json + "
                    "medusa_lm_head.safetensors for --drafter medusa --drafter-option path=DIR. Local files only.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("source", type=path_arg,
                   help="the published checkpoint: a directory or its medusa_lm_head.pt / .safetensors")
    p.add_argument("--output-dir", required=True, type=path_arg, help="where to write the converted heads")
    p.add_argument("--base-model", default=None, type=path_arg,
                   help="the model the heads go with (hub id or path; a path is recorded absolute); default: the "
                        "source's base_model_name_or_path, or the source itself for a Medusa-2 model")
    p.add_argument("--medusa-choices", default=None, type=_choices,
                   help="a static tree to store with the heads, as a JSON list of top-k paths, e.g. "
                        "'[[0],[1],[0,0]]' (default: none; the drafter then uses its default tree)")
    p.add_argument("--overwrite", action="store_true", help="replace heads already in --output-dir")
    p.set_defaults(func=_run_convert_medusa)


def _choices(text: str):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not a JSON list of paths: {text!r}") from err
    if not isinstance(value, list) or not all(isinstance(p, list) for p in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of paths (lists of ranks): {text!r}")
    return value


def _run_convert_medusa(args) -> int:
    from specdec.drafters.medusa_convert import CONFIG_FILE, convert_published

    out = convert_published(args.source, args.output_dir, args.base_model, args.medusa_choices, args.overwrite)
    cfg = json.loads((out / CONFIG_FILE).read_text())
    heads, blocks = cfg["medusa_num_heads"], cfg["medusa_num_layers"]
    print(f"wrote {out}: {heads} head{'s' * (heads != 1)}, {blocks} residual block{'s' * (blocks != 1)} each, "
          f"base model {cfg['base_model_name_or_path']}; use it with --drafter medusa --drafter-option path={out}")
    return 0


def _add_export_head(subparsers) -> None:
    p = subparsers.add_parser(
        "export-head", help="write an EAGLE-3 or Medusa head in the layout vLLM / SGLang serve",
        description="Write a head trained or loaded by specdec in the speculators layout (vllm serve reads it; "
                    "--format vllm is the same for EAGLE-3), EAGLE / SGLang's layout, or vLLM's Medusa layout.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("source", type=path_arg,
                   help="the head's directory (specdec's own or any layout the eagle drafter loads)")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="the layout to write")
    p.add_argument("--output-dir", required=True, type=path_arg, help="where to write it")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --output-dir (a directory holding anything else is refused)")
    p.add_argument("--target", default=None, type=path_arg,
                   help="the target model (hub id or path) to name in the config; default: the one the head records")
    p.set_defaults(func=_run_export_head)


def _run_export_head(args) -> int:
    from specdec.drafters.export_head import CONFIG_FILE, export_head

    out, what = export_head(args.source, args.format, args.output_dir, args.target, args.overwrite)
    target = json.loads((out / CONFIG_FILE).read_text())
    named = ((target.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") \
        or target.get("target_model") or target.get("base_model_name_or_path")
    print(f"wrote {what} to {out} ({args.format} layout, target {named})")
    return 0
