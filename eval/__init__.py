"""specdec.eval: the losslessness certificate and the acceptance / speed suite."""

if __name__ != "specdec.eval":  # the repo folder must never be imported as a top-level package
    raise ImportError(
        f"{__file__} is the package specdec.eval, not a top-level 'eval': import specdec.eval, and keep the "
        "repo root off sys.path (use the pytest command, or python -P, or run from another directory)"
    )

