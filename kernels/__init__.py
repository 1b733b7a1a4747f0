"""specdec.kernels: Triton kernels for tree attention over the paged KV cache.

Every kernel has a pure-PyTorch reference with identical semantics
(:mod:`specdec.attention` holds the attention reference the engine runs on CPU).
"""

if __name__ != "specdec.kernels":  # the repo folder must never be imported as a top-level package
    raise ImportError(
        f"{__file__} is the package specdec.kernels, not a top-level 'kernels': import specdec.kernels, and keep the "
        "repo root off sys.path (use the pytest command, or python -P, or run from another directory)"
    )

