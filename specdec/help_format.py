"""What specdec's command-line parsers share: the ``--help`` formatter, and the type of an option naming a path.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)`` to every option. Where X is ``None`` (a required
option, or one whose help says what its absence means, "default: all") that adds ``(default: None)``, which reads as
a value; where the help already names its default it says it twice; a flag gets ``(default: False)``. This one appends
the default only where the help does not mention one, it is not ``None`` and the option takes a value.

:func:`path_arg` is the ``type=`` of every option naming a file, folder or model: the empty string (an unset shell
variable, ``--output-dir "$OUT"``) is refused by the option's name, where it read as the working folder or as the
option left out. :func:`name_commands` makes a missing subcommand read as the commands to choose from.
"""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.nargs == 0 or "default" in text.lower():  # nargs 0: a flag
            return text
        return super()._get_help_string(action)


def name_commands(subparsers) -> None:
    """Once every subcommand of ``subparsers`` is added: argparse said a missing one by its ``dest`` ("the following
    arguments are required: eval_command", a name of the code); it names the commands, as the usage line does."""
    subparsers.metavar = "{" + ",".join(subparsers.choices) + "}"


def path_arg(text: str) -> str:
    """An option's file, folder or model name as given; the empty string refused (argparse names the option)."""
    if not text:
        raise argparse.ArgumentTypeError("the empty string names no file or folder (an unset shell variable?)")
    return text
