"""specdec's command line run in the test's process, for tests of what a command prints and returns."""
from __future__ import annotations


def run_main(argv: list[str], capsys) -> tuple[int, object]:
    """(exit code, what this call alone printed: ``capsys.readouterr()``) of ``specdec ARGV``."""
    from specdec.cli import main

    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr()
