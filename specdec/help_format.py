"""The ``--help`` formatter of specdec's subcommands: argparse's defaults formatter, minus its noise.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)`` to every option. Where X is ``None`` (a required
option, or one whose help says what its absence means, "default: all") that adds ``(default: None)``, which reads as
a value; where the help already names its default it says it twice. This one appends the default only where the help
does not mention one and it is not ``None``.
"""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "default" in text.lower():
            return text
        return super()._get_help_string(action)
