"""specdec.train: Medusa head training (``specdec train-medusa``)."""

if __name__ != "specdec.train":  # the repo folder must never be imported as a top-level package
    raise ImportError(
        f"{__file__} is the package specdec.train, not a top-level 'train': import specdec.train, and keep the "
        "repo root off sys.path (use the pytest command, or python -P, or run from another directory)"
    )

